//! One inotify watch of a store's folder, shared by every wait on the
//! store. However many threads wait, the store holds one inotify instance
//! (the per-user limit, 128 by default, is shared with every program of
//! the user), and none once the waits are over.
//!
//! One waiter at a time reads the watch. When it sees events it bumps a
//! generation number and wakes the others, so no waiter misses an event
//! another one consumed. Closing an inotify descriptor waits for a kernel
//! grace period (16–24 ms measured), so the last waiter does not close it
//! itself: a background thread does, once the watch has been idle for
//! `LINGER`. A burst of waits thus reuses one watch.

use super::dir_watch::DirWatch;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long an idle watch stays open for the next wait.
const LINGER: Duration = Duration::from_millis(20);

/// The watch of one folder and the waits using it.
pub struct SharedWatch {
    dir: PathBuf,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    watch: Option<Arc<DirWatch>>,
    /// Waits holding the watch now.
    users: usize,
    /// Bumped each time a reader saw events.
    generation: u64,
    /// Whether a waiter is reading the watch now.
    reading: bool,
    /// When the last user left.
    idle_since: Instant,
    /// Whether a background thread closes the watch once it is idle.
    closer: bool,
    /// The process this state belongs to: a forked child has none of the
    /// parent's threads, so it starts counting afresh.
    pid: u32,
}

impl SharedWatch {
    /// No watch yet: the first wait makes one.
    pub fn new(dir: PathBuf) -> Arc<SharedWatch> {
        let state = State {
            watch: None,
            users: 0,
            generation: 0,
            reading: false,
            idle_since: Instant::now(),
            closer: false,
            pid: std::process::id(),
        };
        Arc::new(SharedWatch { dir, state: Mutex::new(state), changed: Condvar::new() })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the waits on the folder; `None` where inotify cannot be used
    /// (no instance or descriptor left): the caller polls.
    pub fn join(self: &Arc<Self>) -> Option<Waiter> {
        let mut st = self.lock();
        if st.pid != std::process::id() {
            st.pid = std::process::id();
            st.users = 0;
            st.reading = false;
            st.closer = false;
        }
        if st.watch.is_none() {
            st.watch = Some(Arc::new(DirWatch::new(&self.dir)?));
            if !st.closer {
                st.closer = self.spawn_closer();
            }
        }
        st.users += 1;
        Some(Waiter { shared: self.clone() })
    }

    /// Starts the thread that closes the watch once idle; false when no
    /// thread can be started (the last waiter then closes it).
    fn spawn_closer(self: &Arc<Self>) -> bool {
        let me = self.clone();
        std::thread::Builder::new().name("ss-store-watch".into()).stack_size(64 << 10).spawn(move || me.close_when_idle()).is_ok()
    }

    fn close_when_idle(&self) {
        loop {
            std::thread::sleep(LINGER);
            let mut st = self.lock();
            if st.users == 0 && st.idle_since.elapsed() >= LINGER {
                let watch = st.watch.take();
                st.closer = false;
                drop(st);
                // Slow (the kernel's grace period), hence off every waiter's path.
                drop(watch);
                return;
            }
        }
    }

    fn leave(&self) {
        let mut st = self.lock();
        st.users = st.users.saturating_sub(1);
        if st.users == 0 {
            st.idle_since = Instant::now();
            if !st.closer {
                let watch = st.watch.take();
                drop(st);
                drop(watch);
            }
        }
    }
}

/// One wait's hold on the shared watch; dropping it leaves.
pub struct Waiter {
    shared: Arc<SharedWatch>,
}

impl Waiter {
    /// The generation to pass to [`Waiter::wait_past`]: take it before
    /// checking the keys, so an event after the check is never missed.
    pub fn generation(&self) -> u64 {
        self.shared.lock().generation
    }

    /// Sleeps until the watch saw events after generation `seen`, or
    /// `limit` passed. Spurious wakes happen; the caller checks again.
    pub fn wait_past(&self, seen: u64, limit: Duration) {
        let end = Instant::now() + limit;
        let shared = &self.shared;
        let mut st = shared.lock();
        loop {
            if st.generation != seen {
                return;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            if !st.reading {
                let Some(watch) = st.watch.clone() else { return };
                st.reading = true;
                drop(st);
                let saw = watch.wait(left);
                let mut st = shared.lock();
                st.reading = false;
                if saw {
                    st.generation += 1;
                }
                drop(st);
                // Wakes the others: to look again, or to take over reading.
                shared.changed.notify_all();
                return;
            }
            st = shared.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.shared.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_waiter_wakes_on_one_rename_and_the_watch_closes_after() {
        let dir = std::env::temp_dir().join(format!("ss-sharedwatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shared = SharedWatch::new(dir.clone());
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let w = shared.join().unwrap();
                let seen = w.generation();
                std::thread::spawn(move || {
                    // Each waits past its generation: the rename wakes all of them.
                    while w.generation() == seen {
                        w.wait_past(seen, Duration::from_secs(60));
                    }
                })
            })
            .collect();
        std::fs::write(dir.join(".tmp"), b"x").unwrap();
        std::fs::rename(dir.join(".tmp"), dir.join("k.x")).unwrap();
        for t in waiters {
            t.join().unwrap();
        }
        let closed = (0..1000).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            shared.lock().watch.is_none()
        });
        assert!(closed, "the idle watch was never closed");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
