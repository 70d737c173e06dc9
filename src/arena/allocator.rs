//! The producer's side: blocks carved out of shared segments, their
//! shares (holds), and their reuse once no consumer holds them.

use super::counters::{self, FREE, HELD, IN_FLIGHT};
use super::handle::{ArenaHandle, Strategy};
use super::segment::{page_size, round_up, Segment};
use super::size_classes::{class_align, class_count, class_for, class_size, MAX_ALIGN};
use crate::error::{Error, ErrorKind, Result};
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};

/// How an arena is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaOptions {
    /// Bytes of data in each shared segment of small blocks.
    pub segment_size: usize,
    pub strategy: Strategy,
    /// Hold slots per small-block segment: how many shares of its blocks
    /// may be in flight or held by consumers at once.
    pub max_holds: usize,
    /// Blocks above this size get a segment of their own (freed with them).
    /// 0 (the default): automatic, 1 MiB or a quarter of `segment_size`
    /// if that is less.
    pub large_threshold: usize,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions { segment_size: 64 << 20, strategy: Strategy::Fd, max_holds: 4096, large_threshold: 0 }
    }
}

/// The large threshold an arena gets when its options leave it automatic.
const AUTO_LARGE_THRESHOLD: usize = 1 << 20;

/// Hold slots of a segment that holds one large block.
const LARGE_SEGMENT_SLOTS: usize = 256;

/// A small-block segment's pages are reserved in steps of this many bytes
/// as blocks are carved, not all at creation: a new segment costs about
/// what its first blocks need (a DataLoader worker that sends small
/// batches, one per epoch, reserves 1 MiB, not its `segment_size`), and
/// what is reserved but not carved yet is at most one step.
pub const RESERVE_STEP: usize = 1 << 20;

impl ArenaOptions {
    /// The options with an automatic `large_threshold` made concrete.
    fn resolved(mut self) -> ArenaOptions {
        if self.large_threshold == 0 {
            self.large_threshold = AUTO_LARGE_THRESHOLD.min(self.segment_size / 4);
        }
        self
    }

    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::new(ErrorKind::InvalidArgument, format!("arena options: {why}")));
        if self.segment_size < page_size() || self.segment_size > (1 << 40) {
            return bad(format!("segment_size {} must be between one page and 1 TiB", self.segment_size));
        }
        if self.max_holds == 0 || self.max_holds > (1 << 24) {
            return bad(format!("max_holds {} must be between 1 and 16777216", self.max_holds));
        }
        if self.large_threshold < 64 || self.large_threshold > self.segment_size / 4 {
            return bad(format!(
                "large_threshold {} must be between 64 and a quarter of segment_size ({})",
                self.large_threshold, self.segment_size
            ));
        }
        Ok(())
    }
}

/// Counts of an arena's state (for tests, benchmarks and monitoring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaStats {
    pub segments: usize,
    pub live_blocks: usize,
    /// Blocks freed by the producer but still held by a consumer.
    pub deferred_blocks: usize,
    /// Bytes of segment data mapped.
    pub segment_bytes: usize,
    /// Bytes of segment data reserved (backed by memory): what has been
    /// carved, rounded up to the reservation step, plus large blocks.
    pub reserved_bytes: usize,
}

/// What [`Arena::collect`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollectReport {
    /// Holds of dead consumers released.
    pub reclaimed_holds: usize,
    /// Deferred blocks that became free.
    pub recycled_blocks: usize,
}

#[derive(Debug)]
struct SegState {
    seg: Arc<Segment>,
    /// Next unused byte of a small-block segment.
    bump: usize,
    /// Data bytes `[0, reserved)` have their pages reserved.
    reserved: usize,
    /// Slots never claimed yet start at `next_slot`.
    next_slot: usize,
    free_slots: Vec<u32>,
    large: bool,
}

#[derive(Debug)]
struct Block {
    seg_id: u64,
    offset: usize,
    size: usize,
    class: Option<usize>,
    /// Holds this block's shares took: (slot, generation).
    holds: Vec<(u32, u32)>,
}

