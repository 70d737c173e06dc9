//! Storages and how they travel between processes: by file descriptor
//! (SCM_RIGHTS) or by name through a manager, with ATen's semantics.

mod heap;
pub mod object;
pub mod share_fd;
pub mod share_name;

// Storages are shared by descriptor; the descriptor passing itself is `fdpass`.
pub use crate::fdpass::{recv_fds, send_fds, MAX_FDS_PER_MESSAGE};
pub use object::{Allocation, ArenaBlock, Storage, WeakStorage};
pub use share_name::FilenameHandle;
