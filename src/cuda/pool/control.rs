//! The shared words of the version protocol: the control block, which
//! only the producer writes, and one hold slot per consumer connection,
//! which only that consumer (and the producer, for a consumer that went)
//! writes.
//!
//! Control block: one page of a memfd, mapped writable by the producer and
//! then sealed (`F_SEAL_FUTURE_WRITE`), so consumers can map it read-only
//! and never write it. Layout: `[magic u64 | state u64 | slots u64 | event
//! valid u64 | changes u32 | pad]` then the publish event's handle (64
//! bytes). `state` is `version << 2 | TORN | WRITING`. The producer keeps
//! the truth in a private copy ([`ControlWriter`]) and only ever stores
//! it, never reads the shared words back, so whatever lands there cannot
//! change what the producer does.
//!
//! Hold slot: one page of a memfd of its own, made for one connection and
//! sent to that consumer alone: `[held version u64 | releases u32]`. A
//! consumer cannot touch another's slot, and the producer counts only the
//! slots of live connections, so a hold written by a consumer ends with its
//! connection.
//!
//! `changes` and `releases` are futex words, so that a waiter sleeps until
//! the other side acts instead of polling: the producer bumps `changes`
//! whenever `state` changes, a consumer (or the producer, for a consumer
//! that went) bumps its slot's `releases` whenever it lets go. Waits are
//! still capped (at [`WAIT_SLICE`]), so a peer that never wakes costs
//! latency, never a hang.
//!
//! The handshake is Dekker's, every access SeqCst: a consumer stores the
//! version into its slot and then reads the state; the producer stores
//! WRITING and then reads the slots. Whichever goes second sees the
//! other, so a consumer never holds a version while the producer writes:
//! either the consumer sees WRITING (and lets go), or the producer sees
//! the hold (and waits for it).

use super::backend::EVENT_BYTES;
use super::region::{page_size, Region};
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::seals::{check_received, seal_against_others_writing, seal_against_shrinking, sealable_memfd};
use crate::syscalls::{futex_wait, futex_wake};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::Duration;

const MAGIC: u64 = u64::from_le_bytes(*b"SSPCTL02");
/// An update is being written.
pub const WRITING: u64 = 1;
/// An update was abandoned without publish: the memory is a mix.
pub const TORN: u64 = 2;
const STATE_AT: usize = 8;
const SLOTS_AT: usize = 16;
const EVENT_VALID_AT: usize = 24;
const CHANGES_AT: usize = 32;
const EVENT_AT: usize = 64;
/// In a hold slot: the version held (0: none), then the release counter.
const HELD_AT: usize = 0;
const RELEASES_AT: usize = 8;
/// The longest a waiter sleeps before it looks again on its own.
pub const WAIT_SLICE: Duration = Duration::from_millis(2);

/// What a consumer's attempt to hold the current version found.
#[derive(Debug, PartialEq, Eq)]
pub enum Hold {
    Held(u64),
    /// An update is being written (or nothing is published yet): try again.
    Writing,
    Torn,
}

/// A page of shared memory read and written only atomically.
struct Words {
    region: Region,
}

impl Words {
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at % 8 == 0 && at + 8 <= self.region.len());
        // SAFETY: in bounds and 8-aligned (page-aligned base); the memory
        // is shared and only ever accessed atomically.
        unsafe { &*(self.region.base().add(at) as *const AtomicU64) }
    }

    fn futex_word(&self, at: usize) -> &AtomicU32 {
        debug_assert!(at % 4 == 0 && at + 4 <= self.region.len());
        // SAFETY: in bounds and 4-aligned; shared, only ever accessed
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
}

/// A new memfd of one page, sized and mapped writable.
fn new_page(label: &std::ffi::CStr, what: &str) -> Result<(Words, OwnedFd)> {
    let len = page_size();
    let fd = sealable_memfd(label, what)?;
    // SAFETY: ftruncate on our own memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(Error::last_os_error(format!("unable to size {what}")));
    }
    let region = Region::map(fd.as_raw_fd(), len, what)?;
    Ok((Words { region }, fd))
}

/// The producer's truth, of which the control block is a copy.
struct Truth {
    state: u64,
    event: Option<[u8; EVENT_BYTES]>,
}

/// The producer's side of the control block.
pub struct ControlWriter {
    words: Words,
    slots: usize,
    truth: Mutex<Truth>,
    /// Whether consumers cannot write the block (the kernel has the seal).
    write_protected: bool,
}

