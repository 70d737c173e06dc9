//! The counter area of a segment: one hold slot per share in flight or
//! per block a consumer holds, with the holder's pid and start time beside
//! it, so a dead holder is recognised (and a reused pid cannot pass for it).
//!
//! A slot's `tag` is `generation << 32 | state`. Only the producer claims
//! free slots (bumping the generation, so a stale handle can never match);
//! consumers move a slot from in-flight to held and from held to free, each
//! with one compare-and-swap.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

pub const FREE: u32 = 0;
/// Claimed by the producer for a handle not opened yet.
pub const IN_FLIGHT: u32 = 1;
/// A consumer is writing its pid and start time (a few instructions).
pub const ADOPTING: u32 = 2;
/// Held by the consumer named in the slot.
pub const HELD: u32 = 3;

/// One slot, 40 bytes, in the segment's shared counter area. Beside the
/// holder it records the block the share is for (offset and size), which
/// a handle must match to open.
#[repr(C)]
pub struct HoldSlot {
    tag: AtomicU64,
    holder_pid: AtomicI32,
    _pad: AtomicI32,
    holder_start: AtomicU64,
    offset: AtomicU64,
    size: AtomicU64,
}

pub const SLOT_SIZE: usize = std::mem::size_of::<HoldSlot>();
const _: () = assert!(SLOT_SIZE == 40);

/// Why [`HoldSlot::adopt`] refused a handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The slot's share is for another block: `(offset, size)` recorded.
    OtherBlock(u64, u64),
    /// No share of that generation is in flight (opened, cancelled, stale).
    NotInFlight,
}

pub fn tag(generation: u32, state: u32) -> u64 {
    (generation as u64) << 32 | state as u64
}

pub fn split(tag: u64) -> (u32, u32) {
    ((tag >> 32) as u32, tag as u32)
}

impl HoldSlot {
    pub fn load(&self) -> (u32, u32) {
        split(self.tag.load(Ordering::Acquire))
    }

    /// The block (offset, size) of the share the slot was last claimed for.
    pub fn block(&self) -> (u64, u64) {
        (self.offset.load(Ordering::Acquire), self.size.load(Ordering::Acquire))
    }

    pub fn holder(&self) -> (i32, u64) {
        (self.holder_pid.load(Ordering::Acquire), self.holder_start.load(Ordering::Acquire))
    }

    /// Producer: claims this free slot for a share of the block at
    /// `offset` of `size` bytes; returns the new generation, or None if it
    /// is not free.
    pub fn claim(&self, offset: u64, size: u64, me: (i32, u64)) -> Option<u32> {
        let (generation, state) = self.load();
        if state != FREE {
            return None;
        }
        let next = generation.wrapping_add(1);
        // Fill the slot first; the tag published last makes it visible.
        self.offset.store(offset, Ordering::Relaxed);
        self.size.store(size, Ordering::Relaxed);
        self.holder_pid.store(me.0, Ordering::Relaxed);
        self.holder_start.store(me.1, Ordering::Relaxed);
        self.tag.compare_exchange(tag(generation, FREE), tag(next, IN_FLIGHT), Ordering::AcqRel, Ordering::Acquire).ok().map(|_| next)
    }

    /// Consumer: takes over the in-flight hold of generation `generation`
    /// for the block at `offset` of `size` bytes. A handle for another
    /// block (altered, or another share's), stale or opened already takes
    /// nothing.
    pub fn adopt(&self, generation: u32, offset: u64, size: u64, me: (i32, u64)) -> Result<(), Refusal> {
        // A quick look first, so a mismatching handle never moves the slot.
        let recorded = self.block();
        if recorded != (offset, size) {
            return Err(Refusal::OtherBlock(recorded.0, recorded.1));
        }
        if self.tag.compare_exchange(tag(generation, IN_FLIGHT), tag(generation, ADOPTING), Ordering::AcqRel, Ordering::Acquire).is_err() {
            return Err(Refusal::NotInFlight);
        }
        // The record as the claim of this generation published it.
        let recorded = self.block();
        if recorded != (offset, size) {
            self.tag.store(tag(generation, IN_FLIGHT), Ordering::Release);
            return Err(Refusal::OtherBlock(recorded.0, recorded.1));
        }
        self.holder_pid.store(me.0, Ordering::Relaxed);
        self.holder_start.store(me.1, Ordering::Relaxed);
        self.tag.store(tag(generation, HELD), Ordering::Release);
        Ok(())
    }

    /// Moves the slot from `state` of `generation` to free (a consumer
    /// releasing its hold, a producer cancelling an unopened share, a
    /// collector reclaiming a dead holder's). False if it was not there.
    pub fn release(&self, generation: u32, state: u32) -> bool {
        self.tag.compare_exchange(tag(generation, state), tag(generation, FREE), Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

/// `(pid, start time in clock ticks)` of this process, and whether a
/// recorded `(pid, start)` still runs (not a reused pid): see
/// [`crate::proc_identity`].
pub use crate::proc_identity::{alive, me};

/// A cheap first look (one kill(pid, 0), no /proc read): false only when
/// `pid` surely is gone. A reused pid reads as alive here; callers that
/// must tell use [`alive`].
pub fn maybe_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 || crate::error::errno() == libc::EPERM }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot() -> HoldSlot {
        HoldSlot {
            tag: AtomicU64::new(0),
            holder_pid: AtomicI32::new(0),
            _pad: AtomicI32::new(0),
            holder_start: AtomicU64::new(0),
            offset: AtomicU64::new(0),
            size: AtomicU64::new(0),
        }
    }

    #[test]
    fn claim_adopt_release_and_stale_generations() {
        let s = slot();
        let g = s.claim(4096, 4096, me()).unwrap();
        assert_eq!(s.load(), (g, IN_FLIGHT));
        assert!(s.claim(0, 64, me()).is_none(), "an in-flight slot is not free");
        assert_eq!(s.adopt(g, 8192, 4096, (7, 7)), Err(Refusal::OtherBlock(4096, 4096)), "wrong offset");
        assert_eq!(s.adopt(g, 4096, 8192, (7, 7)), Err(Refusal::OtherBlock(4096, 4096)), "wrong size");
        assert_eq!(s.adopt(g, 4096, 1, (7, 7)), Err(Refusal::OtherBlock(4096, 4096)), "wrong size");
        assert_eq!(s.load(), (g, IN_FLIGHT), "a refused handle leaves the share in flight");
        assert_eq!(s.adopt(g.wrapping_add(1), 4096, 4096, (7, 7)), Err(Refusal::NotInFlight), "wrong generation");
        assert_eq!(s.adopt(g, 4096, 4096, (7, 9)), Ok(()));
        assert_eq!(s.adopt(g, 4096, 4096, (7, 9)), Err(Refusal::NotInFlight), "a handle opens once");
        assert_eq!(s.holder(), (7, 9));
        assert!(s.release(g, HELD));
        assert!(!s.release(g, HELD), "double release");
        assert_eq!(s.claim(0, 64, me()), Some(g.wrapping_add(1)));
        assert_eq!(s.block(), (0, 64));
    }

    #[test]
    fn liveness_checks_pid_and_start_time() {
        let (pid, start) = me();
        assert!(start > 0);
        assert!(alive(pid, start));
        assert!(!alive(pid, start + 1), "same pid, other start time: a reused pid");
        assert!(!alive(0, 0));
        assert!(!alive(i32::MAX, start));
    }
}
