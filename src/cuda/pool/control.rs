//! The control block: a small sealed memfd shared by the producer and its
//! consumers, holding the version state and one hold slot per consumer.
//!
//! Layout: `[magic u64 | state u64 | slots u64 | event valid u64 |
//! changes u32 | releases u32 | pad]` then the publish event's handle (64
//! bytes), then one 64-byte line per consumer slot whose first word is the
//! version that consumer holds (0: none). `state` is
//! `version << 2 | TORN | WRITING`.
//!
//! `changes` and `releases` are futex words, so that a waiter sleeps until
//! the other side acts instead of polling: the producer bumps `changes` and
//! wakes it whenever `state` changes, a consumer (or the producer, for a
//! consumer that went) bumps `releases` whenever a slot is let go. Waits
//! are still capped (at [`WAIT_SLICE`]), so a peer that never wakes (a
//! hostile one, or one built before these words) costs latency, never a
//! hang.
//!
//! The handshake is Dekker's, every access SeqCst: a consumer stores the
//! version into its slot and then reads the state; the producer sets
//! WRITING and then reads the slots. Whichever goes second sees the
//! other, so a consumer never holds a version while the producer writes:
//! either the consumer sees WRITING (and lets go), or the producer sees
//! the hold (and waits for it).

use super::backend::EVENT_BYTES;
use super::region::{page_size, Region};
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::seals::{check_received, seal_against_shrinking, sealable_memfd};
use crate::syscalls::{futex_wait, futex_wake};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

const MAGIC: u64 = u64::from_le_bytes(*b"SSPCTL01");
/// An update is being written.
pub const WRITING: u64 = 1;
/// An update was abandoned without publish: the memory is a mix.
pub const TORN: u64 = 2;
const HEADER: usize = 64;
const CHANGES_AT: usize = 32;
const RELEASES_AT: usize = 36;
/// The longest a waiter sleeps before it looks again on its own.
pub const WAIT_SLICE: Duration = Duration::from_millis(2);
const EVENT_AT: usize = 64;
const SLOTS_AT: usize = 128;
const LINE: usize = 64;

/// What a consumer's attempt to hold the current version found.
#[derive(Debug, PartialEq, Eq)]
pub enum Hold {
    Held(u64),
    /// An update is being written (or nothing is published yet): try again.
    Writing,
    Torn,
}

pub struct ControlBlock {
    region: Region,
    slots: usize,
}

/// Bytes of a control block with `slots` slots.
pub fn block_bytes(slots: usize) -> usize {
    (SLOTS_AT + slots * LINE).next_multiple_of(page_size())
}