#[derive(Debug)]
struct State {
    opts: ArenaOptions,
    segments: HashMap<u64, SegState>,
    /// The small-block segment new blocks are carved from.
    current: Option<u64>,
    /// Live blocks by address.
    live: HashMap<usize, Block>,
    /// Freed blocks a consumer may still hold.
    deferred: Vec<Block>,
    free_lists: Vec<Vec<(u64, usize)>>,
}

#[derive(Debug)]
struct Shared {
    /// The process that made the arena: the only one whose allocator it is.
    creator_pid: u32,
    opts: ArenaOptions,
    state: Mutex<State>,
}

/// A shareable CPU arena. Clones share it; every method locks it, so it
/// may be used from any thread.
///
/// It belongs to the process that made it. A child forked from that
/// process inherits the mappings but not the allocator: there every
/// method fails (`InvalidArgument`) without touching the state, which
/// is the parent's (and may have been copied in the middle of another
/// thread's update), and dropping the last clone there releases nothing.
/// Reading blocks the parent allocated before the fork still works.
#[derive(Debug)]
pub struct Arena(ManuallyDrop<Arc<Shared>>);

impl Clone for Arena {
    fn clone(&self) -> Self {
        Arena(ManuallyDrop::new(Arc::clone(&self.0)))
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // In a forked child the state and segments are the parent's:
        // leave them be (the child's copy goes when the child exits).
        if self.0.creator_pid == std::process::id() {
            // SAFETY: dropped once, here; never used after.
            unsafe { ManuallyDrop::drop(&mut self.0) };
        }
    }
}

impl Arena {
    pub fn new(opts: ArenaOptions) -> Result<Arena> {
        let opts = opts.resolved();
        opts.check()?;
        let classes = class_count(opts.large_threshold);
        let state = State {
            opts: opts.clone(),
            segments: HashMap::new(),
            current: None,
            live: HashMap::new(),
            deferred: Vec::new(),
            free_lists: vec![Vec::new(); classes],
        };
        Ok(Arena(ManuallyDrop::new(Arc::new(Shared { creator_pid: std::process::id(), opts, state: Mutex::new(state) }))))
    }

