//! Process-wide locks that fork() cannot leave held in the child.
//!
//! A child made by fork() has only the thread that forked; a lock that
//! another thread of the parent held at that moment stays held for ever in
//! the child, and the child hangs on its first use. DataLoader-style
//! programs fork from threaded parents all the time. So every process-wide
//! lock of the library is a [`ForkSafeMutex`], registered once it is
//! reachable for the rest of the process: handlers installed with
//! pthread_atfork (installed here on first use) take all registered locks before the
//! fork, so no other thread is inside one and what they guard is whole,
//! and release them right after it, in the parent and in the child.
//!
//! The locks are taken with try-lock, all or none, backing off between
//! rounds, so the order in which code nests them cannot deadlock the fork.

use std::any::Any;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// A mutex that [`before_fork`] takes and [`after_fork`] releases once it
/// is registered. Poisoning is ignored: every user leaves the data whole
/// between statements that could panic.
pub struct ForkSafeMutex<T> {
    inner: Mutex<T>,
    registered: AtomicBool,
}

impl<T: Send + 'static> ForkSafeMutex<T> {
    pub const fn new(value: T) -> Self {
        ForkSafeMutex { inner: Mutex::new(value), registered: AtomicBool::new(false) }
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A static lock: registers it (first time only), then locks it.
    pub fn lock_static(&'static self) -> MutexGuard<'static, T> {
        self.register();
        self.lock()
    }

    /// Makes the fork handlers take this lock from now on.
    pub fn register(&'static self) {
        if self.registered.load(Ordering::Acquire) || self.registered.swap(true, Ordering::AcqRel) {
            return;
        }
        let slot = USED.fetch_add(1, Ordering::AcqRel);
        match SLOTS.get(slot) {
            Some(cell) => {
                let _ = cell.set(self);
            }
            None => debug_assert!(false, "more than {CAPACITY} fork-safe locks"),
        }
        install_handlers();
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for ForkSafeMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

/// What the fork handlers need of a lock of any type.
trait Holdable: Sync {
    /// The lock's guard, boxed, if it is free now.
    fn try_hold(&'static self) -> Option<Box<dyn Any>>;
}

impl<T: Send + 'static> Holdable for ForkSafeMutex<T> {
    fn try_hold(&'static self) -> Option<Box<dyn Any>> {
        match self.inner.try_lock() {
            Ok(g) => Some(Box::new(g)),
            Err(TryLockError::Poisoned(p)) => Some(Box::new(p.into_inner())),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

/// More than the library has (a handful); registration past it is ignored.
const CAPACITY: usize = 64;
/// Filled once each and never emptied, read without a lock (a slot being
/// filled at the fork reads as empty in the child: that lock was not yet
/// in use).
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: OnceLock<&'static dyn Holdable> = OnceLock::new();
static SLOTS: [OnceLock<&'static dyn Holdable>; CAPACITY] = [EMPTY; CAPACITY];
static USED: AtomicUsize = AtomicUsize::new(0);
static HANDLERS_INSTALLED: AtomicBool = AtomicBool::new(false);

/// After this long without getting every lock (only possible if the
/// forking thread holds one itself), fork with the ones that are free
/// rather than hang the parent.
const GIVE_UP_AFTER: Duration = Duration::from_secs(10);

thread_local! {
    /// Guards taken before the fork by this thread, released after it.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

fn registered() -> impl Iterator<Item = &'static dyn Holdable> {
    SLOTS[..USED.load(Ordering::Acquire).min(CAPACITY)].iter().filter_map(|s| s.get().copied())
}

/// Takes every registered lock (pthread_atfork "prepare").
pub fn before_fork() {
    let start = Instant::now();
    let mut backoff = Duration::from_micros(10);
    let held = loop {
        let mut held = Vec::new();
        let mut all = true;
        for lock in registered() {
            match lock.try_hold() {
                Some(g) => held.push(g),
                None => {
                    all = false;
                    if start.elapsed() < GIVE_UP_AFTER {
                        break;
                    }
                }
            }
        }
        if all || start.elapsed() >= GIVE_UP_AFTER {
            break held;
        }
        release(held);
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(1));
    };
    HELD.with(|h| h.borrow_mut().extend(held));
}

/// How many forks separate this process from the first one that used the
/// library: 0 there, its parent's count + 1 in a forked child. Objects that
/// hold per-process resources (sockets) compare it with the count they
/// were made under to learn, without a system call, that they are in a
/// child.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

/// This process's fork generation (see above). Installs the fork handlers
/// that count it, so call it once before relying on it to change.
pub fn fork_generation() -> u64 {
    install_handlers();
    FORK_GENERATION.load(Ordering::Acquire)
}

/// Ok in the process an object was made in (its fork generation then);
/// else `InvalidArgument` saying `why`: a forked child's copy of an object
/// that shares state with its parent must stay inert.
pub fn check_made_here(generation: u64, why: impl FnOnce() -> String) -> crate::error::Result<()> {
    if fork_generation() == generation {
        return Ok(());
    }
    Err(crate::error::Error::new(crate::error::ErrorKind::InvalidArgument, why()))
}

fn install_handlers() {
    if !HANDLERS_INSTALLED.load(Ordering::Acquire) && !HANDLERS_INSTALLED.swap(true, Ordering::AcqRel) {
        // SAFETY: pthread_atfork only stores the pointers to three
        // functions that take and return nothing and never unwind.
        unsafe {
            libc::pthread_atfork(Some(prepare_hook), Some(parent_hook), Some(child_hook));
        }
    }
}

// The pthread_atfork callbacks. A panic is caught in each because it must
// not unwind into the C library that calls them.

extern "C" fn prepare_hook() {
    let _ = std::panic::catch_unwind(before_fork);
}

extern "C" fn parent_hook() {
    let _ = std::panic::catch_unwind(after_fork);
}

extern "C" fn child_hook() {
    let _ = std::panic::catch_unwind(after_fork_in_child);
}

/// pthread_atfork "child": counts the fork, then releases the locks.
pub fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::AcqRel);
    after_fork();
}

/// Releases what [`before_fork`] took (pthread_atfork "parent" and
/// "child": the child's one thread is the copy of the forking one).
pub fn after_fork() {
    let held = HELD.with(|h| std::mem::take(&mut *h.borrow_mut()));
    release(held);
}

fn release(mut held: Vec<Box<dyn Any>>) {
    while let Some(g) = held.pop() {
        drop(g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static A: ForkSafeMutex<u32> = ForkSafeMutex::new(1);

    #[test]
    fn handlers_take_and_release_registered_locks() {
        *A.lock_static() += 1;
        before_fork();
        assert!(A.inner.try_lock().is_err(), "held between prepare and parent");
        after_fork();
        assert_eq!(*A.lock_static(), 2);
    }
}
