//! The store's lock file (`.ss-lock`): each writer holds a shared flock
//! while it lives, gc an exclusive one. The file is 0600 and must be this
//! user's (another user could otherwise hold it against every writer),
//! and a writer waits for a gc's lock no longer than its lock timeout.
//!
//! A flock belongs to the open file, which a child forked meanwhile shares
//! until it execs or exits (any thread's `Command::spawn` forks). Closing
//! our descriptor would leave the lock held by such a child, so the lock
//! is released by an explicit unlock in the process that took it. A
//! forked child that inherited a writer and goes on writing takes a lock
//! of its own first, since the parent may unlock the one they share.

use super::fsio;
use crate::error::{Error, ErrorKind, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub(crate) struct StoreLock {
    file: File,
    path: PathBuf,
    op: i32,
    /// The process that took the lock on `file`.
    owner: u32,
    /// How long taking it may wait (None: not at all).
    wait: Option<Duration>,
}

impl StoreLock {
    /// A shared lock on the lock file at `path`, waiting for a gc up to
    /// `wait` (`Timeout` after it).
    pub(crate) fn shared(path: &Path, wait: Duration) -> Result<StoreLock> {
        StoreLock::take(path, libc::LOCK_SH, Some(wait))
    }

    /// An exclusive lock, or `Busy` at once while a writer holds one.
    pub(crate) fn exclusive_now(path: &Path) -> Result<StoreLock> {
        StoreLock::take(path, libc::LOCK_EX | libc::LOCK_NB, None)
    }

    fn take(path: &Path, op: i32, wait: Option<Duration>) -> Result<StoreLock> {
        let file = fsio::open_lock_file(path)?;
        match wait {
            Some(w) => {
                let end = Instant::now().checked_add(w);
                crate::lock_file::flock_until(&file, op, end, &|| format!("content store lock file {}", path.display()))?
            }
            None => flock(&file, op, path)?,
        }
        Ok(StoreLock { file, path: path.to_path_buf(), op, owner: std::process::id(), wait })
    }

    /// In a child forked from the process that took the lock: replaces
    /// the shared open file by one of this process, locked alike.
    pub(crate) fn ensure_mine(&mut self) -> Result<()> {
        if self.owner != std::process::id() {
            // The inherited descriptor closes without unlocking: the
            // parent's lock stays the parent's.
            *self = StoreLock::take(&self.path, self.op, self.wait)?;
        }
        Ok(())
    }
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        if self.owner == std::process::id() {
            // SAFETY: unlocks the open file this File owns; errors leave
            // the lock to the close that follows.
            unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

/// flock(2) on `f`; EINTR retried.
fn flock(f: &File, op: i32, path: &Path) -> Result<()> {
    loop {
        // SAFETY: flock on a descriptor this File owns.
        if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let errno = crate::error::errno();
        if errno == libc::EINTR {
            continue;
        }
        if errno == libc::EWOULDBLOCK {
            return Err(Error::new(ErrorKind::Busy, format!("{} is locked: a writer has the store open", path.display())));
        }
        return Err(Error::from_errno(errno, format!("unable to lock {}", path.display())));
    }
}
