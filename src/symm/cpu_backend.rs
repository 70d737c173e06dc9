//! The CPU backend: blocks in anonymous shared memory (memfd: nothing is
//! ever named in /dev/shm, so a kill -9 leaves nothing behind), laid out
//! like PyTorch's newest CUDA blocks, `[signal pad | buffer]`. Peers' blocks
//! are mapped once per rendezvous from the descriptors they sent.

use super::backend::{Layout, PeerAccess, SymmAllocator, SymmBlock};
use super::mapping::Mapping;
use super::signals::{self, Deadline, Elapsed};
use super::DeviceType;
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::seals::{check_received, seal_against_shrinking, sealable_memfd};
use crate::store::Timeout;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

/// Signal pad bytes unless `set_signal_pad_size` chose others: PyTorch's
/// newest default, 32 channels x 72 ranks x 4.
pub use super::registry::DEFAULT_SIGNAL_PAD_SIZE as SIGNAL_PAD_SIZE;
/// The buffer starts on a page of its own.
const BUFFER_ALIGN: usize = 4096;

/// The CPU allocator, registered by the library under the name "CPU".
pub struct CpuAllocator;

impl SymmAllocator for CpuAllocator {
    fn name(&self) -> &str {
        "CPU"
    }

    fn device_type(&self) -> DeviceType {
        DeviceType::Cpu
    }

    fn alloc(&self, size: usize, device_idx: i32) -> Result<Box<dyn SymmBlock>> {
        if device_idx != 0 && device_idx != -1 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("the CPU backend has one device, index 0 (or -1); got {device_idx}"),
            ));
        }
        Ok(Box::new(CpuBlock::with_pad(size, super::registry::signal_pad_size())?))
    }
}

/// The layout of a block whose buffer holds `size` bytes after a signal
/// pad of `pad` bytes.
pub fn layout_for(size: usize, pad: usize) -> Result<Layout> {
    let buffer_offset = pad.next_multiple_of(BUFFER_ALIGN);
    let block_size = size
        .checked_next_multiple_of(16)
        .and_then(|s| s.checked_add(buffer_offset))
        .and_then(|s| s.checked_next_multiple_of(page_size()))
        .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("symmetric block of {size} bytes is too large")))?;
    Ok(Layout { block_size, buffer_size: size, buffer_offset, signal_pad_size: pad })
}

fn page_size() -> usize {
    // SAFETY: sysconf only reads a system value.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// One rank's block: a memfd and its mapping.
pub struct CpuBlock {
    fd: OwnedFd,
    /// Shared with the rendezvous objects, which may outlive the block.
    map: Arc<Mapping>,
    layout: Layout,
}

impl CpuBlock {
    /// A block with the default signal pad.
    pub fn new(size: usize) -> Result<CpuBlock> {
        Self::with_pad(size, SIGNAL_PAD_SIZE)
    }

    /// A block whose signal pad holds `pad` bytes.
    pub fn with_pad(size: usize, pad: usize) -> Result<CpuBlock> {
        let layout = layout_for(size, pad)?;
        let fd = sealable_memfd(c"ss_symm_mem", "a symmetric block")?;
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), layout.block_size as libc::off_t) } != 0 {
            return Err(Error::last_os_error(format!("unable to size a symmetric block to {} bytes", layout.block_size)));
        }
        // Peers map it only sealed: no rank can shrink it under the others.
        seal_against_shrinking(fd.as_raw_fd(), "a symmetric block")?;
        let map = Arc::new(Mapping::map(fd.as_fd(), layout.block_size, "a symmetric block")?);
        // Real pages now: a full memory reports NoSpace here, not SIGBUS later.
        crate::shm::reserve::reserve(fd.as_raw_fd(), map.base(), 0, layout.block_size, false, "symmetric block")?;
        Ok(CpuBlock { fd, map, layout })
    }
}

impl SymmBlock for CpuBlock {
    fn buffer_ptr(&self) -> *mut u8 {
        // SAFETY: buffer_offset < block_size, inside the mapping.
        unsafe { self.map.base().add(self.layout.buffer_offset) }
    }

    fn device_idx(&self) -> i32 {
        0
    }

    fn layout(&self) -> Layout {
        self.layout
    }

