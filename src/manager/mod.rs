//! libshm: the shared-memory manager daemon that removes segments whose
//! holders went away, its wire protocol, and the client the managed
//! allocator uses.

pub mod client;
pub mod protocol;
pub mod reclaim;
pub mod segment_users;
pub mod server;
pub mod spawn;

pub use client::{client_for, default_client, Client};
pub use protocol::AllocInfo;
