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
//!
//! all_gather of an input that already lies in a symmetric allocation
//! skips the scratch block: each rank posts where its input lies in a small
//! header of its half, and when every rank posted an input in the same
//! allocation, peers copy straight out of each other's inputs and a closing
//! barrier keeps the inputs untouched until every peer has read them.

use super::reduce::{self, Elem, ReduceOp};
use super::SymmetricMemory;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Slices start on multiples of this many bytes (a cache line, and whole
/// vectors for the reduction).
const SLICE_ALIGN: usize = 64;

/// Bytes at the end of the buffer for the two halves' headers (one cache
/// line each; an all_gather posts where its input lies there).
const HEADERS: usize = 2 * SLICE_ALIGN;

/// Where this rank's all_gather input lies when it is part of a symmetric
/// allocation of the group: peers then read it in place.
pub struct SymmetricInput<'a> {
    /// Names the allocation alike on every rank (e.g. the order in which
    /// the group made its allocations).
    pub allocation: u64,
    /// The allocation's size in bytes (equal on every rank).
    pub size: usize,
    /// The input's byte offset in the allocation (each rank's may differ:
    /// its own row of a gathered tensor, say).
    pub offset: usize,
    /// The allocation's buffer on every rank, mapped in this process.
    pub buffers: &'a [*const u8],
}

/// What a rank posts in its half's header before an all_gather's barrier.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Posted {
    in_place: u64,
    allocation: u64,
    size: u64,
    offset: u64,
    bytes: u64,
}

impl Posted {
    /// Whether a peer that posted `self` can be read in place by a rank
    /// that posted `mine`.
    fn readable_with(&self, mine: &Posted) -> bool {
        self.in_place == 1
            && mine.in_place == 1
            && (self.allocation, self.size, self.bytes) == (mine.allocation, mine.size, mine.bytes)
            && self.offset.checked_add(self.bytes).is_some_and(|end| end <= self.size)
    }
}

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
        let half = mem.buffer_size().saturating_sub(HEADERS) / 2 / SLICE_ALIGN * SLICE_ALIGN;
        CpuCollectives { mem, half, turn: AtomicUsize::new(0) }
    }

    /// The block size that lets calls move `bytes` per rank.
    pub fn block_size_for(bytes: usize) -> usize {
        bytes.next_multiple_of(SLICE_ALIGN).saturating_mul(2).max(2 * SLICE_ALIGN).saturating_add(HEADERS)
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

    /// The header of the half at `offset` in `rank`'s buffer.
    fn header(&self, rank: usize, offset: usize) -> *mut u64 {
        let which = if offset == 0 { 0 } else { 1 };
        // SAFETY: the headers follow both halves inside the buffer (see
        // `new`), and region() checked rank.
        unsafe { self.region(rank, 0).add(2 * self.half + which * SLICE_ALIGN) as *mut u64 }
    }

    /// Posts `p` in this rank's header; peers read it after the barrier,
    /// which orders the writes before their reads.
    fn post(&self, offset: usize, p: Posted) {
        let h = self.header(self.mem.rank(), offset);
        // SAFETY: a header is five aligned u64s that only this rank
        // writes, and no peer reads it until the barrier this precedes.
        unsafe {
            for (i, v) in [p.in_place, p.allocation, p.size, p.offset, p.bytes].into_iter().enumerate() {
                std::ptr::write_volatile(h.add(i), v);
            }
        }
    }

    fn posted(&self, rank: usize, offset: usize) -> Posted {
        let h = self.header(rank, offset);
        // SAFETY: read after the barrier that follows `rank`'s post.
        let v = |i| unsafe { std::ptr::read_volatile(h.add(i)) };
        Posted { in_place: v(0), allocation: v(1), size: v(2), offset: v(3), bytes: v(4) }
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
    /// rank (`outputs` has one pointer per rank). When `symmetric` says
    /// where `input` lies in a symmetric allocation, and every rank's input
    /// lies in the same allocation, peers read the inputs in place;
    /// returns whether they did.
    ///
    /// # Safety
    /// `input` is readable and every output writable for `bytes`; the
    /// outputs are disjoint from each other and from `input` (except that
    /// this rank's own output may be `input` itself), and nothing else
    /// touches them during the call. With `symmetric`, `input` is
    /// `buffers[rank] + offset` and every buffer is mapped for `size`.
    pub unsafe fn all_gather(
        &self,
        input: *const u8,
        bytes: usize,
        outputs: &[*mut u8],
        symmetric: Option<SymmetricInput<'_>>,
        timeout: Timeout,
    ) -> Result<bool> {
        // Checked even in place: when the ranks disagree, the inputs go
        // through the scratch after all.
        self.check_fits(bytes, "all_gather")?;
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        if outputs.len() != ws {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("all_gather got {} outputs for {ws} ranks", outputs.len())));
        }
        if let Some(s) = &symmetric {
            if s.buffers.len() != ws || !s.offset.checked_add(bytes).is_some_and(|end| end <= s.size) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "all_gather got {} symmetric buffers for {ws} ranks, or its {bytes} bytes at offset {} overrun the {}-byte allocation",
                        s.buffers.len(),
                        s.offset,
                        s.size
                    ),
                ));
            }
        }
        let off = self.next_region();
        let mine = match &symmetric {
            Some(s) => Posted { in_place: 1, allocation: s.allocation, size: s.size as u64, offset: s.offset as u64, bytes: bytes as u64 },
            None => {
                copy(input, self.region(me, off), bytes);
                Posted { in_place: 0, allocation: 0, size: 0, offset: 0, bytes: bytes as u64 }
            }
        };
        self.post(off, mine);
        self.arrive(timeout)?;
        // This rank's own part needs no peer: copied while they catch up.
        copy(input, outputs[me], bytes);
        self.await_peers(timeout)?;
        // Every rank reads the same headers, so all take the same branch.
        let posts: Vec<Posted> = (0..ws).map(|p| if p == me { mine } else { self.posted(p, off) }).collect();
        if let Some(s) = symmetric.as_ref().filter(|_| posts.iter().all(|p| p.readable_with(&mine))) {
            for p in (0..ws).filter(|&p| p != me) {
                copy(s.buffers[p].add(posts[p].offset as usize), outputs[p], bytes);
            }
            // Peers may change their inputs once this returns.
            return self.mem.barrier(0, timeout, 0).map(|()| true);
        }
        if posts.iter().any(|p| p.in_place != 0) {
            // Some rank offered its input in place, but not every rank
            // in the same allocation: those ranks copy theirs into the
            // scratch now.
            if symmetric.is_some() {
                copy(input, self.region(me, off), bytes);
            }
            self.mem.barrier(0, timeout, 0)?;
        }
        for p in (0..ws).filter(|&p| p != me) {
            copy(self.region(p, off), outputs[p], bytes);
        }
        Ok(false)
    }
}

/// Copies `bytes` from `src` to `dst`, which are equal or disjoint; an
/// empty tensor's address may be null.
unsafe fn copy(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes != 0 && !std::ptr::eq(src, dst) {
        std::ptr::copy_nonoverlapping(src, dst, bytes);
    }
}
