//! The shareable CPU arena: blocks born in shared memory and shared in
//! O(1) (segment id, offset, size), with no copy.
//!
//! A producer's [`Arena`] carves blocks out of a few large segments
//! (memfd, or named POSIX shm objects), size classes for small blocks and
//! one segment per large block. Sharing a block takes a *hold* in the
//! segment's counter area; the consumer adopts it when it opens the block
//! ([`RemoteView`]) and releases it atomically when it drops the view. A
//! freed block is reused only when no hold on it is left; the holds of
//! consumers that died are reclaimed by [`Arena::collect`] (their pid and
//! start time are recorded beside each hold). A consumer maps each remote
//! segment once per process, so fds and mappings grow with the number of
//! segments, not blocks.

pub mod allocator;
pub mod counters;
pub mod handle;
mod no_manager_warning;
pub mod remote;
pub mod segment;
pub mod size_classes;
pub mod transport;

pub use allocator::{Arena, ArenaOptions, ArenaStats, CollectReport};
pub use handle::{ArenaHandle, Strategy};
pub use remote::{cached_segments, import_segment_fd, open_remote, trim_cache, RemoteView};
