//! Putting real pages behind a new segment when it is created, so that a
//! full file system is reported as `NoSpace` right there, never as a SIGBUS
//! at the first write through the mapping (PyTorch's defect).
//!
//! Measured on tmpfs (benches/share_memory.rs): filling a new object with
//! pwrite(2) allocates each page and copies into it in one pass, with no
//! zeroing and no page faults, and beats every mmap-side way of populating
//! (page faults, MAP_POPULATE, MADV_POPULATE_WRITE, fallocate + copy), also
//! when those run on two threads.

use crate::error::{errno, Error, ErrorKind, Result};
use std::os::fd::RawFd;

/// Smallest reservation whose pages `reserve` enters in the mapping.
const MAP_PAGES_FROM: usize = 64 << 10;

/// Allocates the blocks or pages of `[offset, offset + len)` of `fd`
/// (mapped shared and writable at `base`): posix_fallocate, or on a file
/// system without it, MADV_POPULATE_WRITE over the mapping.
///
/// With `map_pages` (memory-backed objects only: on a disk file it would
/// dirty every page), the reserved pages are also entered in the mapping
/// at once, so the first writes through it do not fault one page at a
/// time: measured on tmpfs, fallocate + MADV_POPULATE_WRITE before filling
/// 1 MiB or 256 MiB beats fallocate and then faulting each page by about
/// a quarter, and beats not reserving at all. Below 64 KiB the populate
/// call alone reserves (no posix_fallocate), where the kernel has it.
pub fn reserve(fd: RawFd, base: *mut u8, offset: usize, len: usize, map_pages: bool, what: &str) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // A small memory-backed segment: MADV_POPULATE_WRITE alone allocates
    // the pages (a full tmpfs fails it) and maps them, one call instead of
    // posix_fallocate plus a page fault per page at the first writes.
    if map_pages && !base.is_null() && len < MAP_PAGES_FROM {
        match populate_write(base, offset, len) {
            Err(e) if e.kind() == ErrorKind::Unsupported => {}
            result => return result.map_err(|e| e.context(format!("unable to reserve {len} bytes for <{what}>"))),
        }
    }
    // SAFETY: posix_fallocate acts only on the descriptor and returns the error.
    let rc = unsafe { libc::posix_fallocate(fd, offset as libc::off_t, len as libc::off_t) };
    let result = match rc {
        0 => {
            if map_pages && !base.is_null() && len >= MAP_PAGES_FROM {
                // Only a speed-up: the pages are reserved already, so a
                // failure here (a kernel without it) changes nothing.
                let _ = populate_write(base, offset, len);
            }
            Ok(())
        }
        libc::EOPNOTSUPP | libc::EINVAL => populate_write(base, offset, len),
        e => Err(space_error(e, "posix_fallocate")),
    };
    result.map_err(|e| e.context(format!("unable to reserve {len} bytes for <{what}>")))
}

/// Writes all of `src` at offset `at` of `fd` (a new object), so every
/// page the bytes touch exists and holds them.
pub fn write_all(fd: RawFd, at: usize, src: &[u8], what: &str) -> Result<()> {
    let mut done = 0;
    while done < src.len() {
        // SAFETY: the source range is inside `src`; pwrite only reads it.
        let n = unsafe { libc::pwrite(fd, src.as_ptr().add(done).cast(), src.len() - done, (at + done) as libc::off_t) };
        if n < 0 {
            let e = errno();
            if e == libc::EINTR {
                continue;
            }
            // pwrite reads the source: EFAULT here is the caller's buffer,
            // not a full file system.
            let err = if e == libc::EFAULT {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("the source buffer is not readable (pwrite: EFAULT at byte {done} of {})", src.len()),
                )
            } else {
                space_error(e, "pwrite")
            };
            return Err(err.context(format!("unable to copy {} bytes into <{what}>", src.len())));
        }
        done += n as usize;
    }
    Ok(())
}

fn space_error(e: i32, call: &str) -> Error {
    match e {
        // Populating a shared mapping reports EFAULT where a plain write
        // would have raised SIGBUS: the file system is full.
        libc::EFAULT | libc::ENOSPC | libc::ENOMEM => {
            Error::new(ErrorKind::NoSpace, format!("{call}: no space left on the file system behind the segment"))
        }
        e => Error::from_errno(e, call),
    }
}

/// MADV_POPULATE_WRITE over a page-aligned cover of the range.
fn populate_write(base: *mut u8, offset: usize, len: usize) -> Result<()> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let start = offset / page * page;
    // SAFETY: the caller maps [0, offset + len) at base; madvise only
    // faults pages of that mapping in.
    let rc = unsafe { libc::madvise(base.add(start).cast(), offset + len - start, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    match errno() {
        libc::EINVAL => Err(Error::new(
            ErrorKind::Unsupported,
            "neither posix_fallocate nor MADV_POPULATE_WRITE is supported here: pages cannot be reserved",
        )),
        e => Err(space_error(e, "madvise(MADV_POPULATE_WRITE)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_all_fills_a_memfd_and_reserve_grows_it() {
        let fd = crate::syscalls::memfd_create(c"ss-reserve-test", libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        write_all(fd, 0, &src, "memfd").unwrap();
        let mut back = vec![0u8; src.len()];
        // SAFETY: reading into our buffer.
        assert_eq!(unsafe { libc::pread(fd, back.as_mut_ptr().cast(), back.len(), 0) }, 10_000);
        assert_eq!(back, src);
        reserve(fd, std::ptr::null_mut(), 10_000, 90_000, false, "memfd").unwrap();
        // SAFETY: plain data filled by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd open, st valid.
        unsafe { libc::fstat(fd, &mut st) };
        assert_eq!(st.st_size, 100_000);
        assert!(st.st_blocks * 512 >= 100_000, "pages were allocated");
        // SAFETY: our descriptor.
        unsafe { libc::close(fd) };
    }
}