impl ControlBlock {
    /// A new block (version 0, nothing published) and its descriptor.
    pub fn create(slots: usize) -> Result<(ControlBlock, OwnedFd)> {
        let len = block_bytes(slots);
        let what = "a pool control block";
        let fd = sealable_memfd(c"ss-pool-control", what)?;
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::last_os_error(format!("unable to size {what}")));
        }
        seal_against_shrinking(fd.as_raw_fd(), what)?;
        let region = Region::map(fd.as_raw_fd(), len, what)?;
        let block = ControlBlock { region, slots };
        block.word(16).store(slots as u64, SeqCst);
        block.word(0).store(MAGIC, SeqCst);
        Ok((block, fd))
    }

    /// Maps a block received from a producer, after checking its seal,
    /// size, magic and slot count.
    pub fn open(fd: &OwnedFd, slots: usize) -> Result<ControlBlock> {
        let what = "the pool's control block";
        if slots == 0 || slots > super::options::MAX_CONSUMERS {
            return Err(Error::new(ErrorKind::Protocol, format!("{what}: {slots} slots announced")));
        }
        let len = block_bytes(slots);
        check_received(fd.as_raw_fd(), len, what)?;
        let region = Region::map(fd.as_raw_fd(), len, what)?;
        let block = ControlBlock { region, slots };
        let (magic, have) = (block.word(0).load(SeqCst), block.word(16).load(SeqCst));
        if magic != MAGIC || have != slots as u64 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("{what} has magic 0x{magic:x} and {have} slots, not a block of {slots} slots"),
            ));
        }
        Ok(block)
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at % 8 == 0 && at + 8 <= self.region.len());
        // SAFETY: in bounds and 8-aligned (page-aligned base); the memory
        // is shared and only ever accessed atomically.
        unsafe { &*(self.region.base().add(at) as *const AtomicU64) }
    }

    fn futex_word(&self, at: usize) -> &AtomicU32 {
        debug_assert!(at % 4 == 0 && at + 4 <= HEADER);
        // SAFETY: in the header and 4-aligned; shared, only ever accessed
        // atomically (and by the kernel's futex calls).
        unsafe { &*(self.region.base().add(at) as *const AtomicU32) }
    }

    /// Bumps a futex word and wakes whoever sleeps on it, in any process.
    fn signal(&self, at: usize) {
        let word = self.futex_word(at);
        word.fetch_add(1, SeqCst);
        futex_wake(word);
    }

    /// Sleeps while the futex word at `at` is still `seen`, for at most
    /// `max` and [`WAIT_SLICE`].
    fn wait_for_signal(&self, at: usize, seen: u32, max: Duration) {
        futex_wait(self.futex_word(at), seen, Some(max.min(WAIT_SLICE)));
    }

    fn slot(&self, slot: usize) -> &AtomicU64 {
        assert!(slot < self.slots, "slot {slot} of {}", self.slots);
        self.word(SLOTS_AT + slot * LINE)
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn state(&self) -> u64 {
        self.word(8).load(SeqCst)
    }

    pub fn version(&self) -> u64 {
        self.state() >> 2
    }

    // ---- producer side ----

    /// Sets WRITING; false when it was set already.
    pub fn begin_writing(&self) -> bool {
        let before = self.word(8).fetch_or(WRITING, SeqCst);
        fence(SeqCst);
        before & WRITING == 0
    }

    /// Lets readers in again without a new version (a begin that timed out
    /// before anything was written).
    pub fn cancel_writing(&self) {
        self.word(8).fetch_and(!WRITING, SeqCst);
        self.signal(CHANGES_AT);
    }

    /// The slots that hold a version now.
    pub fn holders(&self) -> Vec<usize> {
        (0..self.slots).filter(|s| self.slot(*s).load(SeqCst) != 0).collect()
    }

    /// Stores the event (if any) and the next version, clearing WRITING
    /// and TORN. Returns the new version.
    pub fn publish(&self, event: Option<&[u8; EVENT_BYTES]>) -> u64 {
        self.publish_as(event, self.version() + 1)
    }

    /// [`ControlBlock::publish`] under a version the caller names (at
    /// least 1, below 2^62): a replica of another pool publishes the
    /// version its source sent, so readers on every node see one number.
    pub fn publish_as(&self, event: Option<&[u8; EVENT_BYTES]>, next: u64) -> u64 {
        debug_assert!((1..1 << 62).contains(&next), "version {next}");
        if let Some(ev) = event {
            for (i, chunk) in ev.chunks_exact(8).enumerate() {
                self.word(EVENT_AT + i * 8).store(u64::from_ne_bytes(chunk.try_into().expect("8 bytes")), SeqCst);
            }
        }
        self.word(24).store(u64::from(event.is_some()), SeqCst);
        self.word(8).store(next << 2, SeqCst);
        self.signal(CHANGES_AT);
        next
    }

    /// Marks the memory torn (an update dropped without publish).
    pub fn abandon(&self) {
        let v = self.version();
        self.word(8).store(v << 2 | TORN, SeqCst);
        self.signal(CHANGES_AT);
    }

    /// Frees the slot of a consumer that is gone.
    pub fn clear_slot(&self, slot: usize) {
        // The same let-go as the consumer's own, done on its behalf.
        self.drop_hold(slot);
    }

    /// How many times a slot was let go: read it before looking at the
    /// holders, then [`ControlBlock::wait_release`] with what it was.
    pub fn releases(&self) -> u32 {
        self.futex_word(RELEASES_AT).load(SeqCst)
    }

    /// Sleeps until a slot is let go after `releases` was `seen`, for at
    /// most `max` (and [`WAIT_SLICE`]).
    pub fn wait_release(&self, seen: u32, max: Duration) {
        self.wait_for_signal(RELEASES_AT, seen, max);
    }

    // ---- consumer side ----

    /// How many times the state changed: read it before
    /// [`ControlBlock::try_hold`], then [`ControlBlock::wait_change`] with
    /// what it was.
    pub fn changes(&self) -> u32 {
        self.futex_word(CHANGES_AT).load(SeqCst)
    }

    /// Sleeps until the state changes after `changes` was `seen`, for at
    /// most `max` (and [`WAIT_SLICE`]).
    pub fn wait_change(&self, seen: u32, max: Duration) {
        self.wait_for_signal(CHANGES_AT, seen, max);
    }

    /// One attempt to hold the current version in `slot`.
    pub fn try_hold(&self, slot: usize) -> Hold {
        let s = self.state();
        if s & TORN != 0 {
            return Hold::Torn;
        }
        if s & WRITING != 0 || s >> 2 == 0 {
            return Hold::Writing;
        }
        self.slot(slot).store(s >> 2, SeqCst);
        fence(SeqCst);
        let again = self.state();
        if again != s {
            // The producer may have seen this brief hold and gone to sleep.
            self.drop_hold(slot);
            return if again & TORN != 0 { Hold::Torn } else { Hold::Writing };
        }
        Hold::Held(s >> 2)
    }

    /// Lets go of the version held in `slot`.
    pub fn drop_hold(&self, slot: usize) {
        self.slot(slot).store(0, SeqCst);
        self.signal(RELEASES_AT);
    }

    /// The event of the last publish, if it recorded one.
    pub fn event(&self) -> Option<[u8; EVENT_BYTES]> {
        if self.word(24).load(SeqCst) == 0 {
            return None;
        }
        let mut ev = [0u8; EVENT_BYTES];
        for (i, chunk) in ev.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&self.word(EVENT_AT + i * 8).load(SeqCst).to_ne_bytes());
        }
        Some(ev)
    }
}