impl ControlWriter {
    /// A new block (version 0, nothing published) for `slots` consumers,
    /// and the descriptor to send them.
    pub fn create(slots: usize) -> Result<(ControlWriter, OwnedFd)> {
        let what = "a pool control block";
        let (words, fd) = new_page(c"ss-pool-control", what)?;
        let write_protected = seal_against_others_writing(fd.as_raw_fd(), what)?;
        let block = ControlWriter { words, slots, truth: Mutex::new(Truth { state: 0, event: None }), write_protected };
        block.restore();
        Ok((block, fd))
    }

    /// Whether consumers can only read the block (false on kernels before
    /// Linux 5.1; then what a consumer writes there is undone by
    /// [`ControlWriter::restore`] when it goes, and by every change).
    pub fn write_protected(&self) -> bool {
        self.write_protected
    }

    /// Writes every shared word from the truth.
    pub fn restore(&self) {
        let truth = super::lock(&self.truth);
        self.store(&truth);
        self.words.word(0).store(MAGIC, SeqCst);
        self.words.word(SLOTS_AT).store(self.slots as u64, SeqCst);
    }

    fn store(&self, truth: &Truth) {
        let words = &self.words;
        for (i, chunk) in truth.event.unwrap_or([0; EVENT_BYTES]).chunks_exact(8).enumerate() {
            words.word(EVENT_AT + i * 8).store(u64::from_ne_bytes(chunk.try_into().expect("8 bytes")), SeqCst);
        }
        words.word(EVENT_VALID_AT).store(u64::from(truth.event.is_some()), SeqCst);
        words.word(STATE_AT).store(truth.state, SeqCst);
        fence(SeqCst);
    }

    /// Changes the truth, stores it and wakes the consumers.
    fn change(&self, f: impl FnOnce(&mut Truth)) -> u64 {
        let mut truth = super::lock(&self.truth);
        f(&mut truth);
        self.store(&truth);
        self.words.signal(CHANGES_AT);
        truth.state
    }

    pub fn version(&self) -> u64 {
        super::lock(&self.truth).state >> 2
    }

    /// Keeps new holds out: WRITING from now on. The caller then waits
    /// until no live consumer holds a version.
    pub fn begin_writing(&self) {
        self.change(|t| t.state |= WRITING);
    }

    /// Lets readers in again without a new version (a begin that timed out
    /// before anything was written).
    pub fn cancel_writing(&self) {
        self.change(|t| t.state &= !WRITING);
    }

    /// Stores the event (if any) and the next version, clearing WRITING
    /// and TORN. Returns the new version.
    pub fn publish(&self, event: Option<&[u8; EVENT_BYTES]>) -> u64 {
        self.publish_as(event, self.version() + 1)
    }

    /// [`ControlWriter::publish`] under a version the caller names (at
    /// least 1, below 2^62): a replica of another pool publishes the
    /// version its source sent, so readers on every node see one number.
    pub fn publish_as(&self, event: Option<&[u8; EVENT_BYTES]>, next: u64) -> u64 {
        debug_assert!((1..1 << 62).contains(&next), "version {next}");
        self.change(|t| {
            t.event = event.copied();
            t.state = next << 2;
        }) >> 2
    }

    /// Whether an update was abandoned since the last publish.
    pub fn torn(&self) -> bool {
        super::lock(&self.truth).state & TORN != 0
    }

    /// Marks the memory torn (an update dropped without publish).
    pub fn abandon(&self) {
        self.change(|t| t.state = (t.state >> 2) << 2 | TORN);
    }
}

/// A consumer's read-only view of the control block.
pub struct ControlReader {
    words: Words,
}

