//! libshm: the shared-memory manager daemon that removes segments whose
//! holders went away, its wire protocol, its client, and the managed
//! allocator built on that client (here rather than in `shm`, which the
//! daemon itself uses, so the two do not depend on each other).

pub mod client;
pub mod creator;
pub mod gc;
pub mod limits;
pub mod managed;
pub mod protocol;
pub mod reclaim;
pub mod reglog;
pub mod segment_users;
pub mod segments;
pub mod server;
pub mod spawn;

pub use client::{client_for, default_client, register_with_default, tell_freed, Client};
pub use managed::ManagedMapAllocator;
pub use protocol::AllocInfo;
