//! Sockets whose hang-up is how a peer learns that this process is gone
//! (a weights pool's consumer connections and listener, a consumer's
//! connection to its producer). A child forked afterwards (a DataLoader
//! worker, say) would inherit such a socket and keep it open after this
//! process dies, hiding the death from the peer: a producer would keep a
//! dead consumer's hold, a consumer would never hear that its producer
//! is gone.
//!
//! So each such descriptor is registered here, and a fork handler points
//! every registered number at /dev/null in the child: the numbers stay
//! valid for the child's copies of the objects that own them (which the
//! owners refuse to use there), while the sockets themselves stay with
//! the parent alone.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Once;

/// Registered descriptors at once: a pool's consumers (at most
/// `cuda::pool::options::MAX_CONSUMERS` each) and a process's imports.
const CAPACITY: usize = 4096;
const EMPTY: i32 = -1;
#[allow(clippy::declare_interior_mutable_const)]
const FREE: AtomicI32 = AtomicI32::new(EMPTY);
static REGISTERED: [AtomicI32; CAPACITY] = [FREE; CAPACITY];
static FULL_WARNED: AtomicBool = AtomicBool::new(false);

/// A descriptor that a forked child does not keep (see the module docs).
/// It is closed when dropped, as an `OwnedFd` is.
pub struct ParentOnlyFd {
    fd: OwnedFd,
    slot: Option<usize>,
}

impl ParentOnlyFd {
    pub fn new(fd: OwnedFd) -> ParentOnlyFd {
        install_handler();
        let raw = fd.as_raw_fd();
        let slot = REGISTERED.iter().position(|s| s.compare_exchange(EMPTY, raw, Ordering::AcqRel, Ordering::Acquire).is_ok());
        if slot.is_none() && !FULL_WARNED.swap(true, Ordering::Relaxed) {
            crate::log::warn(&format!(
                "more than {CAPACITY} pool connections in one process: a child forked now keeps the newest ones open, \
                 so their peers may not see this process die"
            ));
        }
        ParentOnlyFd { fd, slot }
    }

    /// Whether a fork handler would detach this descriptor (false only past
    /// the registry's capacity).
    pub fn is_registered(&self) -> bool {
        self.slot.is_some()
    }
}

impl AsRawFd for ParentOnlyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for ParentOnlyFd {
    fn drop(&mut self) {
        // Unregistered before the close (when `fd` drops after this), so a
        // fork in between can never redirect a number reused by someone else.
        if let Some(slot) = self.slot {
            REGISTERED[slot].store(EMPTY, Ordering::Release);
        }
    }
}

fn install_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: pthread_atfork stores the function pointer; the handler
        // only makes async-signal-safe calls (open, dup3, close).
        unsafe { libc::pthread_atfork(None, None, Some(detach_in_child)) };
    });
}

/// pthread_atfork "child": /dev/null in place of every registered socket.
extern "C" fn detach_in_child() {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: a constant path; O_CLOEXEC so no exec'd program keeps it.
        let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if null < 0 {
            return;
        }
        for slot in &REGISTERED {
            let fd = slot.load(Ordering::Acquire);
            if fd >= 0 && fd != null {
                // SAFETY: replaces our own registered descriptor number;
                // the socket it named is released in this process only.
                unsafe { libc::dup3(null, fd, libc::O_CLOEXEC) };
            }
        }
        // SAFETY: the descriptor opened above.
        unsafe { libc::close(null) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn socket_pair() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: a valid out-array of two descriptors.
        assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) }, 0);
        // SAFETY: two fresh descriptors of ours.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    /// A forked child no longer holds the socket: once the parent closes
    /// its end too, the peer sees the hang-up while the child still lives.
    #[test]
    fn a_forked_child_does_not_keep_the_socket_open() {
        let (ours, peer) = socket_pair();
        let ours = ParentOnlyFd::new(ours);
        assert!(ours.is_registered());
        // SAFETY: the child only makes async-signal-safe calls, then _exit.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: as above; sleeps until killed.
            unsafe {
                libc::sleep(30);
                libc::_exit(0)
            };
        }
        drop(ours);
        let mut p = libc::pollfd { fd: peer.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd; waits at most 10 s (a hang guard).
        let n = unsafe { libc::poll(&mut p, 1, 10_000) };
        // SAFETY: our child.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        assert_eq!(n, 1, "the peer saw no hang-up while the child lived");
        assert_ne!(p.revents & (libc::POLLHUP | libc::POLLRDHUP), 0);
    }
}