const _: () = assert!(HEADER <= EVENT_AT && EVENT_AT + EVENT_BYTES <= SLOTS_AT);
const _: () = assert!(32 <= CHANGES_AT && CHANGES_AT < RELEASES_AT && RELEASES_AT + 4 <= HEADER);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_and_updates_exclude_each_other() {
        let (producer, fd) = ControlBlock::create(4).unwrap();
        let consumer = ControlBlock::open(&fd, 4).unwrap();
        assert_eq!(consumer.try_hold(1), Hold::Writing, "nothing published yet");
        assert_eq!(producer.publish(None), 1);
        assert_eq!(consumer.try_hold(1), Hold::Held(1));
        assert!(producer.begin_writing());
        assert!(!producer.begin_writing(), "one writer at a time");
        assert_eq!(producer.holders(), vec![1], "the producer sees the hold");
        assert_eq!(consumer.try_hold(2), Hold::Writing, "no new hold while writing");
        assert_eq!(producer.holders(), vec![1], "a refused hold leaves its slot clear");
        consumer.drop_hold(1);
        assert!(producer.holders().is_empty());
        let ev = [7u8; EVENT_BYTES];
        assert_eq!(producer.publish(Some(&ev)), 2);
        assert_eq!(consumer.try_hold(0), Hold::Held(2));
        assert_eq!(consumer.event(), Some(ev));
        consumer.drop_hold(0);
        assert!(producer.begin_writing());
        producer.abandon();
        assert_eq!(consumer.try_hold(0), Hold::Torn);
        assert!(producer.begin_writing());
        assert_eq!(producer.publish(None), 3);
        assert_eq!(consumer.try_hold(0), Hold::Held(3));
        assert_eq!(consumer.event(), None);
        producer.clear_slot(0);
        assert!(producer.holders().is_empty());
    }

    #[test]
    fn every_state_change_and_every_let_go_is_signalled() {
        let (producer, fd) = ControlBlock::create(4).unwrap();
        let consumer = ControlBlock::open(&fd, 4).unwrap();
        let (c0, r0) = (consumer.changes(), producer.releases());
        producer.publish(None);
        assert!(producer.begin_writing());
        producer.cancel_writing();
        assert!(producer.begin_writing());
        producer.abandon();
        assert_eq!(consumer.changes(), c0 + 3, "publish, cancel and abandon each wake the consumers");
        producer.publish(None);
        assert_eq!(consumer.try_hold(0), Hold::Held(2));
        consumer.drop_hold(0);
        assert_eq!(consumer.try_hold(1), Hold::Held(2));
        producer.clear_slot(1);
        assert_eq!(producer.releases(), r0 + 2, "a release and a cleared slot each wake the producer");
        assert!(producer.begin_writing());
        assert_eq!(consumer.try_hold(2), Hold::Writing);
        assert_eq!(producer.releases(), r0 + 2, "a hold refused before it was stored signals nothing");
    }

    #[test]
    fn a_named_version_is_published_as_it_is() {
        let (producer, fd) = ControlBlock::create(4).unwrap();
        let consumer = ControlBlock::open(&fd, 4).unwrap();
        assert_eq!(producer.publish_as(None, 41), 41);
        assert_eq!(consumer.try_hold(0), Hold::Held(41));
        consumer.drop_hold(0);
        assert!(producer.begin_writing());
        producer.abandon();
        assert_eq!(producer.publish_as(None, 3), 3, "a new source may count from lower");
        assert_eq!(consumer.try_hold(0), Hold::Held(3), "and the publish clears TORN");
        assert_eq!(producer.publish(None), 4);
    }

    #[test]
    fn a_forged_block_is_refused() {
        let (_p, fd) = ControlBlock::create(4).unwrap();
        assert_eq!(ControlBlock::open(&fd, 5000).err().unwrap().kind(), ErrorKind::Protocol);
        let e = ControlBlock::open(&fd, 200).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{e}");
        let (_p, fd8) = ControlBlock::create(8).unwrap();
        assert_eq!(ControlBlock::open(&fd8, 4).err().unwrap().kind(), ErrorKind::Protocol, "slot count differs");
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let e = ControlBlock::open(&OwnedFd::from(f), 4).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    }
}
