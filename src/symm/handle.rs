//! The symmetric-memory object a rendezvous gives: every rank's buffer and
//! signal pad, and the synchronisation calls, with PyTorch's argument
//! checks and messages (docs/pytorch-compat.md) before the backend runs.

use super::backend::{Layout, PeerAccess};
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::time::Duration;

pub struct SymmetricMemory {
    rank: usize,
    world_size: usize,
    layout: Layout,
    group: String,
    peers: Box<dyn PeerAccess>,
}

/// `timeout_ms` as the C API takes it: 0 waits forever.
pub fn timeout_from_ms(timeout_ms: u64) -> Timeout {
    (timeout_ms != 0).then(|| Duration::from_millis(timeout_ms))
}

impl std::fmt::Debug for SymmetricMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricMemory")
            .field("group", &self.group)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("layout", &self.layout)
            .finish()
    }
}

impl SymmetricMemory {
    pub fn new(rank: usize, world_size: usize, layout: Layout, group: &str, peers: Box<dyn PeerAccess>) -> Self {
        SymmetricMemory { rank, world_size, layout, group: group.to_string(), peers }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The usable bytes of every rank's buffer (the allocation's size).
    pub fn buffer_size(&self) -> usize {
        self.layout.buffer_size
    }

    pub fn signal_pad_size(&self) -> usize {
        self.layout.signal_pad_size
    }

    pub fn group(&self) -> &str {
        &self.group
    }

    /// How many channels barrier/put/wait accept: the pad holds `pad / 4`
    /// slots and a channel takes `world_size` of them. (PyTorch checks
    /// `channel < pad / 4 * ws`, which lets slots overflow the pad; this is
    /// the strict bound.)
    pub fn channels(&self) -> usize {
        self.layout.signal_pad_size / 4 / self.world_size
    }

    /// The highest channel accepted (0 when there is none, see `channels`).
    pub fn max_channel(&self) -> usize {
        self.channels().saturating_sub(1)
    }

    fn check_rank(&self, rank: i64) -> Result<usize> {
        if rank < 0 || rank as u64 >= self.world_size as u64 {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("Invalid peer rank: {rank} (world size {})", self.world_size)));
        }
        Ok(rank as usize)
    }

    fn check_channel(&self, channel: i64) -> Result<usize> {
        if channel < 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("The channel for barrier(), put_signal() and wait_signal() must not be negative (got {channel})"),
            ));
        }
        if self.channels() == 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "barrier(), put_signal() and wait_signal() need one signal slot per rank, but the {}-byte signal pad \
                     holds {} slots for {} ranks",
                    self.layout.signal_pad_size,
                    self.layout.signal_pad_size / 4,
                    self.world_size
                ),
            ));
        }
        let max = self.max_channel();
        if channel as u64 > max as u64 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("The maximum supported channel for barrier(), put_signal() and wait_signal() is {max} (got {channel})"),
            ));
        }
        Ok(channel as usize)
    }

    pub fn buffer_ptr(&self, rank: i64) -> Result<*mut u8> {
        let r = self.check_rank(rank)?;
        Ok(self.peers.buffer_ptr(r))
    }

    pub fn signal_pad_ptr(&self, rank: i64) -> Result<*mut u8> {
        let r = self.check_rank(rank)?;
        Ok(self.peers.signal_pad_ptr(r))
    }

    /// `nbytes` of rank `rank`'s buffer from `offset`, within the buffer.
    pub fn get_buffer(&self, rank: i64, nbytes: usize, offset: usize) -> Result<*mut u8> {
        let r = self.check_rank(rank)?;
        let size = self.layout.buffer_size;
        match nbytes.checked_add(offset) {
            Some(req) if req <= size => {}
            req => {
                let req = req.map_or(format!("{nbytes} + {offset}"), |v| v.to_string());
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("SymmetricMemory::get_buffer: the requested size ({req} bytes) exceeds the allocated size ({size} bytes)"),
                ));
            }
        }
        // SAFETY: offset <= buffer_size, inside the mapped buffer.
        Ok(unsafe { self.peers.buffer_ptr(r).add(offset) })
    }

    /// A device-readable array of every rank's buffer address.
    pub fn buffer_ptrs_dev(&self) -> Result<*mut u8> {
        self.peers.buffer_ptrs_dev()
    }

    /// A device-readable array of every rank's signal pad address.
    pub fn signal_pad_ptrs_dev(&self) -> Result<*mut u8> {
        self.peers.signal_pad_ptrs_dev()
    }

    /// Whether the block has a multicast address.
    pub fn has_multicast(&self) -> bool {
        self.peers.multicast_ptr().is_ok()
    }

    /// The block's multicast address; `Unsupported` saying why there is none.
    pub fn multicast_ptr(&self) -> Result<*mut u8> {
        self.peers
            .multicast_ptr()
            .map_err(|why| Error::new(ErrorKind::Unsupported, format!("symmetric memory of group {} has no multicast: {why}", self.group)))
    }

    pub fn barrier(&self, channel: i64, timeout: Timeout, stream: usize) -> Result<()> {
        let c = self.check_channel(channel)?;
        self.peers.barrier(c, timeout, stream)
    }

    pub fn put_signal(&self, dst: i64, channel: i64, timeout: Timeout, stream: usize) -> Result<()> {
        let d = self.check_rank(dst)?;
        let c = self.check_channel(channel)?;
        self.peers.put_signal(d, c, timeout, stream)
    }

    pub fn wait_signal(&self, src: i64, channel: i64, timeout: Timeout, stream: usize) -> Result<()> {
        let s = self.check_rank(src)?;
        let c = self.check_channel(channel)?;
        self.peers.wait_signal(s, c, timeout, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symm::backend::SymmBlock;
    use crate::symm::cpu_backend::CpuBlock;

    /// A real one-rank CPU block, presented as rank 0 of `ws` ranks.
    fn one_rank_as(ws: usize) -> SymmetricMemory {
        let block = CpuBlock::new(64).unwrap();
        let peers = block.import(0, vec![None], &[], &crate::symm::backend::NoCollective).unwrap();
        SymmetricMemory::new(0, ws, block.layout(), "t", peers)
    }

    #[test]
    fn channel_bound_is_strict() {
        let m = one_rank_as(2);
        assert_eq!((m.channels(), m.max_channel()), (1152, 1151));
        let t = timeout_from_ms(10);
        assert_eq!(m.put_signal(0, 1152, t, 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let m = one_rank_as(72); // PyTorch's largest P2P domain: 32 channels
        assert_eq!(m.max_channel(), 31);
    }

    #[test]
    fn more_ranks_than_slots_has_no_channel() {
        let m = one_rank_as(3000);
        let e = m.put_signal(0, 0, timeout_from_ms(10), 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.message().contains("holds 2304 slots for 3000 ranks"), "{}", e.message());
        assert_eq!(m.barrier(0, timeout_from_ms(10), 0).unwrap_err().kind(), ErrorKind::Unsupported);
    }
}
