//! all_reduce, broadcast and all_gather among the ranks of a CPU symmetric
//! block used as scratch space.
//!
//! The buffer is split in two halves that calls take by turns. A call
//! writes into its half, passes a barrier, then reads the peers' halves.
//! The next call writes the other half, so it needs no closing barrier: by
//! the time a rank writes a half again (two calls later), every peer has
//! passed the barrier of the call in between, hence finished reading it.
//! Every rank must make the same calls in the same order with equal sizes
//! (checked: see below).
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
//!
//! Every call starts by posting, in the header of its half, what it was
//! passed (kind, dtype, element count and size, op or root: see
//! [`collective_header`](super::collective_header)); after the first
//! barrier each rank checks that every rank posted the same call before it
//! reads any peer's data. A mismatch, or a rank that refused its own
//! arguments (which still takes its turn and passes the barrier), fails
//! every rank alike, and the group stays in step for the next call.

use super::collective_header::{check_agreement, Call, Header, Kind, Placement, HEADER_BYTES};
use super::reduce::{self, Elem, ReduceOp};
use super::SymmetricMemory;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Slices start on multiples of this many bytes (a cache line, and whole
/// vectors for the reduction).
const SLICE_ALIGN: usize = 64;

/// Bytes at the end of the buffer for the two halves' headers.
const HEADERS: usize = 2 * HEADER_BYTES;

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

/// What a broadcast or all_gather moves per rank: `numel` elements of
/// `dtype` (a PyTorch dtype name), `itemsize` bytes each.
#[derive(Clone, Copy, Debug)]
pub struct Items<'a> {
    pub dtype: &'a str,
    pub numel: usize,
    pub itemsize: usize,
}

