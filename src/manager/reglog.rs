//! The registration log: a small sealed memfd that one client process
//! shares with our manager (passed once, at connect), into which the client
//! appends the same 68-byte records it would send on the socket. Appending
//! is a copy and a release store: no system call, no wake-up of the
//! manager. The manager reads the records it has not seen before it decides
//! anything (every turn of its loop, before a socket message of that client,
//! and when that client's connection closes), so a record in the log counts
//! exactly as one received on the socket, also for a client killed right
//! after writing it.
//!
//! Layout: a 64-byte header (`written` records, a u64 only the client
//! stores; `consumed` records, a u64 only the manager stores; the capacity,
//! a u32), then a ring of `CAPACITY` records. The client writes only while
//! `written - consumed < CAPACITY`; when full it asks the manager over the
//! socket to read the log ([`DRAIN_FLAG`]) and waits for the `OK`, so the
//! order of records is the order in which they were written.

use super::protocol::ALLOC_INFO_SIZE;
use crate::error::{Error, ErrorKind, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Records the ring holds; header plus ring make 16 KiB.
pub const CAPACITY: u64 = 240;
const HEADER: usize = 64;
/// Bytes of a log.
pub const LOG_SIZE: usize = HEADER + CAPACITY as usize * ALLOC_INFO_SIZE;
const WRITTEN_AT: usize = 0;
const CONSUMED_AT: usize = 8;
const CAPACITY_AT: usize = 16;

/// The name of the registration that carries the log's descriptor. A
/// libshm manager (PyTorch's) takes it as an ordinary registration and
/// answers `OK`; ours answers [`LOG_REPLY`].
pub const ATTACH_NAME: &str = "/ss_manager_registration_log";
/// Our manager's answer when it took the log.
pub const LOG_REPLY: &[u8; 2] = b"LG";
/// Free-byte value of a record asking the manager to read the log now; it
/// answers `OK` once it has. Only sent by a client whose log was taken
/// (elsewhere, any non-zero free byte means a free, as in libshm).
pub const DRAIN_FLAG: u8 = b'D';

/// A mapped log, on either side.
#[derive(Debug)]
pub struct RegLog {
    base: *mut u8,
}

// SAFETY: the mapping is shared memory accessed through atomics for the
// counters and plain copies of records whose ownership the counters hand
// over; the owner serializes its own accesses (client: the connection lock;
// manager: single-threaded).
unsafe impl Send for RegLog {}
// SAFETY: as above.
unsafe impl Sync for RegLog {}

impl RegLog {
    /// A new log for this process: the mapping and the descriptor to send.
    pub fn create() -> Result<(Self, OwnedFd)> {
        let raw = crate::syscalls::memfd_create(c"ss-registration-log", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        if raw < 0 {
            return Err(Error::last_os_error("could not create the registration log (memfd_create)"));
        }
        // SAFETY: a descriptor we just created and own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain calls on our descriptor.
        if unsafe { libc::ftruncate(raw, LOG_SIZE as libc::off_t) } != 0 {
            return Err(Error::last_os_error("could not size the registration log"));
        }
        // The manager maps it: it must never shrink under it.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::last_os_error("could not seal the registration log"));
        }
        let log = Self::map(raw)?;
        log.capacity_word().store(CAPACITY as u32, Ordering::Relaxed);
        Ok((log, fd))
    }

    /// The manager's side: maps a log a client sent, after checking that
    /// it is one (sealed against shrinking, of the right size).
    pub fn adopt(fd: &OwnedFd) -> Result<Self> {
        let raw = fd.as_raw_fd();
        // SAFETY: fcntl and fstat on a descriptor we own.
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::new(ErrorKind::Protocol, "the registration log sent is not a memfd sealed against shrinking"));
        }
        // SAFETY: plain data filled by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(raw, &mut st) } != 0 || st.st_size as usize != LOG_SIZE {
            return Err(Error::new(ErrorKind::Protocol, format!("the registration log sent is not {LOG_SIZE} bytes")));
        }
        let log = Self::map(raw)?;
        if u64::from(log.capacity_word().load(Ordering::Relaxed)) != CAPACITY {
            return Err(Error::new(ErrorKind::Protocol, "the registration log sent has another capacity"));
        }
        Ok(log)
    }

    fn map(fd: RawFd) -> Result<Self> {
        // SAFETY: a fresh shared mapping of the whole (sealed) file.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), LOG_SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os_error("could not map the registration log"));
        }
        Ok(RegLog { base: p.cast() })
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is an 8-aligned offset inside the page-aligned header.
        unsafe { &*self.base.add(at).cast::<AtomicU64>() }
    }

    fn capacity_word(&self) -> &AtomicU32 {
        // SAFETY: as above, 4-aligned.
        unsafe { &*self.base.add(CAPACITY_AT).cast::<AtomicU32>() }
    }

    fn slot(&self, index: u64) -> *mut u8 {
        // SAFETY: the slot is inside the ring.
        unsafe { self.base.add(HEADER + (index % CAPACITY) as usize * ALLOC_INFO_SIZE) }
    }

    /// Client: appends `rec` unless the ring is full (then false).
    pub fn append(&self, rec: &[u8; ALLOC_INFO_SIZE]) -> bool {
        let written = self.word(WRITTEN_AT).load(Ordering::Relaxed);
        let consumed = self.word(CONSUMED_AT).load(Ordering::Acquire);
        if written.wrapping_sub(consumed) >= CAPACITY {
            return false;
        }
        // SAFETY: the slot is free (the manager consumed it) and inside the ring.
        unsafe { std::ptr::copy_nonoverlapping(rec.as_ptr(), self.slot(written), ALLOC_INFO_SIZE) };
        self.word(WRITTEN_AT).store(written + 1, Ordering::Release);
        true
    }

    /// Manager: copies out every record written since the last call and
    /// marks them consumed. A count that cannot be right (the client broke
    /// the log) is a protocol error.
    pub fn take_new(&self, out: &mut Vec<[u8; ALLOC_INFO_SIZE]>) -> Result<()> {
        let written = self.word(WRITTEN_AT).load(Ordering::Acquire);
        let consumed = self.word(CONSUMED_AT).load(Ordering::Relaxed);
        let pending = written.wrapping_sub(consumed);
        if pending > CAPACITY {
            return Err(Error::new(ErrorKind::Protocol, format!("registration log claims {pending} unread records, it holds {CAPACITY}")));
        }
        for i in consumed..written {
            let mut rec = [0u8; ALLOC_INFO_SIZE];
            // SAFETY: the slot was published by the release store of `written`.
            unsafe { std::ptr::copy_nonoverlapping(self.slot(i), rec.as_mut_ptr(), ALLOC_INFO_SIZE) };
            out.push(rec);
        }
        self.word(CONSUMED_AT).store(written, Ordering::Release);
        Ok(())
    }
}