impl ControlReader {
    /// Maps a block received from a producer, read-only, after checking
    /// its seal, size, magic and slot count.
    pub fn open(fd: &OwnedFd, slots: usize) -> Result<ControlReader> {
        let what = "the pool's control block";
        if slots == 0 || slots > super::options::MAX_CONSUMERS {
            return Err(Error::new(ErrorKind::Protocol, format!("{what}: {slots} slots announced")));
        }
        let len = page_size();
        check_received(fd.as_raw_fd(), len, what)?;
        let block = ControlReader { words: Words { region: Region::map_read_only(fd.as_raw_fd(), len, what)? } };
        let (magic, have) = (block.words.word(0).load(SeqCst), block.words.word(SLOTS_AT).load(SeqCst));
        if magic != MAGIC || have != slots as u64 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("{what} has magic 0x{magic:x} and {have} slots, not a block of {slots} slots"),
            ));
        }
        Ok(block)
    }

    pub fn state(&self) -> u64 {
        self.words.word(STATE_AT).load(SeqCst)
    }

    pub fn version(&self) -> u64 {
        self.state() >> 2
    }

    /// How many times the state changed: read it before
    /// [`ControlReader::try_hold`], then [`ControlReader::wait_change`]
    /// with what it was.
    pub fn changes(&self) -> u32 {
        self.words.futex_word(CHANGES_AT).load(SeqCst)
    }

    /// Sleeps until the state changes after `changes` was `seen`, for at
    /// most `max` (and [`WAIT_SLICE`]).
    pub fn wait_change(&self, seen: u32, max: Duration) {
        self.words.wait_for_signal(CHANGES_AT, seen, max);
    }

    /// One attempt to hold the current version in `slot`.
    pub fn try_hold(&self, slot: &HoldSlot) -> Hold {
        let s = self.state();
        if s & TORN != 0 {
            return Hold::Torn;
        }
        if s & WRITING != 0 || s >> 2 == 0 {
            return Hold::Writing;
        }
        slot.words.word(HELD_AT).store(s >> 2, SeqCst);
        fence(SeqCst);
        let again = self.state();
        if again != s {
            // The producer may have seen this brief hold and gone to sleep.
            slot.let_go();
            return if again & TORN != 0 { Hold::Torn } else { Hold::Writing };
        }
        Hold::Held(s >> 2)
    }

    /// The event of the last publish, if it recorded one.
    pub fn event(&self) -> Option<[u8; EVENT_BYTES]> {
        if self.words.word(EVENT_VALID_AT).load(SeqCst) == 0 {
            return None;
        }
        let mut ev = [0u8; EVENT_BYTES];
        for (i, chunk) in ev.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&self.words.word(EVENT_AT + i * 8).load(SeqCst).to_ne_bytes());
        }
        Some(ev)
    }
}

/// One consumer connection's hold: the version it reads (0: none).
pub struct HoldSlot {
    words: Words,
}

impl HoldSlot {
    /// A new slot (nothing held) and the descriptor for its consumer.
    pub fn create() -> Result<(HoldSlot, OwnedFd)> {
        let what = "a pool hold slot";
        let (words, fd) = new_page(c"ss-pool-hold", what)?;
        seal_against_shrinking(fd.as_raw_fd(), what)?;
        Ok((HoldSlot { words }, fd))
    }

    /// Maps the slot a producer sent this consumer.
    pub fn open(fd: &OwnedFd) -> Result<HoldSlot> {
        let what = "the pool's hold slot";
        let len = page_size();
        check_received(fd.as_raw_fd(), len, what)?;
        Ok(HoldSlot { words: Words { region: Region::map(fd.as_raw_fd(), len, what)? } })
    }

    /// The version held (0: none).
    pub fn held(&self) -> u64 {
        self.words.word(HELD_AT).load(SeqCst)
    }

    /// Lets go of the version held, and wakes a producer waiting for it.
    pub fn let_go(&self) {
        self.words.word(HELD_AT).store(0, SeqCst);
        self.words.signal(RELEASES_AT);
    }

    /// How many times the slot was let go: read it before looking at
    /// [`HoldSlot::held`], then [`HoldSlot::wait_release`] with what it was.
    pub fn releases(&self) -> u32 {
        self.words.futex_word(RELEASES_AT).load(SeqCst)
    }

    /// Sleeps until the slot is let go after `releases` was `seen`, for
    /// at most `max` (and [`WAIT_SLICE`]).
    pub fn wait_release(&self, seen: u32, max: Duration) {
        self.words.wait_for_signal(RELEASES_AT, seen, max);
    }
}