    /// The state, for the process that made the arena; in a forked child
    /// an error that says so (before the lock, which a thread of the
    /// parent may have held at the fork).
    fn lock(&self, op: &str) -> Result<MutexGuard<'_, State>> {
        self.check_owner(op)?;
        // Every critical section leaves State consistent before anything
        // that could panic, so a poisoned lock still holds valid data.
        Ok(self.0.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn check_owner(&self, op: &str) -> Result<()> {
        let me = std::process::id();
        if me == self.0.creator_pid {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "arena {op}: arena was created by pid {}; this is a forked child (pid {me}), which cannot allocate, free or share in its parent's arena: open an arena of its own",
                self.0.creator_pid
            ),
        ))
    }

    /// The options, with an automatic large threshold made concrete.
    pub fn options(&self) -> ArenaOptions {
        self.0.opts.clone()
    }

    /// A block of `size` bytes aligned to `align` (a power of two up to a
    /// page). Its bytes are left as they were (zeros in a new segment).
    pub fn alloc(&self, size: usize, align: usize) -> Result<*mut u8> {
        if size == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "arena_alloc of 0 bytes"));
        }
        if !align.is_power_of_two() || align > MAX_ALIGN {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("alignment {align} must be a power of two of at most {MAX_ALIGN}")));
        }
        let mut st = self.lock("alloc")?;
        match class_for(size, align, st.opts.large_threshold) {
            Some(c) => st.alloc_small(c),
            None => st.alloc_large(size),
        }
    }

    /// Frees a block. If a consumer still holds it (or a share of it has
    /// not been opened yet), it is reused only once that hold is gone.
    pub fn free(&self, p: *mut u8) -> Result<()> {
        let mut st = self.lock("free")?;
        let block = match st.live.remove(&(p as usize)) {
            Some(b) => b,
            None => return Err(st.unknown_pointer(p, "free")),
        };
        let block_was_large = block.class.is_none();
        if st.still_held(&block) {
            st.deferred.push(block);
        } else {
            st.recycle(block);
        }
        if block_was_large && !st.deferred.is_empty() {
            // Large segments waiting for their consumers cost a descriptor
            // each: look again whenever one is freed.
            st.reap_deferred();
        }
        Ok(())
    }

    /// Shares a live block: takes one hold in its segment's counter area
    /// and returns the handle a consumer opens (once). O(1), no copy.
    pub fn share(&self, p: *mut u8) -> Result<ArenaHandle> {
        let mut st = self.lock("share")?;
        let st = &mut *st;
        let Some(&Block { seg_id, offset, size, .. }) = st.live.get(&(p as usize)) else {
            return Err(st.unknown_pointer(p, "share"));
        };
        let seg = st.segments.get_mut(&seg_id).expect("a live block's segment exists");
        let me = counters::me();
        let (slot, generation) = loop {
            let slot = take_slot(seg, &mut st.live, &mut st.deferred)?;
            if let Some(g) = seg.seg.slot(slot as usize).claim(offset as u64, size as u64, me) {
                break (slot, g);
            }
        };
        st.live.get_mut(&(p as usize)).expect("still live").holds.push((slot, generation));
        Ok(handle_of(&seg.seg, offset, size, slot, generation))
    }

    /// Another share of a block a consumer holds: the consumer proves its
    /// hold with the handle it opened (`held`), and gets a new handle for
    /// the same block, which a third process opens (a tensor received and
    /// sent on stays over the producer's bytes). Works for a block the
    /// producer freed already while it is held: the new hold keeps it from
    /// reuse like the first.
    pub fn reshare(&self, held: &ArenaHandle) -> Result<ArenaHandle> {
        held.validate()?;
        let mut st = self.lock("reshare")?;
        let st = &mut *st;
        let bad = |why: String| Err(Error::new(ErrorKind::InvalidArgument, format!("arena reshare: {why}")));
        let id = held.key.segment_id;
        let Some(seg) = st.segments.get(&id).filter(|s| s.seg.key() == held.key) else {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("arena reshare: this arena has no segment {id} (freed, or another arena's)"),
            ));
        };
        if held.segment_data_size != seg.seg.data_size() as u64 || held.slot as usize >= seg.seg.nslots() {
            return bad(format!("the handle does not fit segment {id} (size {}, {} hold slots)", seg.seg.data_size(), seg.seg.nslots()));
        }
        let slot = seg.seg.slot(held.slot as usize);
        if slot.load() != (held.generation, HELD) || slot.block() != (held.offset, held.size) {
            return bad(format!(
                "hold slot {} (generation {}) of segment {id} is not a held share of block (offset {}, size {}): only a consumer that holds the block can share it on",
                held.slot, held.generation, held.offset, held.size
            ));
        }
        let base = seg.seg.base() as usize;
        let (offset, size) = (held.offset as usize, held.size as usize);
        let is_it = |b: &Block| b.seg_id == id && b.offset == offset && b.size == size;
        if !st.live.get(&(base + offset)).is_some_and(is_it) && !st.deferred.iter().any(is_it) {
            return bad(format!("no block of this arena is at offset {offset} of segment {id} with size {size}"));
        }
        let seg = st.segments.get_mut(&id).expect("looked up above");
        let me = counters::me();
        let (slot, generation) = loop {
            let slot = take_slot(seg, &mut st.live, &mut st.deferred)?;
            if let Some(g) = seg.seg.slot(slot as usize).claim(offset as u64, size as u64, me) {
                break (slot, g);
            }
        };
        let block = match st.live.get_mut(&(base + offset)).filter(|b| is_it(b)) {
            Some(b) => b,
            None => st.deferred.iter_mut().find(|b| is_it(b)).expect("found above, under the same lock"),
        };
        block.holds.push((slot, generation));
        Ok(handle_of(&seg.seg, offset, size, slot, generation))
    }

    /// Cancels a share that will never be opened (the handle was not
    /// sent, or its receiver is gone before opening it).
    pub fn unshare(&self, h: &ArenaHandle) -> Result<()> {
        let st = self.lock("unshare")?;
        let seg = st.segments.get(&h.key.segment_id).filter(|s| s.seg.key() == h.key).ok_or_else(|| {
            Error::new(ErrorKind::NotFound, format!("arena handle names segment {} which this arena does not have", h.key.segment_id))
        })?;
        if h.segment_data_size != seg.seg.data_size() as u64 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "bad arena handle: segment size {} is not segment {}'s {}",
                    h.segment_data_size,
                    h.key.segment_id,
                    seg.seg.data_size()
                ),
            ));
        }
        if h.slot as usize >= seg.seg.nslots() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("bad arena handle: hold slot {} of a segment with {}", h.slot, seg.seg.nslots()),
            ));
        }
        // Only the producer claims slots, under this lock: the record is
        // the one of the slot's current share.
        let slot = seg.seg.slot(h.slot as usize);
        let (offset, size) = slot.block();
        if (offset, size) != (h.offset, h.size) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "bad arena handle: block (offset {}, size {}) is not the one its hold slot {} records (offset {offset}, size {size}): the handle was altered or belongs to another share",
                    h.offset, h.size, h.slot
                ),
            ));
        }
        if !slot.release(h.generation, IN_FLIGHT) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("arena handle (slot {}, generation {}) is not an unopened share: opened, cancelled or stale", h.slot, h.generation),
            ));
        }
        Ok(())
    }

    /// The descriptor of segment `segment_id` (by-fd arenas), owned by
    /// the arena: send it (once per peer), do not close it.
    pub fn segment_fd(&self, segment_id: u64) -> Result<RawFd> {
        let st = self.lock("segment_fd")?;
        let seg = st.segments.get(&segment_id).ok_or_else(|| {
            Error::new(ErrorKind::NotFound, format!("this arena has no segment {segment_id} (freed, or another arena's)"))
        })?;
        seg.seg.fd().ok_or_else(|| {
            Error::new(ErrorKind::Unsupported, format!("segment {segment_id} is shared by name: it has no descriptor to send"))
        })
    }

    /// Releases the holds of consumers that died (pid gone, or reused by
    /// a process with another start time) and reuses the freed blocks
    /// nobody holds any more.
    pub fn collect(&self) -> Result<CollectReport> {
        let mut st = self.lock("collect")?;
        let st = &mut *st;
        let mut report = CollectReport::default();
        for block in st.live.values().chain(st.deferred.iter()) {
            let seg = &st.segments[&block.seg_id].seg;
            for &(slot, generation) in &block.holds {
                let s = seg.slot(slot as usize);
                if s.load() == (generation, HELD) {
                    let (pid, start) = s.holder();
                    if !counters::alive(pid, start) && s.release(generation, HELD) {
                        report.reclaimed_holds += 1;
                    }
                }
            }
        }
        let before = st.deferred.len();
        st.reap_deferred();
        report.recycled_blocks = before - st.deferred.len();
        Ok(report)
    }

    pub fn stats(&self) -> Result<ArenaStats> {
        let st = self.lock("stats")?;
        Ok(ArenaStats {
            segments: st.segments.len(),
            live_blocks: st.live.len(),
            deferred_blocks: st.deferred.len(),
            segment_bytes: st.segments.values().map(|s| s.seg.data_size()).sum(),
            reserved_bytes: st.segments.values().map(|s| s.reserved).sum(),
        })
    }

    /// The size the block at `p` was carved with (at least what was asked).
    pub fn block_size(&self, p: *mut u8) -> Result<usize> {
        let st = self.lock("block_size")?;
        st.live.get(&(p as usize)).map(|b| b.size).ok_or_else(|| st.unknown_pointer(p, "block_size"))
    }

    /// For a block that fills a segment of its own from offset 0: that
    /// segment's descriptor (what PyTorch maps by fd). None otherwise,
    /// and in a forked child.
    pub fn whole_segment_fd(&self, p: *mut u8) -> Option<RawFd> {
        let st = self.lock("whole_segment_fd").ok()?;
        let b = st.live.get(&(p as usize))?;
        let seg = &st.segments[&b.seg_id];
        (seg.large && b.offset == 0).then(|| seg.seg.fd()).flatten()
    }
}

