//! What the content store shares between threads, made to survive fork().
//!
//! A child made by fork() has only the thread that forked. A lock that
//! another thread held at that moment stays held in the child for ever,
//! and work handed to a thread pool's threads never runs there: neither
//! may make a child that writes or reads a store wait.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, TryLockError};

/// A mutex around state that is only a cache (what a writer has stored,
/// what a reader has mapped): in the process that made it, it is locked
/// as usual; in a forked child it is only tried, since a parent thread
/// may have held it at the fork, and the caller goes without the cache.
pub struct CacheLock<T> {
    inner: Mutex<T>,
    owner: u32,
}

impl<T> CacheLock<T> {
    pub fn new(value: T) -> Self {
        CacheLock { inner: Mutex::new(value), owner: std::process::id() }
    }

    /// The guard, or `None` in a forked child while the lock is taken.
    /// Poisoning is ignored: a cache is whole between statements.
    pub fn lock(&self) -> Option<MutexGuard<'_, T>> {
        if std::process::id() == self.owner {
            return Some(self.inner.lock().unwrap_or_else(|p| p.into_inner()));
        }
        match self.inner.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

/// The process that builds (or built) the hashing pool; 0 before any.
static POOL_OWNER: AtomicU32 = AtomicU32::new(0);
static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

/// The content store's own hashing pool, in the process that built it;
/// `None` in a process forked from it, where the pool's threads do not
/// exist (the caller hashes on its own thread). Ours, not rayon's global
/// pool, so that we know which process its threads live in. Nothing here
/// waits on the parent: a child forked while the parent was building the
/// pool never looks at it.
pub fn hash_pool() -> Option<&'static rayon::ThreadPool> {
    let me = std::process::id();
    match POOL_OWNER.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {}
        Err(owner) if owner == me => {}
        Err(_) => return None,
    }
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().thread_name(|i| format!("ss-hash-{i}")).build().ok()).as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A child forked while another thread holds the lock goes without
    /// it instead of waiting for a thread it does not have.
    #[test]
    fn a_forked_child_never_waits_for_a_lock_held_at_the_fork() {
        let lock = std::sync::Arc::new(CacheLock::new(0u32));
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let _g = lock.lock().unwrap();
                held_tx.send(()).unwrap();
                let _ = release_rx.recv();
            })
        };
        held_rx.recv().unwrap();
        assert!(hash_pool().is_some(), "the pool builds in the parent");
        // SAFETY: the child only tries the lock and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let got = lock.lock().is_some() || hash_pool().is_some();
            // SAFETY: leaves the child without running the parent's atexit work.
            unsafe { libc::_exit(if got { 1 } else { 0 }) }
        }
        let start = Instant::now();
        let mut status = 0;
        let code = loop {
            // SAFETY: waitpid on our own child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                break libc::WEXITSTATUS(status);
            }
            if start.elapsed() > Duration::from_secs(30) {
                // SAFETY: our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                break -1;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(code, 0, "the child hung (-1) or took a lock or pool it does not own (1)");
        assert_eq!(*lock.lock().unwrap(), 0);
    }
}