const _: () = assert!(CHANGES_AT + 4 <= EVENT_AT && EVENT_AT + EVENT_BYTES <= 4096);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_and_updates_exclude_each_other() {
        let (producer, fd) = ControlWriter::create(4).unwrap();
        let consumer = ControlReader::open(&fd, 4).unwrap();
        let (slot, slot_fd) = HoldSlot::create().unwrap();
        let mine = HoldSlot::open(&slot_fd).unwrap();
        assert_eq!(consumer.try_hold(&mine), Hold::Writing, "nothing published yet");
        assert_eq!(producer.publish(None), 1);
        assert_eq!(consumer.try_hold(&mine), Hold::Held(1));
        assert_eq!(slot.held(), 1, "the producer sees the hold");
        producer.begin_writing();
        let (other, _) = HoldSlot::create().unwrap();
        assert_eq!(consumer.try_hold(&other), Hold::Writing, "no new hold while writing");
        assert_eq!(other.held(), 0, "a refused hold leaves its slot clear");
        mine.let_go();
        assert_eq!(slot.held(), 0);
        let ev = [7u8; EVENT_BYTES];
        assert_eq!(producer.publish(Some(&ev)), 2);
        assert_eq!(consumer.try_hold(&mine), Hold::Held(2));
        assert_eq!(consumer.event(), Some(ev));
        mine.let_go();
        producer.begin_writing();
        producer.abandon();
        assert_eq!(consumer.try_hold(&mine), Hold::Torn);
        producer.begin_writing();
        assert_eq!(producer.publish(None), 3);
        assert_eq!(consumer.try_hold(&mine), Hold::Held(3));
        assert_eq!(consumer.event(), None);
    }

    #[test]
    fn every_state_change_and_every_let_go_is_signalled() {
        let (producer, fd) = ControlWriter::create(4).unwrap();
        let consumer = ControlReader::open(&fd, 4).unwrap();
        let (slot, _) = HoldSlot::create().unwrap();
        let (c0, r0) = (consumer.changes(), slot.releases());
        producer.publish(None);
        producer.begin_writing();
        producer.cancel_writing();
        producer.begin_writing();
        producer.abandon();
        assert_eq!(consumer.changes(), c0 + 5, "every change of the state wakes the consumers");
        producer.publish(None);
        assert_eq!(consumer.try_hold(&slot), Hold::Held(2));
        slot.let_go();
        assert_eq!(slot.releases(), r0 + 1, "a let-go wakes the producer");
        producer.begin_writing();
        assert_eq!(consumer.try_hold(&slot), Hold::Writing);
        assert_eq!(slot.releases(), r0 + 1, "a hold refused before it was stored signals nothing");
    }

    #[test]
    fn consumers_cannot_write_the_block_and_the_producer_restores_it() {
        let (producer, fd) = ControlWriter::create(4).unwrap();
        producer.publish(None);
        assert!(producer.write_protected(), "this kernel has F_SEAL_FUTURE_WRITE");
        let len = page_size();
        // SAFETY: asking for a writable mapping that must be refused.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        assert_eq!(p, libc::MAP_FAILED, "a consumer mapped the control block writable");
        let ro = Region::map_read_only(fd.as_raw_fd(), len, "test").unwrap();
        // SAFETY: changing the protection of our own mapping.
        let rc = unsafe { libc::mprotect(ro.base().cast(), len, libc::PROT_READ | libc::PROT_WRITE) };
        assert_ne!(rc, 0, "a read-only mapping of the block was made writable");
        let zero = [0u8; 8];
        // SAFETY: pwrite of 8 bytes from a valid buffer.
        let n = unsafe { libc::pwrite(fd.as_raw_fd(), zero.as_ptr().cast(), 8, 0) };
        assert_eq!(n, -1, "write(2) reached the control block");
        // The producer's own mapping still writes, and a restore puts back
        // whatever a writer (before the seal existed) could have changed.
        producer.restore();
        assert_eq!(ControlReader::open(&fd, 4).unwrap().version(), 1);
    }

    #[test]
    fn a_named_version_is_published_as_it_is() {
        let (producer, fd) = ControlWriter::create(4).unwrap();
        let consumer = ControlReader::open(&fd, 4).unwrap();
        let (slot, _) = HoldSlot::create().unwrap();
        assert_eq!(producer.publish_as(None, 41), 41);
        assert_eq!(consumer.try_hold(&slot), Hold::Held(41));
        slot.let_go();
        producer.begin_writing();
        producer.abandon();
        assert!(producer.torn());
        assert_eq!(producer.publish_as(None, 3), 3, "a new source may count from lower");
        assert_eq!(consumer.try_hold(&slot), Hold::Held(3), "and the publish clears TORN");
        assert!(!producer.torn());
        assert_eq!(producer.publish(None), 4);
    }

    #[test]
    fn a_forged_block_is_refused() {
        let (_p, fd) = ControlWriter::create(4).unwrap();
        assert_eq!(ControlReader::open(&fd, 5000).err().unwrap().kind(), ErrorKind::Protocol);
        let e = ControlReader::open(&fd, 200).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        let (_p, fd8) = ControlWriter::create(8).unwrap();
        assert_eq!(ControlReader::open(&fd8, 4).err().unwrap().kind(), ErrorKind::Protocol, "slot count differs");
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let e = ControlReader::open(&OwnedFd::from(f), 4).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    }
}