/// The handle of the share (`slot`, `generation`) of the block at
/// `offset` (`size` bytes) of segment `s`.
fn handle_of(s: &Segment, offset: usize, size: usize, slot: u32, generation: u32) -> ArenaHandle {
    ArenaHandle {
        strategy: s.strategy(),
        key: s.key(),
        segment_data_size: s.data_size() as u64,
        offset: offset as u64,
        size: size as u64,
        slot,
        generation,
        name: s.name().unwrap_or("").to_string(),
    }
}

/// A slot of `seg` known free: a recycled one, a never-used one, or one
/// whose hold was released since (found by sweeping this segment's holds).
fn take_slot(seg: &mut SegState, live: &mut HashMap<usize, Block>, deferred: &mut [Block]) -> Result<u32> {
    if let Some(s) = seg.free_slots.pop() {
        return Ok(s);
    }
    if seg.next_slot < seg.seg.nslots() {
        seg.next_slot += 1;
        return Ok(seg.next_slot as u32 - 1);
    }
    let id = seg.seg.key().segment_id;
    for b in live.values_mut().chain(deferred.iter_mut()).filter(|b| b.seg_id == id) {
        b.holds.retain(|&(slot, generation)| {
            let (g, state) = seg.seg.slot(slot as usize).load();
            let gone = g != generation || state == FREE;
            if gone {
                seg.free_slots.push(slot);
            }
            !gone
        });
    }
    seg.free_slots.pop().ok_or_else(|| {
        Error::new(
            ErrorKind::Busy,
            format!(
                "all {} hold slots of arena segment {id} are taken by shares in flight or held: raise max_holds or release views",
                seg.seg.nslots()
            ),
        )
    })
}

