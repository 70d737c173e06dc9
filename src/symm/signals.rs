//! Signals between ranks through the signal pads (docs/pytorch-compat.md, "Symmetric memory").
//!
//! The slot for (channel c, source s) in rank d's pad is the u32 at index
//! `world_size * c + s`. A put compare-and-swaps the slot 0 -> 1 in the
//! destination's pad; a wait compare-and-swaps its own slot 1 -> 0. So
//! every pad is all zero after a clean synchronisation, as in PyTorch.
//!
//! Where PyTorch's kernel only spins, a CPU rank spins for a short while
//! and then sleeps on a futex. The futex is the shared (not private) kind,
//! because the word is mapped by several processes at different addresses.
//! A sleeper marks the slot first, so the fast path never makes a system
//! call: 2 = empty with the waiter asleep, 3 = full with the putter asleep.
//! The one who changes a marked slot wakes the sleeper. Marks exist only
//! while someone sleeps; a timed-out sleeper removes its own mark.

use crate::syscalls::{futex_wait, futex_wake};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const EMPTY: u32 = 0;
const FULL: u32 = 1;
const EMPTY_WAITER_ASLEEP: u32 = 2;
const FULL_PUTTER_ASLEEP: u32 = 3;

/// How long to spin on the core alone: a peer that is running answers
/// within this.
const SPIN_HOT: Duration = Duration::from_micros(5);
/// How long to keep looking, yielding the core at each look, before
/// sleeping. More ranks than cores (or other work on them) means the peer
/// being waited for may be runnable but not running: a yield lets it (or
/// another rank) run at once, where a futex sleep would add a wake-up's
/// scheduling delay to every signal.
const SPIN_YIELDING: Duration = Duration::from_millis(2);

/// The wait ran past its deadline.
#[derive(Debug, PartialEq, Eq)]
pub struct Elapsed;

/// A timeout whose clock starts at the first look at it: a signal that is
/// already there (the fast path) never reads the clock. One deadline may
/// span several puts and waits (a barrier).
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    timeout: Option<Duration>,
    at: Option<Instant>,
}

impl Deadline {
    /// `None` waits forever.
    pub fn after(timeout: Option<Duration>) -> Self {
        Deadline { timeout, at: None }
    }

    /// The instant it expires (starting the clock now if not yet started).
    fn instant(&mut self) -> Option<Instant> {
        let t = self.timeout?;
        Some(*self.at.get_or_insert_with(|| Instant::now() + t))
    }
}

/// Puts a signal into `slot` (0 -> 1), waiting while the previous signal is
/// still there. `deadline` None waits forever.
pub fn put(slot: &AtomicU32, deadline: &mut Deadline) -> Result<(), Elapsed> {
    // Fast path: one read-for-ownership of the line, not a read then an upgrade.
    if slot.compare_exchange(EMPTY, FULL, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        return Ok(());
    }
    let mut spin = Spinner::new();
    loop {
        match slot.load(Ordering::Acquire) {
            EMPTY => {
                if slot.compare_exchange(EMPTY, FULL, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    return Ok(());
                }
            }
            EMPTY_WAITER_ASLEEP => {
                if slot.compare_exchange(EMPTY_WAITER_ASLEEP, FULL, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    futex_wake(slot);
                    return Ok(());
                }
            }
            _full => {
                if spin.spinning() {
                    continue;
                }
                sleep_on(slot, FULL, FULL_PUTTER_ASLEEP, deadline.instant())?;
            }
        }
    }
}

/// Waits for a signal in `slot` and consumes it (1 -> 0). `deadline` None
/// waits forever.
pub fn wait(slot: &AtomicU32, deadline: &mut Deadline) -> Result<(), Elapsed> {
    // Fast path for a signal that is already there (then spin on plain
    // reads, which leave the line shared until the putter writes it).
    if slot.compare_exchange(FULL, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        return Ok(());
    }
    let mut spin = Spinner::new();
    loop {
        match slot.load(Ordering::Acquire) {
            FULL => {
                if slot.compare_exchange(FULL, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    return Ok(());
                }
            }
            FULL_PUTTER_ASLEEP => {
                if slot.compare_exchange(FULL_PUTTER_ASLEEP, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    futex_wake(slot);
                    return Ok(());
                }
            }
            _empty => {
                if spin.spinning() {
                    continue;
                }
                sleep_on(slot, EMPTY, EMPTY_WAITER_ASLEEP, deadline.instant())?;
            }
        }
    }
}