impl Drop for RegLog {
    fn drop(&mut self) {
        // SAFETY: our mapping (in a forked child, munmap of it is harmless too).
        unsafe { libc::munmap(self.base.cast(), LOG_SIZE) };
    }
}

/// Reads what a stream socket has (non-blocking), keeping any descriptors
/// that came with it. `Ok((0, _))` is end of file.
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    let mut control = [0u64; 16];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; the pointers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: as above.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: recvmsg has just filled `msg`; `control` is still alive.
    unsafe { crate::fdpass::take_passed_fds(&msg, fds) };
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_go_through_in_order_and_a_full_ring_refuses() {
        let (client, fd) = RegLog::create().unwrap();
        let manager = RegLog::adopt(&fd).unwrap();
        let mut got = Vec::new();
        for round in 0..3u8 {
            let mut n = 0u64;
            while client.append(&[round.wrapping_add(n as u8); ALLOC_INFO_SIZE]) {
                n += 1;
            }
            assert_eq!(n, CAPACITY, "a full ring holds exactly its capacity");
            got.clear();
            manager.take_new(&mut got).unwrap();
            assert_eq!(got.len() as u64, CAPACITY);
            assert!(got.iter().enumerate().all(|(i, r)| r[0] == round.wrapping_add(i as u8)));
        }
        got.clear();
        manager.take_new(&mut got).unwrap();
        assert!(got.is_empty());
    }

    #[test]
    fn an_unsealed_or_wrong_sized_file_is_refused() {
        // SAFETY: a fresh anonymous file of our own.
        let fd = unsafe { OwnedFd::from_raw_fd(crate::syscalls::memfd_create(c"not-a-log", libc::MFD_CLOEXEC)) };
        // SAFETY: sizing our own file.
        unsafe { libc::ftruncate(fd.as_raw_fd(), LOG_SIZE as libc::off_t) };
        assert_eq!(RegLog::adopt(&fd).unwrap_err().kind(), ErrorKind::Protocol);
    }
}