impl State {
    fn alloc_small(&mut self, c: usize) -> Result<*mut u8> {
        if self.free_lists[c].is_empty() && !self.deferred.is_empty() {
            self.reap_deferred();
        }
        let size = class_size(c);
        let (seg_id, offset) = match self.free_lists[c].pop() {
            Some(v) => v,
            None => self.carve(size, class_align(c))?,
        };
        Ok(self.make_live(Block { seg_id, offset, size, class: Some(c), holds: Vec::new() }))
    }

    fn carve(&mut self, size: usize, align: usize) -> Result<(u64, usize)> {
        if let Some(id) = self.current {
            let s = self.segments.get_mut(&id).expect("current segment exists");
            let at = round_up(s.bump, align).expect("bump is within the segment");
            if at + size <= s.seg.data_size() {
                s.reserve_up_to(at + size)?;
                s.bump = at + size;
                return Ok((id, at));
            }
        }
        let first = reservation_for(size, self.opts.segment_size);
        let seg = Segment::create(self.opts.strategy, self.opts.segment_size, self.opts.max_holds, first)?;
        let id = seg.key().segment_id;
        let mut s = SegState::new(seg, false);
        s.reserved = first.min(s.seg.data_size());
        s.bump = size;
        self.segments.insert(id, s);
        self.current = Some(id);
        Ok((id, 0))
    }

    fn alloc_large(&mut self, size: usize) -> Result<*mut u8> {
        // Freed large blocks whose consumers are done give their segments
        // (memory, descriptor, mapping) back now, not at the next collect.
        self.reap_deferred();
        let seg = Segment::create(self.opts.strategy, size, LARGE_SEGMENT_SLOTS, size)?;
        let id = seg.key().segment_id;
        let mut s = SegState::new(seg, true);
        s.reserved = s.seg.data_size();
        self.segments.insert(id, s);
        Ok(self.make_live(Block { seg_id: id, offset: 0, size, class: None, holds: Vec::new() }))
    }

