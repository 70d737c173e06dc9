//! Sharing by file descriptor (ATen's `_share_fd_cpu_`, `_new_shared_fd_cpu`,
//! `_new_using_fd_cpu`, `_get_shared_fd`).

use super::object::{Allocation, Storage};
use crate::error::{Error, ErrorKind, Result};
use crate::shm::{flags, new_shm_fd_storage, share_memory, MapAllocator};
use std::os::fd::RawFd;

impl Storage {
    /// Moves the bytes into an fd-backed segment if they are not in one
    /// yet (a copy, then the storage points at the segment) and returns
    /// `(fd, nbytes)`. The fd belongs to the storage: the caller sends or
    /// dups it and must not close it.
    pub fn share_fd(&self) -> Result<(RawFd, usize)> {
        {
            let s = self.read();
            match &s.alloc {
                Allocation::Fd(m) => return Ok((m.fd(), s.nbytes)),
                Allocation::Arena(b) => {
                    // A block that owns its whole memfd segment from offset
                    // 0 is already what PyTorch maps by fd: no copy.
                    if let Some(fd) = b.arena().whole_segment_fd(b.ptr()) {
                        return Ok((fd, s.nbytes));
                    }
                }
                _ => {}
            }
        }
        let mut s = self.write();
        if let Allocation::Fd(m) = &s.alloc {
            return Ok((m.fd(), s.nbytes));
        }
        if s.nbytes == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "cannot share a storage of 0 bytes: send an empty storage instead"));
        }
        // SAFETY: the allocation holds nbytes bytes while we hold the lock.
        let bytes = unsafe { std::slice::from_raw_parts(s.alloc.data(), s.nbytes) };
        let map = share_memory(bytes)?;
        let fd = map.fd();
        let nbytes = s.nbytes;
        let old = Storage::swap_in(&mut s, Allocation::Fd(map));
        drop(s);
        drop(old);
        Ok((fd, nbytes))
    }

    /// Maps a segment received as `fd` (which the caller keeps: it is
    /// duplicated) with flags 58 (SHAREDMEM | NOCREATE | KEEPFD | FROMFD).
    pub fn new_shared_fd(fd: RawFd, nbytes: usize) -> Result<Storage> {
        if fd < 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("invalid file descriptor {fd}")));
        }
        // SAFETY: fcntl only duplicates the descriptor number given.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(Error::last_os_error(format!("could not duplicate a shared memory file descriptor ({fd})")));
        }
        match MapAllocator::open_fd("", dup, flags::OPEN_SHARED_FD, nbytes) {
            Ok(map) => Ok(Storage::from_allocation(Allocation::Fd(map), nbytes, false)),
            Err(e) => {
                // SAFETY: the failed open left `dup` with us.
                unsafe { libc::close(dup) };
                Err(e.context(format!("mapping shared fd {fd}")))
            }
        }
    }

    /// A new fd-backed storage of `nbytes` zero bytes (flags 86).
    pub fn new_using_fd(nbytes: usize) -> Result<Storage> {
        let map = new_shm_fd_storage(nbytes)?;
        Ok(Storage::from_allocation(Allocation::Fd(map), nbytes, false))
    }

    /// The descriptor of an fd-backed storage (owned by the storage).
    pub fn get_shared_fd(&self) -> Result<RawFd> {
        match &self.read().alloc {
            Allocation::Fd(m) if m.fd() >= 0 => Ok(m.fd()),
            Allocation::Arena(b) if b.arena().whole_segment_fd(b.ptr()).is_some() => {
                Ok(b.arena().whole_segment_fd(b.ptr()).expect("checked"))
            }
            _ => Err(Error::new(ErrorKind::NotFound, "couldn't retrieve a shared file descriptor: the storage is not fd-backed")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A received descriptor cannot be sealed when PyTorch made it (a
    /// /dev/shm file, not a memfd), so only its size is checked: one
    /// smaller than the mapping is refused before anything is mapped.
    #[test]
    fn a_descriptor_smaller_than_the_storage_is_refused() {
        let small = Storage::new_using_fd(4096).unwrap();
        let fd = small.get_shared_fd().unwrap();
        let e = Storage::new_shared_fd(fd, 8192).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{e}");
        assert_eq!(Storage::new_shared_fd(fd, 4096).unwrap().nbytes(), 4096);
        // The caller's descriptor stays open either way.
        // SAFETY: F_GETFD only reads the descriptor's flags.
        assert!(unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0);
    }
}
