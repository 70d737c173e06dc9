//! The consumer's side: each remote segment mapped once per process
//! (cached by producer pid + start time + segment id, so a reused pid
//! cannot alias), views into it that carry one hold each.

use super::counters::{self, Refusal, HELD};
use super::handle::{ArenaHandle, Strategy};
use super::segment::{Segment, SegmentKey};
use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, MutexGuard};

struct Entry {
    seg: Arc<Segment>,
    views: usize,
    /// A view covered the segment's whole data: it holds one large block,
    /// which its producer never reuses, so the mapping goes with the last
    /// view (a later share of the same block maps it again).
    whole: bool,
    /// Set once the producer carves no more blocks in the segment (it
    /// retired it, or died) and its pages that no hold covered were given
    /// back: the blocks held then, by any process. No hold can be added
    /// after, so the list covers every block still in use; each view that
    /// goes takes its block off and gives back the pages no other listed
    /// block touches (without reading the slots again, whose pages were
    /// given back too).
    held_when_released: Option<Vec<(usize, usize)>>,
}

impl Entry {
    fn new(seg: Segment) -> Entry {
        Entry { seg: Arc::new(seg), views: 0, whole: false, held_when_released: None }
    }

    fn released(&self) -> bool {
        self.held_when_released.is_some()
    }

    /// For a segment its producer is done with: the first time, gives back
    /// every page of data and hold slots that no hold covers; after that,
    /// the pages of `gone` (a view's block that went) no other held block
    /// touches.
    fn release_unheld(&mut self, gone: Option<(usize, usize)>) {
        if self.whole {
            return;
        }
        match &mut self.held_when_released {
            None => {
                let held = self.seg.held_blocks();
                self.seg.release_pages_outside(0, self.seg.data_size(), &held);
                self.seg.release_unused_slot_pages();
                self.held_when_released = Some(held);
            }
            Some(held) => {
                let Some((offset, size)) = gone else { return };
                if let Some(i) = held.iter().position(|&b| b == (offset, size)) {
                    held.remove(i);
                }
                self.seg.release_pages_outside(offset, offset + size, held);
            }
        }
    }
}

static CACHE: ForkSafeMutex<Option<HashMap<SegmentKey, Entry>>> = ForkSafeMutex::new(None);

fn cache() -> MutexGuard<'static, Option<HashMap<SegmentKey, Entry>>> {
    CACHE.lock_static()
}

/// A consumer's view of a block shared by another process. Holds the
/// block (its producer will not reuse it) until dropped; the segment's
/// mapping stays valid even if the producer dies.
#[derive(Debug)]
pub struct RemoteView {
    seg: Arc<Segment>,
    offset: usize,
    size: usize,
    slot: u32,
    generation: u32,
    /// The process whose hold this is: a forked child that inherits the
    /// view must not give the parent's hold back when it drops its copy.
    holder_pid: u32,
}

// SAFETY: the view only reads plain fields; the bytes are the caller's.
unsafe impl Send for RemoteView {}
// SAFETY: as above.
unsafe impl Sync for RemoteView {}

