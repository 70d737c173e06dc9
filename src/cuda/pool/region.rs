//! A shared mapping of a descriptor, unmapped when dropped.

use crate::error::{Error, Result};
use std::os::fd::RawFd;
use std::ptr::NonNull;

pub struct Region {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: plain shared memory; who writes where is the pool protocol's
// business, and the address stays valid until drop.
unsafe impl Send for Region {}
// SAFETY: as above; &Region only hands out the address.
unsafe impl Sync for Region {}

impl Region {
    /// Maps `len` bytes of `fd` from offset 0, shared and writable.
    pub fn map(fd: RawFd, len: usize, what: &str) -> Result<Region> {
        Region::map_with(fd, len, libc::PROT_READ | libc::PROT_WRITE, what)
    }

    /// Maps `len` bytes of `fd` from offset 0, shared and read-only.
    pub fn map_read_only(fd: RawFd, len: usize, what: &str) -> Result<Region> {
        Region::map_with(fd, len, libc::PROT_READ, what)
    }

    fn map_with(fd: RawFd, len: usize, prot: libc::c_int, what: &str) -> Result<Region> {
        // SAFETY: a fresh mapping placed by the kernel; nothing else is touched.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os_error(format!("unable to mmap {len} bytes of {what}")));
        }
        Ok(Region { base: NonNull::new(p.cast()).expect("mmap returned NULL"), len })
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: base/len came from our own mmap and are unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// 64 random bits (getrandom; the clock and pid if it fails), for names
/// that others cannot guess in advance.
pub fn random_u64() -> u64 {
    let mut r = [0u8; 8];
    // Through syscall(2): glibc's wrapper is newer than the wheel's glibc.
    if crate::syscalls::getrandom(&mut r) == 8 {
        return u64::from_ne_bytes(r);
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf only reads a system value.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}