impl Items<'_> {
    fn bytes(&self, what: &str) -> Result<usize> {
        self.numel.checked_mul(self.itemsize).ok_or_else(|| {
            Error::new(ErrorKind::InvalidArgument, format!("{what} of {} elements of {} bytes overflows", self.numel, self.itemsize))
        })
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
    /// native or not, takes its turn here (and posts its header there
    /// with [`agree_at`](Self::agree_at)).
    pub fn next_region(&self) -> usize {
        self.take_turn().1
    }

    /// This call's number and its half's offset.
    fn take_turn(&self) -> (u64, usize) {
        let seq = self.turn.fetch_add(1, Ordering::Relaxed);
        (seq as u64, (seq & 1) * self.half)
    }

    /// The call number of the half at `offset` (the last turn taken there).
    fn seq_at(&self, offset: usize) -> u64 {
        let next = self.turn.load(Ordering::Relaxed);
        let which = usize::from(offset != 0);
        // The last turn below `next` whose parity is the half's.
        let last = if next > 0 && (next - 1) & 1 == which { next - 1 } else { next.saturating_sub(2) };
        last as u64
    }

    fn region(&self, rank: usize, offset: usize) -> *mut u8 {
        // SAFETY: rank < world_size (callers loop over the group) and
        // offset + half <= buffer size.
        unsafe { self.mem.buffer_ptr(rank as i64).map(|p| p.add(offset)).unwrap_or(std::ptr::null_mut()) }
    }

    /// The header of the half at `offset` in `rank`'s buffer.
    fn header(&self, rank: usize, offset: usize) -> *mut u64 {
        let which = usize::from(offset != 0);
        // SAFETY: the headers follow both halves inside the buffer (see
        // `new`), and region() checked rank.
        unsafe { self.region(rank, 0).add(2 * self.half + which * HEADER_BYTES) as *mut u64 }
    }

    /// Posts `h` in this rank's header; peers read it after the barrier,
    /// which orders the writes before their reads.
    fn post(&self, offset: usize, h: &Header) {
        let at = self.header(self.mem.rank(), offset);
        // SAFETY: a header is aligned u64s that only this rank writes, and
        // no peer reads it until the barrier this precedes.
        unsafe {
            for (i, &v) in h.words().iter().enumerate() {
                std::ptr::write_volatile(at.add(i), v);
            }
        }
    }

    /// Every rank's header of the half at `offset` (this rank's is `mine`).
    fn headers(&self, offset: usize, mine: Header) -> Vec<Header> {
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        (0..ws)
            .map(|p| {
                if p == me {
                    return mine;
                }
                let at = self.header(p, offset);
                // SAFETY: read after the barrier that follows `p`'s post;
                // any bits are a valid u64, and the check names garbage.
                Header::from_words(std::array::from_fn(|i| unsafe { std::ptr::read_volatile(at.add(i)) }))
            })
            .collect()
    }

    /// Posts `call` in the half at `offset` (this rank's data for the call
    /// must already be there), passes a barrier, and checks that every rank
    /// posted the same call: a collective written outside this type (the
    /// Python package reduces dtypes without a native reduction in torch)
    /// starts with this after [`next_region`](Self::next_region).
    pub fn agree_at(&self, offset: usize, call: &Call, timeout: Timeout) -> Result<()> {
        let mine = Header::new(self.seq_at(offset), call, false, None);
        self.post(offset, &mine);
        self.mem.barrier(0, timeout, 0)?;
        check_agreement(&self.headers(offset, mine), self.mem.rank())
    }

    /// [`agree_at`](Self::agree_at) in a turn of its own: every rank checks
    /// that the others passed the same call before acting on it (growing
    /// the scratch block, say).
    pub fn agree(&self, call: &Call, timeout: Timeout) -> Result<()> {
        let (seq, offset) = self.take_turn();
        let mine = Header::new(seq, call, false, None);
        self.post(offset, &mine);
        self.mem.barrier(0, timeout, 0)?;
        check_agreement(&self.headers(offset, mine), self.mem.rank())
    }

    /// A barrier that is also a collective call: it fails, on every rank,
    /// when another rank is in another collective.
    pub fn barrier(&self, timeout: Timeout) -> Result<()> {
        self.agree(&Call::barrier(), timeout)
    }

    /// Tells every peer that this rank refused its own arguments to `call`
    /// (they fail naming it, so none waits for a call this rank will not
    /// make) and passes the call's barrier; returns `why`, this rank's error.
    pub fn refuse(&self, call: &Call, why: Error, timeout: Timeout) -> Error {
        let (seq, offset) = self.take_turn();
        self.refuse_turn(seq, offset, call, why, timeout)
    }

    fn refuse_turn(&self, seq: u64, offset: usize, call: &Call, why: Error, timeout: Timeout) -> Error {
        self.post(offset, &Header::new(seq, call, true, None));
        // The barrier's own failure (a dead peer) matters less than `why`.
        let _ = self.mem.barrier(0, timeout, 0);
        why
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
    /// `output` (which may be `input`). Fails on every rank, before any
    /// output changes, when the ranks passed different sizes, dtypes or ops.
    ///
    /// # Safety
    /// `input` is readable and `output` writable for `n * elem.size()`
    /// bytes, and either equal or disjoint; nothing else touches them
    /// during the call.
    pub unsafe fn all_reduce(&self, input: *const u8, output: *mut u8, n: usize, elem: Elem, op: ReduceOp, timeout: Timeout) -> Result<()> {
        let size = elem.size();
        let call = Call::new(Kind::AllReduce, elem.name(), n, size).with_op(op);
        let (seq, off) = self.take_turn();
        let fits = n
            .checked_mul(size)
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, "all_reduce size overflows"))
            .and_then(|bytes| self.check_fits(bytes, "all_reduce"));
        if let Err(why) = fits {
            return Err(self.refuse_turn(seq, off, &call, why, timeout));
        }
        let (me, ws) = (self.mem.rank(), self.mem.world_size());
        let mine = self.region(me, off);
        let (lo, hi) = self.slice_of(n, elem, me);
        // Peers read every slice but this rank's own, which it reduces
        // straight from its input.
        copy(input, mine, lo * size);
        copy(input.add(hi * size), mine.add(hi * size), (n - hi) * size);
        let header = Header::new(seq, &call, false, None);
        self.post(off, &header);
        self.mem.barrier(0, timeout, 0)?;
        check_agreement(&self.headers(off, header), me)?;
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

    /// Copies `items` at `data` on rank `root` into `data` on every rank.
    /// Fails on every rank, before any data moves, when the ranks passed
    /// different sizes, dtypes or roots.
    ///
    /// # Safety
    /// `data` is readable (on `root`) or writable (elsewhere) for the
    /// items' bytes and nothing else touches it during the call.
    pub unsafe fn broadcast(&self, root: usize, data: *mut u8, items: Items<'_>, timeout: Timeout) -> Result<()> {
        let call = Call::new(Kind::Broadcast, items.dtype, items.numel, items.itemsize).with_root(root);
        let (seq, off) = self.take_turn();
        let ws = self.mem.world_size();
        let bytes = match items.bytes("broadcast").and_then(|b| self.check_fits(b, "broadcast").map(|()| b)).and_then(|b| {
            if root < ws {
                Ok(b)
            } else {
                Err(Error::new(ErrorKind::InvalidArgument, format!("broadcast source rank {root} is not in a group of {ws}")))
            }
        }) {
            Ok(b) => b,
            Err(why) => return Err(self.refuse_turn(seq, off, &call, why, timeout)),
        };
        let me = self.mem.rank();
        if me == root {
            copy(data, self.region(root, off), bytes);
        }
        let header = Header::new(seq, &call, false, None);
        self.post(off, &header);
        self.mem.barrier(0, timeout, 0)?;
        check_agreement(&self.headers(off, header), me)?;
        if me != root {
            copy(self.region(root, off), data, bytes);
        }
        Ok(())
    }

    /// Copies every rank's `items` at `input` into `outputs[rank]` on every
    /// rank (`outputs` has one pointer per rank). When `symmetric` says
    /// where `input` lies in a symmetric allocation, and every rank's input
    /// lies in the same allocation, peers read the inputs in place;
    /// returns whether they did. Fails on every rank when the ranks passed
    /// different sizes or dtypes; only this rank's own output may then
    /// have changed (it holds `input`).
    ///
    /// # Safety
    /// `input` is readable and every output writable for the items' bytes;
    /// the outputs are disjoint from each other and from `input` (except
    /// that this rank's own output may be `input` itself), and nothing else
    /// touches them during the call. With `symmetric`, `input` is
    /// `buffers[rank] + offset` and every buffer is mapped for `size`.
    pub unsafe fn all_gather(
        &self,
        input: *const u8,
        items: Items<'_>,
        outputs: &[*mut u8],
        symmetric: Option<SymmetricInput<'_>>,
        timeout: Timeout,
    ) -> Result<bool> {
        let call = Call::new(Kind::AllGather, items.dtype, items.numel, items.itemsize);
        let (seq, off) = self.take_turn();
        let bytes = match self.gather_bytes(items, outputs, symmetric.as_ref()) {
            Ok(b) => b,
            Err(why) => return Err(self.refuse_turn(seq, off, &call, why, timeout)),
        };
        let me = self.mem.rank();
        let place = symmetric.as_ref().map(|s| Placement {
            allocation: s.allocation,
            size: s.size as u64,
            offset: s.offset as u64,
            bytes: bytes as u64,
        });
        if place.is_none() {
            copy(input, self.region(me, off), bytes);
        }
        let header = Header::new(seq, &call, false, place);
        self.post(off, &header);
        self.arrive(timeout)?;
        // This rank's own part needs no peer: copied while they catch up.
        copy(input, outputs[me], bytes);
        self.await_peers(timeout)?;
        let headers = self.headers(off, header);
        check_agreement(&headers, me)?;
        // Every rank reads the same headers, so all take the same branch.
        let places: Vec<Option<Placement>> = headers.iter().map(Header::place).collect();
        if let (Some(s), Some(mine)) = (symmetric.as_ref(), place) {
            if places.iter().all(|p| p.is_some_and(|p| p.readable_with(&mine))) {
                for p in (0..outputs.len()).filter(|&p| p != me) {
                    let at = places[p].map_or(0, |p| p.offset as usize);
                    copy(s.buffers[p].add(at), outputs[p], bytes);
                }
                // Peers may change their inputs once this returns.
                return self.mem.barrier(0, timeout, 0).map(|()| true);
            }
        }
        if places.iter().any(Option::is_some) {
            // Some rank offered its input in place, but not every rank
            // in the same allocation: those ranks copy theirs into the
            // scratch now.
            if place.is_some() {
                copy(input, self.region(me, off), bytes);
            }
            self.mem.barrier(0, timeout, 0)?;
        }
        for p in (0..outputs.len()).filter(|&p| p != me) {
            copy(self.region(p, off), outputs[p], bytes);
        }
        Ok(false)
    }

    /// The bytes one all_gather moves per rank, or why its arguments are
    /// refused (checked even in place: when the ranks disagree, the inputs
    /// go through the scratch after all).
    fn gather_bytes(&self, items: Items<'_>, outputs: &[*mut u8], symmetric: Option<&SymmetricInput<'_>>) -> Result<usize> {
        let bytes = items.bytes("all_gather")?;
        self.check_fits(bytes, "all_gather")?;
        let ws = self.mem.world_size();
        if outputs.len() != ws {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("all_gather got {} outputs for {ws} ranks", outputs.len())));
        }
        if let Some(s) = symmetric {
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
        Ok(bytes)
    }
}

/// Copies `bytes` from `src` to `dst`, which are equal or disjoint; an
/// empty tensor's address may be null.
unsafe fn copy(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes != 0 && !std::ptr::eq(src, dst) {
        std::ptr::copy_nonoverlapping(src, dst, bytes);
    }
}
