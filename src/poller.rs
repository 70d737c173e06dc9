//! The few epoll and eventfd calls the daemons' event loops need (the
//! TCPStore server's and the shared-memory manager's), as safe functions.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

pub const READABLE: u32 = libc::EPOLLIN as u32;
pub const WRITABLE: u32 = libc::EPOLLOUT as u32;

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// An epoll instance; each registered descriptor carries a `u64` token.
pub struct Poller {
    fd: OwnedFd,
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        // SAFETY: no pointers; the descriptor returned is owned here.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(Poller { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` lives across the call; the kernel copies it.
        check(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) }).map(drop)
    }

    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    /// Waits for events (`None`: no time limit) and fills `out`.
    pub fn wait(&self, out: &mut Vec<libc::epoll_event>, timeout: Option<Duration>) -> io::Result<()> {
        let ms = timeout.map_or(-1, |t| t.as_millis().clamp(1, i32::MAX as u128) as libc::c_int);
        out.clear();
        // SAFETY: the kernel writes at most `capacity` events into the
        // vector's buffer; the length is set to what it reports.
        let n = unsafe { libc::epoll_wait(self.fd.as_raw_fd(), out.as_mut_ptr(), out.capacity() as libc::c_int, ms) };
        match check(n) {
            Ok(n) => {
                // SAFETY: the first `n` entries were written by the kernel.
                unsafe { out.set_len(n as usize) };
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// An eventfd: one thread rings it, the event loop sees it readable.
pub struct Bell {
    fd: OwnedFd,
}

impl Bell {
    pub fn new() -> io::Result<Bell> {
        // SAFETY: no pointers; the descriptor returned is owned here.
        let fd = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(Bell { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of `one`. A full counter cannot
        // happen here (it would take 2^64 - 2 rings).
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