/// Marks `slot` from `plain` to `marked` and sleeps until the other side
/// changes it, or until `deadline`; then returns for the caller to look
/// again. On expiry the mark is taken back; if the other side changed the
/// slot meanwhile, the caller looks again instead of failing.
fn sleep_on(slot: &AtomicU32, plain: u32, marked: u32, deadline: Option<Instant>) -> Result<(), Elapsed> {
    let remaining = match deadline {
        None => None,
        Some(d) => match d.checked_duration_since(Instant::now()) {
            Some(r) if !r.is_zero() => Some(r),
            _ => return expire(slot, plain, marked),
        },
    };
    match slot.compare_exchange(plain, marked, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {}
        Err(now) if now == marked => {}
        Err(_) => return Ok(()), // changed under us: look again
    }
    futex_wait(slot, marked, remaining);
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return expire(slot, plain, marked);
    }
    Ok(())
}

/// At the deadline: fails if the slot still holds what we wait to change
/// (after removing our mark), else lets the caller look again.
fn expire(slot: &AtomicU32, plain: u32, marked: u32) -> Result<(), Elapsed> {
    let _ = slot.compare_exchange(marked, plain, Ordering::AcqRel, Ordering::Acquire);
    if slot.load(Ordering::Acquire) == plain {
        Err(Elapsed)
    } else {
        Ok(())
    }
}

/// Spins for [`SPIN_HOT`], then yields for up to [`SPIN_YIELDING`],
/// checking the clock every few rounds.
struct Spinner {
    start: Option<Instant>,
    rounds: u32,
}

impl Spinner {
    fn new() -> Self {
        Spinner { start: None, rounds: 0 }
    }

    /// True while the spin budget lasts (after a pause hint, or past
    /// [`SPIN_HOT`] a yield of the core).
    fn spinning(&mut self) -> bool {
        self.rounds = self.rounds.wrapping_add(1);
        if self.rounds % 64 == 0 {
            let start = *self.start.get_or_insert_with(Instant::now);
            let spent = start.elapsed();
            if spent >= SPIN_YIELDING {
                return false;
            }
            if spent >= SPIN_HOT {
                // SAFETY: sched_yield takes nothing and cannot fail on Linux.
                unsafe { libc::sched_yield() };
            }
        }
        std::hint::spin_loop();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn soon(ms: u64) -> Deadline {
        Deadline::after(Some(Duration::from_millis(ms)))
    }

    fn never() -> Deadline {
        Deadline::after(None)
    }

    #[test]
    fn put_then_wait_leaves_zero() {
        let slot = AtomicU32::new(0);
        put(&slot, &mut never()).unwrap();
        assert_eq!(slot.load(Ordering::SeqCst), 1);
        wait(&slot, &mut never()).unwrap();
        assert_eq!(slot.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn wait_times_out_and_leaves_no_mark() {
        let slot = AtomicU32::new(0);
        assert_eq!(wait(&slot, &mut soon(30)), Err(Elapsed));
        assert_eq!(slot.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn put_on_full_slot_times_out_and_keeps_the_signal() {
        let slot = AtomicU32::new(1);
        assert_eq!(put(&slot, &mut soon(30)), Err(Elapsed));
        assert_eq!(slot.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn sleeping_waiter_is_woken_by_put() {
        let slot = Arc::new(AtomicU32::new(0));
        let s2 = slot.clone();
        let t = std::thread::spawn(move || wait(&s2, &mut soon(5000)));
        std::thread::sleep(Duration::from_millis(50)); // past the spin: asleep
        assert_eq!(slot.load(Ordering::SeqCst), EMPTY_WAITER_ASLEEP);
        put(&slot, &mut never()).unwrap();
        t.join().unwrap().unwrap();
        assert_eq!(slot.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn sleeping_putter_is_woken_by_wait() {
        let slot = Arc::new(AtomicU32::new(1));
        let s2 = slot.clone();
        let t = std::thread::spawn(move || put(&s2, &mut soon(5000)));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(slot.load(Ordering::SeqCst), FULL_PUTTER_ASLEEP);
        wait(&slot, &mut never()).unwrap();
        t.join().unwrap().unwrap();
        assert_eq!(slot.load(Ordering::SeqCst), 1); // the second signal
        wait(&slot, &mut never()).unwrap();
        assert_eq!(slot.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn many_round_trips_between_threads() {
        let a = Arc::new(AtomicU32::new(0));
        let b = Arc::new(AtomicU32::new(0));
        let (a2, b2) = (a.clone(), b.clone());
        let t = std::thread::spawn(move || {
            for _ in 0..2000 {
                wait(&a2, &mut soon(10_000)).unwrap();
                put(&b2, &mut soon(10_000)).unwrap();
            }
        });
        for _ in 0..2000 {
            put(&a, &mut soon(10_000)).unwrap();
            wait(&b, &mut soon(10_000)).unwrap();
        }
        t.join().unwrap();
        assert_eq!((a.load(Ordering::SeqCst), b.load(Ordering::SeqCst)), (0, 0));
    }
}
