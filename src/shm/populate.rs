//! Reserving the pages of a new segment up front, so that a full file system
//! is reported as `NoSpace` when the segment is created, never as a SIGBUS at
//! the first write (PyTorch's defect). Large ranges are populated by several
//! threads at once, since tmpfs first-touch faults dominate their cost.

use crate::error::{errno, Error, ErrorKind, Result};
use std::os::fd::RawFd;

/// Ranges at least this large are split between threads.
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;
/// Each thread populates then copies this much at a time, so the copied
/// destination is still in the TLB and cache when it is written.
const CHUNK_BYTES: usize = 2 << 20;

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// How many threads a range of `len` bytes deserves.
fn threads_for(len: usize) -> usize {
    if len < PARALLEL_MIN_BYTES {
        return 1;
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    cores.clamp(1, 4).min(len / (PARALLEL_MIN_BYTES / 2)).max(1)
}

/// Allocates the pages backing `[offset, offset + len)` of the file `fd`,
/// which is mapped shared and writable at `base`. `shm` selects the method:
/// for tmpfs, populate the mapping (allocates and maps in one pass); for a
/// regular file, fallocate (allocates blocks without dirtying pages).
pub fn reserve(fd: RawFd, base: *mut u8, offset: usize, len: usize, shm: bool, what: &str) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if shm {
        match populate_write_parallel(base, offset, len) {
            Err(e) if e.kind() == ErrorKind::Unsupported => fallocate(fd, offset, len),
            other => other,
        }
    } else {
        match fallocate(fd, offset, len) {
            Err(e) if e.kind() == ErrorKind::Unsupported => populate_write_parallel(base, offset, len),
            other => other,
        }
    }
    .map_err(|e| e.context(format!("unable to reserve {len} bytes for <{what}>")))
}

fn fallocate(fd: RawFd, offset: usize, len: usize) -> Result<()> {
    // SAFETY: posix_fallocate only acts on the descriptor; it returns the error.
    let rc = unsafe { libc::posix_fallocate(fd, offset as libc::off_t, len as libc::off_t) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => Err(Error::new(ErrorKind::Unsupported, "fallocate not supported")),
        e => Err(no_space_or(e, "posix_fallocate")),
    }
}

fn no_space_or(e: i32, call: &str) -> Error {
    match e {
        // Populating a shared mapping reports EFAULT where a plain write
        // would have raised SIGBUS: on tmpfs that means the file system is full.
        libc::EFAULT | libc::ENOSPC | libc::ENOMEM => {
            Error::new(ErrorKind::NoSpace, format!("{call}: no space left on the file system behind the segment"))
        }
        e => Error::from_errno(e, call),
    }
}

/// MADV_POPULATE_WRITE over a page-aligned cover of the range.
fn populate_write(base: *mut u8, offset: usize, len: usize) -> Result<()> {
    let page = page_size();
    let start = offset / page * page;
    let end = offset + len;
    // SAFETY: the caller maps [0, end) at base; madvise only faults pages
    // of that mapping in and reads or writes no memory of ours.
    let rc = unsafe { libc::madvise(base.add(start).cast(), end - start, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    match errno() {
        libc::EINVAL => Err(Error::new(ErrorKind::Unsupported, "MADV_POPULATE_WRITE not supported by this kernel")),
        e => Err(no_space_or(e, "madvise(MADV_POPULATE_WRITE)")),
    }
}

fn populate_write_parallel(base: *mut u8, offset: usize, len: usize) -> Result<()> {
    let parts = split(offset, len, threads_for(len));
    if parts.len() == 1 {
        return populate_write(base, offset, len);
    }
    let base = SendPtr(base);
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .iter()
            .map(|&(o, l)| {
                let base = base;
                s.spawn(move || populate_write(base.get(), o, l))
            })
            .collect();
        join_all(handles)
    })
}

/// Copies `src` into `dst` (a fresh shared mapping of at least `src.len()`
/// bytes), populating the destination pages first, chunk by chunk, on
/// several threads for large sizes. Fails with `NoSpace` instead of SIGBUS,
/// and with `Unsupported` (before copying anything) on a kernel without
/// MADV_POPULATE_WRITE: the caller then reserves with [`reserve`] and copies.
pub fn populate_and_copy(dst: *mut u8, src: &[u8]) -> Result<()> {
    let parts = split(0, src.len(), threads_for(src.len()));
    let dst = SendPtr(dst);
    if parts.len() == 1 {
        return populate_and_copy_range(dst.get(), src, 0, src.len());
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .iter()
            .map(|&(o, l)| {
                let dst = dst;
                s.spawn(move || populate_and_copy_range(dst.get(), src, o, l))
            })
            .collect();
        join_all(handles)
    })
}

fn populate_and_copy_range(dst: *mut u8, src: &[u8], offset: usize, len: usize) -> Result<()> {
    let mut done = 0;
    while done < len {
        let n = CHUNK_BYTES.min(len - done);
        let at = offset + done;
        populate_write(dst, at, n)?;
        // SAFETY: dst maps at least src.len() bytes, [at, at+n) lies inside
        // both, and the source is caller memory that cannot overlap a
        // mapping we just created.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), dst.add(at), n) };
        done += n;
    }
    Ok(())
}

/// Splits `[offset, offset+len)` into up to `n` page-aligned parts.
fn split(offset: usize, len: usize, n: usize) -> Vec<(usize, usize)> {
    let page = page_size();
    let per = (len / n).div_ceil(page) * page;
    let mut parts = Vec::with_capacity(n);
    let mut at = offset;
    let end = offset + len;
    while at < end {
        let l = per.max(page).min(end - at);
        parts.push((at, l));
        at += l;
    }
    parts
}

fn join_all(handles: Vec<std::thread::ScopedJoinHandle<'_, Result<()>>>) -> Result<()> {
    let mut first = Ok(());
    for h in handles {
        let r = h.join().unwrap_or_else(|_| Err(Error::new(ErrorKind::Panic, "a populating thread panicked")));
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// A raw pointer that may cross into scoped threads; each thread touches a
/// disjoint range of the mapping it points to.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the threads write disjoint ranges and the scope outlives them.
unsafe impl Send for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut u8 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_range_page_aligned() {
        let parts = split(0, 10 << 20, 2);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], (0, 5 << 20));
        assert_eq!(parts[1], (5 << 20, 5 << 20));
        let odd = split(4096, 3 * 4096 + 5, 2);
        assert_eq!(odd.iter().map(|p| p.1).sum::<usize>(), 3 * 4096 + 5);
        assert_eq!(odd[0].0, 4096);
        assert!(odd.iter().all(|p| p.0 % 4096 == 0));
    }
}
