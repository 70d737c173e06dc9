//! What a producer's pool shares between the threads that serve it: its
//! options and backend, the control block, the layout of its memory, and
//! the consumers connected now (kept by the server thread, read by
//! updates). Also the process's registry of live pools, where a pointer
//! finds the pool that owns it.

use super::backend::{PoolBackend, PoolSegment};
use super::control::{ControlWriter, HoldSlot};
use super::lock;
use super::manifest::{StorageEntry, TensorEntry, MAX_SEGMENTS};
use super::options::PoolOptions;
use super::placement::{block_bytes, Placement};
use crate::error::{Error, ErrorKind, Result};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};

/// What the lock of a pool guards: the segments, where blocks are, and
/// the manifest being built (frozen at export).
pub(crate) struct Layout {
    pub placement: Placement,
    pub segments: Vec<Box<dyn PoolSegment>>,
    pub storages: Vec<StorageEntry>,
    pub storage_by_ptr: HashMap<u64, u32>,
    pub tensors: Vec<TensorEntry>,
    pub names: HashMap<String, usize>,
    /// The encoded manifest, once exported.
    pub frozen: Option<Arc<Vec<u8>>>,
}

/// A consumer connected now: its pid and its hold slot.
pub(crate) struct Consumer {
    pub pid: i32,
    pub slot: Arc<HoldSlot>,
}

pub(crate) struct PoolInner {
    pub opts: PoolOptions,
    pub backend: Arc<dyn PoolBackend>,
    pub control: ControlWriter,
    pub control_fd: OwnedFd,
    pub layout: Mutex<Layout>,
    /// Slot index -> the consumer connected there (None: free); kept by
    /// the server. Only these slots count as holds.
    pub consumers: Mutex<Vec<Option<Consumer>>>,
    pub closing: AtomicBool,
    /// Set when a Legacy pool is dropped with consumers connected: the
    /// server serves them until they go, and then the memory is freed.
    pub linger: AtomicBool,
}

impl PoolInner {
    /// The segment holding [ptr, ptr + len): (index, offset).
    pub fn find(layout: &Layout, ptr: u64, len: usize) -> Option<(usize, usize)> {
        layout.segments.iter().enumerate().find_map(|(i, s)| {
            let end = ptr.checked_add(len as u64)?;
            (ptr >= s.addr() && end <= s.addr() + s.size() as u64).then(|| (i, (ptr - s.addr()) as usize))
        })
    }

    pub fn contains(&self, ptr: u64) -> bool {
        Self::find(&lock(&self.layout), ptr, 1).is_some()
    }

    pub fn alloc(&self, nbytes: usize) -> Result<u64> {
        let bytes =
            block_bytes(nbytes).ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("a block of {nbytes} bytes is too large")))?;
        let mut layout = lock(&self.layout);
        if let Some((seg, off)) = layout.placement.place(bytes) {
            return Ok(layout.segments[seg].addr() + off as u64);
        }
        if layout.frozen.is_some() {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "no room for {nbytes} bytes in the pool's segments, and an exported pool cannot grow (its consumers know its segments)"
                ),
            ));
        }
        if layout.segments.len() >= MAX_SEGMENTS {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("the pool has {MAX_SEGMENTS} segments, the most it may have; use a larger segment_size"),
            ));
        }
        let g = self.backend.granularity();
        let too_large = || Error::new(ErrorKind::InvalidArgument, format!("a block of {nbytes} bytes is too large"));
        let size = self.opts.segment_size.max(bytes).checked_next_multiple_of(g).ok_or_else(too_large)?;
        let segment = self.backend.create_segment(size)?;
        let index = layout.placement.add_segment(segment.size());
        layout.segments.push(segment);
        let (seg, off) = layout.placement.place(bytes).expect("a new segment holds the block it was made for");
        debug_assert_eq!(seg, index);
        Ok(layout.segments[seg].addr() + off as u64)
    }

    pub fn free_block(&self, ptr: u64) -> Result<()> {
        let mut layout = lock(&self.layout);
        let (seg, off) =
            Self::find(&layout, ptr, 1).ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("0x{ptr:x} is not in this pool")))?;
        if !layout.placement.release(seg, off) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("0x{ptr:x} is not the start of a block of this pool (freed twice?)"),
            ));
        }
        Ok(())
    }
}

impl PoolInner {
    /// The pids of the live consumers that hold a version now, with their slots.
    pub fn holders(&self) -> Vec<(i32, Arc<HoldSlot>)> {
        lock(&self.consumers).iter().flatten().filter(|c| c.slot.held() != 0).map(|c| (c.pid, c.slot.clone())).collect()
    }

    /// Consumer processes connected now.
    pub fn connected(&self) -> usize {
        lock(&self.consumers).iter().filter(|c| c.is_some()).count()
    }
}

static LIVE: Mutex<Vec<Weak<PoolInner>>> = Mutex::new(Vec::new());

/// Remembers a new pool of this process.
pub(crate) fn register(inner: &Arc<PoolInner>) {
    let mut live = lock(&LIVE);
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(inner));
}

/// Forgets a pool that is being dropped.
pub(crate) fn forget(inner: &Arc<PoolInner>) {
    let mut live = lock(&LIVE);
    live.retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(inner)));
}

/// The live pool of this process that holds `ptr`, if any.
pub(crate) fn owner_of(ptr: u64) -> Option<Arc<PoolInner>> {
    let live: Vec<Arc<PoolInner>> = lock(&LIVE).iter().filter_map(Weak::upgrade).collect();
    live.into_iter().find(|p| p.contains(ptr))
}
