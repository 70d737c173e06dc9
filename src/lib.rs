//! storage-sharing: the storage-sharing layer of a tensor framework.
//!
//! Shared-memory allocators that match ATen's names, flags and layouts
//! byte for byte ([`shm`]), behind a C ABI ([`ffi`], header
//! `include/storage_sharing.h`). The safe Rust API is public too; the core
//! modules know nothing of C.

pub mod arena;
pub mod content_store;
pub mod cuda;
pub mod error;
pub mod fdpass;
pub mod ffi;
pub mod fork_safe;
pub mod lock_file;
pub mod log;
pub mod manager;
pub(crate) mod poller;
pub mod proc_identity;
pub mod shm;
pub mod storage;
pub mod store;
pub mod symm;
pub mod syscalls;
#[cfg(test)]
mod test_support;

pub use error::{Error, ErrorKind, Result};

/// This library's version (Cargo.toml's), what `ss_version()` returns.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
