//! What a symmetric-memory backend provides, so the CPU and CUDA backends
//! plug into the same registry, allocation table and rendezvous.

use super::request::RendezvousRequest;
use super::DeviceType;
use crate::error::Result;
use crate::store::Timeout;
use std::os::fd::{OwnedFd, RawFd};

/// Where the parts of one block lie; equal on every rank of a rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of the whole block (signal pad, padding, buffer, rounding).
    pub block_size: usize,
    /// Bytes the caller asked for: the usable buffer.
    pub buffer_size: usize,
    /// Offset of the buffer from the block's start (the pad is at 0).
    pub buffer_offset: usize,
    /// Bytes of the signal pad at the block's start.
    pub signal_pad_size: usize,
}

/// Makes blocks for one device type; registered by backend name.
pub trait SymmAllocator: Send + Sync {
    /// The backend name (`"CPU"`; PyTorch's are `"CUDA"`, `"NVSHMEM"`, `"NCCL"`).
    fn name(&self) -> &str;
    fn device_type(&self) -> DeviceType;
    /// A new block whose buffer holds `size` bytes, its signal pad zeroed.
    fn alloc(&self, size: usize, device_idx: i32) -> Result<Box<dyn SymmBlock>>;
}

/// One rank's block, before and after rendezvous.
pub trait SymmBlock: Send + Sync {
    /// The buffer's address (what `alloc` hands the caller).
    fn buffer_ptr(&self) -> *mut u8;
    fn device_idx(&self) -> i32;
    fn layout(&self) -> Layout;
    /// Whether this block's device could join a multicast object (the
    /// `has_multicast_support` of the rendezvous request).
    fn multicast_capable(&self) -> bool {
        false
    }
    /// Backend rules on the gathered requests, checked on every rank before
    /// any descriptor moves (CUDA: one device per rank unless allowed).
    fn check_requests(&self, _requests: &[RendezvousRequest], _group: &str) -> Result<()> {
        Ok(())
    }
    /// A descriptor that another process can map (sent with SCM_RIGHTS).
    fn export(&self) -> Result<OwnedFd>;
    /// Maps the peers' blocks from their descriptors (`None` at `rank`,
    /// this block) and returns access to all of them; `requests` are every
    /// rank's rendezvous requests; `coll` offers further collective steps
    /// (CUDA multicast), which every rank must take alike.
    fn import(
        &self,
        rank: usize,
        peers: Vec<Option<OwnedFd>>,
        requests: &[RendezvousRequest],
        coll: &dyn Collective,
    ) -> Result<Box<dyn PeerAccess>>;
}

/// Access to every rank's block after a rendezvous. Arguments are already
/// checked by [`super::handle::SymmetricMemory`] (ranks in range, channel
/// within the pad).
pub trait PeerAccess: Send + Sync {
    fn buffer_ptr(&self, rank: usize) -> *mut u8;
    fn signal_pad_ptr(&self, rank: usize) -> *mut u8;
    /// An array of world_size buffer addresses (as mapped here) that the
    /// device can read: device memory for CUDA, host memory for the CPU.
    fn buffer_ptrs_dev(&self) -> Result<*mut u8>;
    /// The same for the signal pads.
    fn signal_pad_ptrs_dev(&self) -> Result<*mut u8>;
    /// The multicast address of the block, or why there is none.
    fn multicast_ptr(&self) -> std::result::Result<*mut u8, String>;
    /// Signals `dst` on `channel`. `stream` is the caller's stream (a CUDA
    /// stream; the CPU backend ignores it).
    fn put_signal(&self, dst: usize, channel: usize, timeout: Timeout, stream: usize) -> Result<()>;
    /// Waits for and consumes the signal of `src` on `channel`.
    fn wait_signal(&self, src: usize, channel: usize, timeout: Timeout, stream: usize) -> Result<()>;
    /// Signals every other rank on `channel`, then waits for each of them.
    fn barrier(&self, channel: usize, timeout: Timeout, stream: usize) -> Result<()>;
}

/// Collective steps among the ranks of a rendezvous, for a backend's
/// `import` (the rendezvous's store and descriptor socket). Every rank must
/// make the same calls in the same order.
pub trait Collective {
    /// Rank `src`'s descriptor (or none) on every other rank (`None` on `src`).
    fn broadcast_fd(&self, src: usize, fd: Option<RawFd>) -> Result<Option<OwnedFd>>;
    /// Every rank's `value`, indexed by rank (a store all-gather; also a barrier).
    fn all_gather(&self, value: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// The collective of a block that is alone (unit tests): every call fails.
pub struct NoCollective;

impl Collective for NoCollective {
    fn broadcast_fd(&self, _src: usize, _fd: Option<RawFd>) -> Result<Option<OwnedFd>> {
        Err(crate::error::Error::new(crate::error::ErrorKind::Unsupported, "no collective outside a rendezvous"))
    }
    fn all_gather(&self, _value: &[u8]) -> Result<Vec<Vec<u8>>> {
        Err(crate::error::Error::new(crate::error::ErrorKind::Unsupported, "no collective outside a rendezvous"))
    }
}