impl RemoteView {
    pub fn data(&self) -> *mut u8 {
        // SAFETY: offset + size was checked against the segment's data.
        unsafe { self.seg.base().add(self.offset) }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The segment's key (which producer, which segment).
    pub fn segment(&self) -> SegmentKey {
        self.seg.key()
    }
}

impl Drop for RemoteView {
    fn drop(&mut self) {
        // The hold goes back in one compare-and-swap; a collector that
        // took it already (it thought us dead) makes this a no-op.
        if self.holder_pid == std::process::id() {
            self.seg.slot(self.slot as usize).release(self.generation, HELD);
        }
        let key = self.seg.key();
        let mut c = cache();
        let Some(map) = c.as_mut() else { return };
        let Some(e) = map.get_mut(&key) else { return };
        e.views -= 1;
        // kill(pid, 0) only: a /proc read per released view would cost more
        // than the rest of the release. A dead producer whose pid was reused
        // or that is an unreaped zombie is left to `trim_cache`, which runs
        // whenever another segment is mapped.
        let producer_done = e.released() || e.seg.retired() || !counters::maybe_alive(key.producer_pid);
        if e.views == 0 && (e.whole || producer_done) {
            forget(map, key);
        } else if producer_done {
            // Other blocks of a segment nobody carves from any more are
            // still viewed: only their pages need to stay.
            e.release_unheld(Some((self.offset, self.size)));
        }
    }
}

/// Drops a cached segment; by name, a dead producer's name goes with it
/// (nobody else would remove it).
fn forget(map: &mut HashMap<SegmentKey, Entry>, key: SegmentKey) {
    if let Some(e) = map.remove(&key) {
        // The mapping goes with the last view holding the Arc.
        if e.seg.strategy() == Strategy::Name && !counters::alive(key.producer_pid, key.producer_start) {
            e.seg.unlink_when_dropped();
        }
    }
}

/// Maps the segment a by-fd handle names from `fd` (received from the
/// producer; taken over: closed here if the segment is mapped already).
pub fn import_segment_fd(h: &ArenaHandle, fd: OwnedFd) -> Result<()> {
    check_by_fd(h)?;
    let mut c = cache();
    insert_fd(c.get_or_insert_with(HashMap::new), h, fd)
}

/// Maps the by-fd segment of `h` from `fd` unless it is mapped already,
/// then opens the block, under one lock: a view of the same segment that
/// another thread drops in between cannot unmap it before it is opened.
pub fn open_with_fd(h: &ArenaHandle, fd: OwnedFd) -> Result<RemoteView> {
    check_by_fd(h)?;
    let mut c = cache();
    let map = c.get_or_insert_with(HashMap::new);
    insert_fd(map, h, fd)?;
    open_in(map, h)
}

fn check_by_fd(h: &ArenaHandle) -> Result<()> {
    h.validate()?;
    if h.strategy != Strategy::Fd {
        return Err(Error::new(ErrorKind::InvalidArgument, "import_segment_fd: the handle is by name, not by fd"));
    }
    Ok(())
}

fn insert_fd(map: &mut HashMap<SegmentKey, Entry>, h: &ArenaHandle, fd: OwnedFd) -> Result<()> {
    if map.contains_key(&h.key) {
        return Ok(());
    }
    // A new segment: let go of idle ones of producers that are gone first
    // (a DataLoader's workers of the previous epoch, say).
    trim_map(map);
    let seg = Segment::open(h.key, Strategy::Fd, h.segment_data_size as usize, Some(fd), None)?;
    map.insert(h.key, Entry::new(seg));
    Ok(())
}

/// Whether this process has the segment of `h` mapped.
pub fn has_segment(h: &ArenaHandle) -> bool {
    cache().as_ref().is_some_and(|m| m.contains_key(&h.key))
}

/// Opens a shared block: maps its segment if this process has not yet
/// (by name; by fd it must have been imported), checks the handle against
/// the segment, and adopts the handle's hold.
pub fn open_remote(h: &ArenaHandle) -> Result<RemoteView> {
    h.validate()?;
    let mut c = cache();
    open_in(c.get_or_insert_with(HashMap::new), h)
}

fn open_in(map: &mut HashMap<SegmentKey, Entry>, h: &ArenaHandle) -> Result<RemoteView> {
    if !map.contains_key(&h.key) {
        // Mapping a new segment is rare: drop idle segments of dead
        // producers first (a pid reused by another process, or a zombie,
        // passed the cheap check when their last view went).
        trim_map(map);
        let seg = match h.strategy {
            Strategy::Name => Segment::open(h.key, Strategy::Name, h.segment_data_size as usize, None, Some(&h.name))?,
            Strategy::Fd => {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "arena segment {} of pid {} is not mapped in this process: receive its fd (the producer's ss_arena_segment_fd) and import it first",
                        h.key.segment_id, h.key.producer_pid
                    ),
                ))
            }
        };
        map.insert(h.key, Entry::new(seg));
    }
    let e = map.get_mut(&h.key).expect("inserted above");
    if e.seg.data_size() as u64 != h.segment_data_size {
        return Err(Error::new(ErrorKind::SizeMismatch, "arena handle: segment size differs from the mapped segment's"));
    }
    if h.slot as usize >= e.seg.nslots() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("bad arena handle: hold slot {} of a segment with {}", h.slot, e.seg.nslots()),
        ));
    }
    let me = counters::me();
    match e.seg.slot(h.slot as usize).adopt(h.generation, h.offset, h.size, me) {
        Ok(()) => {}
        Err(Refusal::OtherBlock(offset, size)) => {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "bad arena handle: block (offset {}, size {}) is not the one its hold slot {} of segment {} records (offset {offset}, size {size}): the handle was altered or belongs to another share",
                    h.offset, h.size, h.slot, h.key.segment_id
                ),
            ))
        }
        Err(Refusal::NotInFlight) => {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "arena handle (segment {}, offset {}, slot {}, generation {}) was opened already, cancelled, or is stale",
                    h.key.segment_id, h.offset, h.slot, h.generation
                ),
            ))
        }
    }
    e.views += 1;
    e.whole |= covers_whole_segment(h);
    Ok(RemoteView {
        seg: e.seg.clone(),
        offset: h.offset as usize,
        size: h.size as usize,
        slot: h.slot,
        generation: h.generation,
        holder_pid: me.0 as u32,
    })
}

/// Whether `h` is a large block alone in its segment. Small blocks are at
/// most a quarter of their segment, so in a segment of two pages or more
/// only a large block covers all of its page-rounded data. (In a one-page
/// segment both could: it is treated as shared, as before.)
pub fn covers_whole_segment(h: &ArenaHandle) -> bool {
    let page = super::segment::page_size() as u64;
    h.offset == 0 && h.segment_data_size > page && h.size.div_ceil(page) * page == h.segment_data_size
}

/// Unmaps cached segments no view uses whose producer retired them or
/// died, and gives back the pages no hold covers of those still viewed;
/// returns how many segments went. (Views release theirs on drop already.)
pub fn trim_cache() -> usize {
    let mut c = cache();
    c.as_mut().map_or(0, trim_map)
}

fn trim_map(map: &mut HashMap<SegmentKey, Entry>) -> usize {
    let mut idle = Vec::new();
    for (k, e) in map.iter_mut() {
        if !(e.released() || e.seg.retired() || !counters::alive(k.producer_pid, k.producer_start)) {
            continue;
        }
        if e.views == 0 {
            idle.push(*k);
        } else if !e.released() {
            // A dead worker's segment kept for a few small tensors holds
            // their pages only, not the whole segment.
            e.release_unheld(None);
        }
    }
    for k in &idle {
        forget(map, *k);
    }
    idle.len()
}

/// Remote segments mapped in this process now.
pub fn cached_segments() -> usize {
    cache().as_ref().map_or(0, |m| m.len())
}
