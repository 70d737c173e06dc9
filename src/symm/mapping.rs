//! A shared, writable mapping of a descriptor, unmapped when dropped
//! (unless the process is finalizing, see [`super::registry`]).

use super::registry::is_finalizing;
use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; the owner decides who writes
// where (peers synchronise through the signal pad), and the pointer stays
// valid until drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; &Mapping only hands out the address.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from offset 0, shared and writable.
    pub fn map(fd: BorrowedFd<'_>, len: usize, what: &str) -> Result<Mapping> {
        // SAFETY: a fresh mapping chosen by the kernel; nothing else is touched.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os_error(format!("unable to mmap {len} bytes of {what}")));
        }
        Ok(Mapping { base: NonNull::new(p.cast()).expect("mmap returned NULL"), len })
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if is_finalizing() {
            return;
        }
        // SAFETY: base/len came from our own mmap and are unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
