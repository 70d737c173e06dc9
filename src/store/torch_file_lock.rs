//! `flock` of PyTorch's FileStore file, with a deadline: readers share the
//! lock, writers hold it alone, and the kernel drops the lock of a process
//! that dies.

use crate::error::Result;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Instant;

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
    crate::lock_file::flock_until(file, op, end, describe)?;
    Ok(Held(file))
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `lock`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}
