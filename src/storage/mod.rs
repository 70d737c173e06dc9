//! Storages and how they travel between processes: by file descriptor
//! (SCM_RIGHTS) or by name through a manager, with ATen's semantics.

pub mod fd_passing;
mod heap;
pub mod object;
pub mod share_fd;
pub mod share_name;

pub use fd_passing::{recv_fds, send_fds, MAX_FDS_PER_MESSAGE};
pub use object::{Allocation, ArenaBlock, Storage, WeakStorage};
pub use share_name::FilenameHandle;