    fn export(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|e| Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), "dup of a symmetric block"))
    }

    fn import(
        &self,
        rank: usize,
        peers: Vec<Option<OwnedFd>>,
        _requests: &[super::request::RendezvousRequest],
        _coll: &dyn super::backend::Collective,
    ) -> Result<Box<dyn PeerAccess>> {
        let ws = peers.len();
        let mut maps = Vec::with_capacity(ws);
        let mut bases = Vec::with_capacity(ws);
        for (r, fd) in peers.into_iter().enumerate() {
            if r == rank {
                bases.push(self.map.base() as usize);
                maps.push(self.map.clone());
                continue;
            }
            let fd = fd.ok_or_else(|| Error::new(ErrorKind::Protocol, format!("no block descriptor from rank {r}")))?;
            check_received(fd.as_raw_fd(), self.layout.block_size, &format!("the block of rank {r}"))?;
            let m = Mapping::map(fd.as_fd(), self.layout.block_size, &format!("the block of rank {r}"))?;
            bases.push(m.base() as usize);
            maps.push(Arc::new(m));
        }
        let buffers = bases.iter().map(|b| b + self.layout.buffer_offset).collect();
        Ok(Box::new(CpuPeers { rank, ws, layout: self.layout, bases, buffers, _maps: maps }))
    }
}

/// Every rank's block mapped here (this rank's is the block's own mapping).
struct CpuPeers {
    rank: usize,
    ws: usize,
    layout: Layout,
    bases: Vec<usize>,
    /// Every rank's buffer address (the "device" pointer array of a CPU
    /// block is this host array).
    buffers: Vec<usize>,
    _maps: Vec<Arc<Mapping>>,
}

impl CpuPeers {
    /// The slot of (channel, src) in `owner`'s pad.
    fn slot(&self, owner: usize, channel: usize, src: usize) -> &AtomicU32 {
        let index = self.ws * channel + src;
        debug_assert!((index + 1) * 4 <= self.layout.signal_pad_size);
        // SAFETY: the index is inside the pad (channel checked by the
        // handle), the pad is 4-aligned at the block's start, and the block
        // stays mapped while `self` lives; peers touch slots only atomically.
        unsafe { &*(self.bases[owner] as *const AtomicU32).add(index) }
    }

    fn put(&self, dst: usize, channel: usize, deadline: &mut Deadline, op: &str, ms: u128) -> Result<()> {
        signals::put(self.slot(dst, channel, self.rank), deadline).map_err(|Elapsed| {
            timeout_error(format!(
                "CPUSymmetricMemory::{op}: rank {} failed to send signal to rank {dst} on channel {channel} after {ms} ms",
                self.rank
            ))
        })
    }

    fn wait(&self, src: usize, channel: usize, deadline: &mut Deadline, op: &str, ms: u128) -> Result<()> {
        signals::wait(self.slot(self.rank, channel, src), deadline).map_err(|Elapsed| {
            timeout_error(format!(
                "CPUSymmetricMemory::{op}: rank {} failed to receive signal from rank {src} on channel {channel} after {ms} ms",
                self.rank
            ))
        })
    }
}

fn timeout_error(msg: String) -> Error {
    Error::new(ErrorKind::Timeout, msg)
}

fn deadline_of(timeout: Timeout) -> (Deadline, u128) {
    (Deadline::after(timeout), timeout.map_or(0, |t| t.as_millis()))
}

impl PeerAccess for CpuPeers {
    fn buffer_ptr(&self, rank: usize) -> *mut u8 {
        (self.bases[rank] + self.layout.buffer_offset) as *mut u8
    }

    fn signal_pad_ptr(&self, rank: usize) -> *mut u8 {
        self.bases[rank] as *mut u8
    }

    fn buffer_ptrs_dev(&self) -> Result<*mut u8> {
        Ok(self.buffers.as_ptr() as *mut u8)
    }

    fn signal_pad_ptrs_dev(&self) -> Result<*mut u8> {
        Ok(self.bases.as_ptr() as *mut u8)
    }

    fn multicast_ptr(&self) -> std::result::Result<*mut u8, String> {
        Err("the CPU backend has no multicast".to_string())
    }

    fn put_signal(&self, dst: usize, channel: usize, timeout: Timeout, _stream: usize) -> Result<()> {
        let (mut deadline, ms) = deadline_of(timeout);
        self.put(dst, channel, &mut deadline, "put_signal", ms)
    }

    fn wait_signal(&self, src: usize, channel: usize, timeout: Timeout, _stream: usize) -> Result<()> {
        let (mut deadline, ms) = deadline_of(timeout);
        self.wait(src, channel, &mut deadline, "wait_signal", ms)
    }

    fn barrier(&self, channel: usize, timeout: Timeout, _stream: usize) -> Result<()> {
        let (mut deadline, ms) = deadline_of(timeout);
        for peer in (0..self.ws).filter(|&p| p != self.rank) {
            self.put(peer, channel, &mut deadline, "barrier", ms)?;
        }
        for peer in (0..self.ws).filter(|&p| p != self.rank) {
            self.wait(peer, channel, &mut deadline, "barrier", ms)?;
        }
        Ok(())
    }
}