    fn make_live(&mut self, block: Block) -> *mut u8 {
        let base = self.segments[&block.seg_id].seg.base();
        // SAFETY: offset + size lies inside the segment's data.
        let p = unsafe { base.add(block.offset) };
        self.live.insert(p as usize, block);
        p
    }

    /// Whether any share of the block is in flight or held.
    fn still_held(&self, b: &Block) -> bool {
        let seg = &self.segments[&b.seg_id].seg;
        b.holds.iter().any(|&(slot, generation)| {
            let (g, state) = seg.slot(slot as usize).load();
            g == generation && state != FREE
        })
    }

    /// Puts a block nobody holds back to use: its slots to the segment's
    /// free slots, its bytes to its class, or its whole segment away.
    fn recycle(&mut self, b: Block) {
        let s = self.segments.get_mut(&b.seg_id).expect("a block's segment exists");
        s.free_slots.extend(b.holds.iter().map(|h| h.0));
        match b.class {
            Some(c) => self.free_lists[c].push((b.seg_id, b.offset)),
            None => {
                let s = self.segments.remove(&b.seg_id).expect("checked above");
                s.seg.retire();
            }
        }
    }

    fn reap_deferred(&mut self) {
        let mut i = 0;
        while i < self.deferred.len() {
            if self.still_held(&self.deferred[i]) {
                i += 1;
            } else {
                let b = self.deferred.swap_remove(i);
                self.recycle(b);
            }
        }
    }

    fn unknown_pointer(&self, p: *mut u8, op: &str) -> Error {
        let addr = p as usize;
        if p.is_null() {
            return Error::new(ErrorKind::NullPointer, format!("arena {op}: pointer is NULL"));
        }
        if self.deferred.iter().any(|b| self.segments[&b.seg_id].seg.base() as usize + b.offset == addr) {
            return Error::new(ErrorKind::InvalidArgument, format!("arena {op}: block {p:p} was already freed (double free)"));
        }
        if let Some(s) = self.segments.values().find(|s| s.seg.contains(addr)) {
            let in_free_list = !s.large
                && self.free_lists.iter().flatten().any(|&(id, off)| id == s.seg.key().segment_id && s.seg.base() as usize + off == addr);
            return Error::new(
                ErrorKind::InvalidArgument,
                if in_free_list {
                    format!("arena {op}: block {p:p} was already freed (double free)")
                } else {
                    format!("arena {op}: {p:p} points into arena segment {} but is not the start of a live block", s.seg.key().segment_id)
                },
            );
        }
        Error::new(ErrorKind::InvalidArgument, format!("arena {op}: {p:p} was not allocated by this arena (foreign pointer)"))
    }
}

/// How far a small-block segment of `segment_size` bytes reserves so that
/// data up to byte `end` is covered: whole reservation steps, at most the
/// segment.
fn reservation_for(end: usize, segment_size: usize) -> usize {
    round_up(end, RESERVE_STEP).unwrap_or(usize::MAX).min(segment_size)
}

impl SegState {
    fn new(seg: Segment, large: bool) -> SegState {
        SegState { seg: Arc::new(seg), bump: 0, reserved: 0, next_slot: 0, free_slots: Vec::new(), large }
    }

