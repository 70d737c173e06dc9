//! `flock` of PyTorch's FileStore file, with a deadline: readers share the
//! lock, writers hold it alone, and the kernel drops the lock of a process
//! that dies.

use super::deadline::{expired, Backoff};
use crate::error::{Error, ErrorKind, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Shared (reading) or exclusive (writing).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Shared,
    Exclusive,
}

/// A held `flock`, released on drop.
pub struct Held<'a>(&'a File);

/// Locks `file`, giving up at `end` (`None`: waits as long as it takes).
pub fn lock<'a>(file: &'a File, mode: Mode, end: Option<Instant>, describe: &dyn Fn() -> String) -> Result<Held<'a>> {
    let op = match mode {
        Mode::Shared => libc::LOCK_SH,
        Mode::Exclusive => libc::LOCK_EX,
    };
    let mut backoff = Backoff::new(Duration::from_micros(50), Duration::from_millis(10));
    let started = Instant::now();
    loop {
        let flags = if end.is_some() { op | libc::LOCK_NB } else { op };
        // SAFETY: flock on a descriptor `file` owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), flags) } == 0 {
            return Ok(Held(file));
        }
        match crate::error::errno() {
            libc::EINTR => continue,
            libc::EWOULDBLOCK if !expired(end) => backoff.sleep(end),
            libc::EWOULDBLOCK => {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "timed out after {} ms waiting for the lock of {} (another process holds it)",
                        started.elapsed().as_millis(),
                        describe()
                    ),
                ))
            }
            errno => return Err(Error::from_errno(errno, format_args!("unable to lock {}", describe()))),
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `lock`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}
