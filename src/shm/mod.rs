//! Shared-memory allocators with ATen's names, flags and layouts.

pub mod creator_record;
pub mod flags;
pub mod map;
pub mod mapping;
pub mod names;
pub mod refcounted;
pub mod registry;
pub mod reserve;
pub mod storage_utils;

pub use map::MapAllocator;
pub use mapping::Mapping;
pub use names::new_process_wide_shm_handle;
pub use refcounted::{RefcountedMapAllocator, HEADER_SIZE};
pub use storage_utils::{new_shm_fd_storage, share_memory};