    /// Reserves the pages up to data byte `end` (and up to the next
    /// reservation step) before a block there is handed out.
    fn reserve_up_to(&mut self, end: usize) -> Result<()> {
        if end <= self.reserved {
            return Ok(());
        }
        let to = reservation_for(end, self.seg.data_size());
        self.seg.reserve_data(self.reserved, to)?;
        self.reserved = to;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::remote::open_remote;
    use std::os::fd::FromRawFd;

    fn small_opts(strategy: Strategy) -> ArenaOptions {
        ArenaOptions { segment_size: 1 << 20, strategy, max_holds: 8, large_threshold: 64 << 10 }
    }

    #[test]
    fn blocks_are_reused_only_when_nobody_holds_them() {
        for strategy in [Strategy::Fd, Strategy::Name] {
            let a = Arena::new(small_opts(strategy)).unwrap();
            let p = a.alloc(1000, 64).unwrap();
            assert_eq!(p as usize % 64, 0);
            // SAFETY: 1000 bytes of a live block.
            unsafe { std::ptr::write_bytes(p, 7, 1000) };
            let h = a.share(p).unwrap();
            if strategy == Strategy::Fd {
                let fd = a.segment_fd(h.key.segment_id).unwrap();
                // SAFETY: dup of the arena's descriptor, handed over.
                let dup = unsafe { std::os::fd::OwnedFd::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)) };
                crate::arena::import_segment_fd(&h, dup).unwrap();
            }
            let v = open_remote(&h).unwrap();
            assert_eq!(open_remote(&h).unwrap_err().kind(), ErrorKind::InvalidArgument, "a handle opens once");
            // SAFETY: the view's bytes.
            assert!(unsafe { std::slice::from_raw_parts(v.data(), 1000) }.iter().all(|b| *b == 7));
            a.free(p).unwrap();
            assert_eq!(a.free(p).unwrap_err().kind(), ErrorKind::InvalidArgument, "double free");
            assert_eq!(a.stats().unwrap().deferred_blocks, 1);
            let q = a.alloc(1000, 64).unwrap();
            assert_ne!(p, q, "a held block is not reused");
            drop(v);
            assert_eq!(a.collect().unwrap().recycled_blocks, 1);
            let r = a.alloc(1000, 64).unwrap();
            assert_eq!(r, p, "released block reused");
            let mut x = 5u8;
            assert!(a.free(&mut x).unwrap_err().message().contains("foreign"));
            // SAFETY: inside the block, not its start.
            assert!(a.free(unsafe { q.add(8) }).unwrap_err().message().contains("not the start"));
        }
    }

    /// Bytes of memory behind a file (its allocated blocks).
    fn allocated(fd: RawFd) -> usize {
        // SAFETY: plain data filled by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is valid.
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
        st.st_blocks as usize * 512
    }

    fn dup(fd: RawFd) -> std::os::fd::OwnedFd {
        // SAFETY: a duplicate of an open descriptor, owned from here.
        unsafe { std::os::fd::OwnedFd::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)) }
    }

    #[test]
    fn pages_are_reserved_as_blocks_are_carved_and_given_back_when_the_producer_is_done() {
        use std::os::fd::AsRawFd;
        let a =
            Arena::new(ArenaOptions { segment_size: 64 << 20, strategy: Strategy::Fd, max_holds: 8, large_threshold: 1 << 20 }).unwrap();
        let kept = a.alloc(64, 8).unwrap();
        assert_eq!(a.stats().unwrap().reserved_bytes, RESERVE_STEP, "a first small block reserves one step, not the segment");
        let h = a.share(kept).unwrap();
        let fd = dup(a.segment_fd(h.key.segment_id).unwrap());
        // Before: the whole 64 MiB segment was reserved at creation.
        assert!(allocated(fd.as_raw_fd()) < 2 << 20, "{} bytes behind a segment holding 64 bytes", allocated(fd.as_raw_fd()));
        for _ in 0..20 {
            let p = a.alloc(512 << 10, 64).unwrap();
            // SAFETY: a live block of 512 KiB.
            unsafe { std::ptr::write_bytes(p, 1, 512 << 10) };
        }
        let reserved = a.stats().unwrap().reserved_bytes;
        assert!((10 << 20..=12 << 20).contains(&reserved), "reserved {reserved} for ~10 MiB carved");
        assert!(allocated(fd.as_raw_fd()) <= reserved + (64 << 10));
        let big = a.alloc(256 << 10, 64).unwrap();
        let hb = a.share(big).unwrap();
        crate::arena::import_segment_fd(&h, dup(fd.as_raw_fd())).unwrap();
        let v = open_remote(&h).unwrap();
        let vb = open_remote(&hb).unwrap();
        // SAFETY: the 64 bytes of the view.
        unsafe { std::ptr::write_bytes(v.data(), 9, 64) };
        // The producer gives the segment up (as a worker that exits): the
        // consumer keeps two blocks, and the pages under them only.
        drop(a);
        crate::arena::trim_cache();
        let left = allocated(fd.as_raw_fd());
        // One data page, the header, one page of hold slots (of 41), and
        // the 256 KiB block's pages.
        assert!(left <= 4 * page_size() + (256 << 10), "{left} bytes kept for 64 bytes and 256 KiB of a given-up segment");
        drop(vb);
        let left = allocated(fd.as_raw_fd());
        assert!(left <= 3 * page_size(), "{left} bytes kept for one 64-byte block of a given-up segment");
        // SAFETY: the view's bytes, still mapped.
        assert!(unsafe { std::slice::from_raw_parts(v.data(), 64) }.iter().all(|b| *b == 9), "the held block keeps its bytes");
        drop(v);
    }

    #[test]
    fn large_blocks_own_their_segment_and_unshare_cancels() {
        let a = Arena::new(small_opts(Strategy::Name)).unwrap();
        let p = a.alloc(200 << 10, 4096).unwrap();
        assert_eq!(a.stats().unwrap().segments, 1);
        let h = a.share(p).unwrap();
        let path = format!("/dev/shm{}", h.name);
        assert!(std::path::Path::new(&path).exists());
        a.unshare(&h).unwrap();
        assert!(a.unshare(&h).is_err());
        assert_eq!(open_remote(&h).unwrap_err().kind(), ErrorKind::InvalidArgument);
        a.free(p).unwrap();
        assert_eq!(a.stats().unwrap().segments, 0);
        assert!(!std::path::Path::new(&path).exists(), "name removed with its segment");
    }

    #[test]
    fn a_held_block_is_shared_on_and_lives_while_any_holder_does() {
        let a = Arena::new(small_opts(Strategy::Name)).unwrap();
        let p = a.alloc(1000, 64).unwrap();
        let first = a.share(p).unwrap();
        assert_eq!(a.reshare(&first).unwrap_err().kind(), ErrorKind::InvalidArgument, "an unopened share proves no hold");
        let v1 = open_remote(&first).unwrap();
        let second = a.reshare(&first).unwrap();
        assert_eq!((second.key, second.offset, second.size), (first.key, first.offset, first.size), "the same block");
        assert_ne!(second.slot, first.slot);
        let mut forged = first.clone();
        forged.generation = forged.generation.wrapping_add(1);
        assert_eq!(a.reshare(&forged).unwrap_err().kind(), ErrorKind::InvalidArgument, "a stale generation");
        // The producer frees its block, the first consumer lets go: the
        // in-flight share alone keeps it, then the second view does.
        a.free(p).unwrap();
        drop(v1);
        assert_eq!(a.collect().unwrap().recycled_blocks, 0, "held by the share in flight");
        let v2 = open_remote(&second).unwrap();
        let third = a.reshare(&second).unwrap();
        assert_eq!(third.offset, first.offset, "a freed block still held is shared on too");
        a.unshare(&third).unwrap();
        assert_eq!(a.collect().unwrap().recycled_blocks, 0, "held by the second view");
        assert_eq!(a.reshare(&first).unwrap_err().kind(), ErrorKind::InvalidArgument, "a released hold proves nothing");
        drop(v2);
        assert_eq!(a.collect().unwrap().recycled_blocks, 1);
        assert_eq!(a.reshare(&second).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn hold_slots_run_out_then_come_back() {
        let a = Arena::new(small_opts(Strategy::Name)).unwrap();
        let p = a.alloc(64, 8).unwrap();
        let hs: Vec<_> = (0..8).map(|_| a.share(p).unwrap()).collect();
        assert_eq!(a.share(p).unwrap_err().kind(), ErrorKind::Busy);
        let v = open_remote(&hs[3]).unwrap();
        drop(v);
        a.share(p).unwrap();
        assert!(a.options().max_holds == 8);
        let bad = ArenaOptions { large_threshold: 1 << 30, ..small_opts(Strategy::Fd) };
        assert_eq!(Arena::new(bad).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.alloc(0, 8).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.alloc(8, 3).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.alloc(8, 8192).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
