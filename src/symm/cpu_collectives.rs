//! all_reduce, broadcast and all_gather among the ranks of a CPU symmetric
//! block used as scratch space.
//!
//! The buffer is split in two halves that calls take by turns. A call
//! writes into its half, passes a barrier, then reads the peers' halves.
//! The next call writes the other half, so it needs no closing barrier: by
//! the time a rank writes a half again (two calls later), every peer has
//! passed the barrier of the call in between, hence finished reading it.
//! Every rank must make the same calls in the same order with equal sizes.
//!
//! all_reduce is a reduce-scatter then an all-gather: after the first
//! barrier each rank reduces its 1/world slice from every peer's half into
//! its own half and its output; after the second, it copies the other
//! slices from their owners' halves.

use super::reduce::{self, Elem, ReduceOp};
use super::SymmetricMemory;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Slices start on multiples of this many bytes (a cache line, and whole
/// vectors for the reduction).
const SLICE_ALIGN: usize = 64;

/// The collectives over one CPU block (its buffer must be host memory).
pub struct CpuCollectives {
    mem: Arc<SymmetricMemory>,
    half: usize,
    turn: AtomicUsize,
}

impl CpuCollectives {
    /// Collectives over `mem`, a rendezvoused CPU block; each call may move
    /// up to [`capacity`](Self::capacity) bytes per rank.
    pub fn new(mem: Arc<SymmetricMemory>) -> Self {
        let half = mem.buffer_size() / 2 / SLICE_ALIGN * SLICE_ALIGN;
        CpuCollectives { mem, half, turn: AtomicUsize::new(0) }
    }

    /// The block size that lets calls move `bytes` per rank.
    pub fn block_size_for(bytes: usize) -> usize {
        bytes.next_multiple_of(SLICE_ALIGN).saturating_mul(2).max(2 * SLICE_ALIGN)
    }

    pub fn memory(&self) -> &Arc<SymmetricMemory> {
        &self.mem
    }

    /// Bytes per rank one call may move.
    pub fn capacity(&self) -> usize {
        self.half
    }

    /// The offset in the buffer of the half this call uses; every call,
    /// native or not, takes its turn here.
    pub fn next_region(&self) -> usize {
        (self.turn.fetch_add(1, Ordering::Relaxed) & 1) * self.half
    }

    fn region(&self, rank: usize, offset: usize) -> *mut u8 {
        // SAFETY: rank < world_size (callers loop over the group) and
        // offset + half <= buffer size.
        unsafe { self.mem.buffer_ptr(rank as i64).map(|p| p.add(offset)).unwrap_or(std::ptr::null_mut()) }
    }

    fn check_fits(&self, bytes: usize, what: &str) -> Result<()> {
        if bytes > self.half {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{what} of {bytes} bytes per rank does not fit the {}-byte scratch half", self.half),
            ));
        }
        Ok(())
    }

    /// The first half of a barrier: tells every peer this rank arrived.
    fn arrive(&self, timeout: Timeout) -> Result<()> {
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        for p in (0..ws).filter(|&p| p != me) {
            self.mem.put_signal(p as i64, 0, timeout, 0)?;
        }
        Ok(())
    }

    /// The second half: waits until every peer arrived.
    fn await_peers(&self, timeout: Timeout) -> Result<()> {
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        for p in (0..ws).filter(|&p| p != me) {
            self.mem.wait_signal(p as i64, 0, timeout, 0)?;
        }
        Ok(())
    }

    /// The element range `[lo, hi)` that `rank` reduces out of `n`.
    fn slice_of(&self, n: usize, elem: Elem, rank: usize) -> (usize, usize) {
        let per_align = (SLICE_ALIGN / elem.size()).max(1);
        let ws = self.mem.world_size();
        let per = n.div_ceil(ws).next_multiple_of(per_align);
        ((rank * per).min(n), ((rank + 1) * per).min(n))
    }

    /// Reduces `n` elements of `elem` from every rank's `input` into its
    /// `output` (which may be `input`).
    ///
    /// # Safety
    /// `input` is readable and `output` writable for `n * elem.size()`
    /// bytes, and either equal or disjoint; nothing else touches them
    /// during the call.
    pub unsafe fn all_reduce(&self, input: *const u8, output: *mut u8, n: usize, elem: Elem, op: ReduceOp, timeout: Timeout) -> Result<()> {
        let size = elem.size();
        let bytes = n.checked_mul(size).ok_or_else(|| Error::new(ErrorKind::InvalidArgument, "all_reduce size overflows"))?;
        self.check_fits(bytes, "all_reduce")?;
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        let off = self.next_region();
        let mine = self.region(me, off);
        let (lo, hi) = self.slice_of(n, elem, me);
        // Peers read every slice but this rank's own, which it reduces
        // straight from its input.
        copy(input, mine, lo * size);
        copy(input.add(hi * size), mine.add(hi * size), (n - hi) * size);
        self.mem.barrier(0, timeout, 0)?;
        if hi > lo {
            let at = lo * size;
            let srcs: Vec<*const u8> = std::iter::once(input.add(at))
                .chain((0..ws).filter(|&p| p != me).map(|p| self.region(p, off).add(at) as *const u8))
                .collect();
            reduce::reduce(&[mine.add(at), output.add(at)], &srcs, hi - lo, elem, op);
        }
        self.mem.barrier(0, timeout, 0)?;
        for p in (0..ws).filter(|&p| p != me) {
            let (plo, phi) = self.slice_of(n, elem, p);
            if phi > plo {
                copy(self.region(p, off).add(plo * size), output.add(plo * size), (phi - plo) * size);
            }
        }
        Ok(())
    }

    /// Copies `bytes` at `data` on rank `root` into `data` on every rank.
    ///
    /// # Safety
    /// `data` is readable (on `root`) or writable (elsewhere) for `bytes`
    /// and nothing else touches it during the call.
    pub unsafe fn broadcast(&self, root: usize, data: *mut u8, bytes: usize, timeout: Timeout) -> Result<()> {
        self.check_fits(bytes, "broadcast")?;
        if root >= self.mem.world_size() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("broadcast source rank {root} is not in a group of {}", self.mem.world_size()),
            ));
        }
        let off = self.next_region();
        if self.mem.rank() == root {
            copy(data, self.region(root, off), bytes);
        }
        self.mem.barrier(0, timeout, 0)?;
        if self.mem.rank() != root {
            copy(self.region(root, off), data, bytes);
        }
        Ok(())
    }

    /// Copies every rank's `bytes` at `input` into `outputs[rank]` on every
    /// rank (`outputs` has one pointer per rank).
    ///
    /// # Safety
    /// `input` is readable and every output writable for `bytes`; the
    /// outputs are disjoint from each other and from `input` (except that
    /// this rank's own output may be `input` itself), and nothing else
    /// touches them during the call.
    pub unsafe fn all_gather(&self, input: *const u8, bytes: usize, outputs: &[*mut u8], timeout: Timeout) -> Result<()> {
        self.check_fits(bytes, "all_gather")?;
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        if outputs.len() != ws {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("all_gather got {} outputs for {ws} ranks", outputs.len())));
        }
        let off = self.next_region();
        copy(input, self.region(me, off), bytes);
        self.arrive(timeout)?;
        // This rank's own part needs no peer: copied while they catch up.
        copy(input, outputs[me], bytes);
        self.await_peers(timeout)?;
        for p in (0..ws).filter(|&p| p != me) {
            copy(self.region(p, off), outputs[p], bytes);
        }
        Ok(())
    }
}

/// Copies `bytes` from `src` to `dst`, which are equal or disjoint; an
/// empty tensor's address may be null.
unsafe fn copy(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes != 0 && !std::ptr::eq(src, dst) {
        std::ptr::copy_nonoverlapping(src, dst, bytes);
    }
}
