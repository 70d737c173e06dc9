//! Unix `SOCK_SEQPACKET` sockets in Linux's abstract namespace, for the
//! descriptor exchanges of a symmetric-memory rendezvous and of a GPU
//! weights pool. An abstract name is no file: it
//! needs no writable folder, has no path-length limit beyond 107 bytes of
//! name, and vanishes with the last descriptor of its socket, so a process
//! killed with -9 leaves nothing behind.
//!
//! An abstract name has no file permissions either, and any process of the
//! network namespace may connect to it or look it up in /proc/net/unix. So
//! both ends check who is at the other end with `SO_PEERCRED` (the kernel's
//! record of the connecting process, and of the listening one), which is
//! why this is a connected socket type and not a datagram one (a datagram
//! socket has no peer credentials).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The longest abstract name (`sun_path` less its leading NUL).
pub const MAX_NAME: usize = 107;

/// The address of `name` and its length, for `bind` or `connect`: made
/// ahead, it lets a forked child connect with no allocation.
pub fn address(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("abstract socket name of {} bytes (1 to {MAX_NAME})", name.len())));
    }
    // SAFETY: sockaddr_un is plain data; all-zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path[1..].iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((addr, len as libc::socklen_t))
}

fn socket(extra_flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket takes plain integers.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | extra_flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor socket() just returned to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A non-blocking listening socket bound to `name`.
pub fn listen(name: &str) -> io::Result<OwnedFd> {
    let (addr, len) = address(name)?;
    let fd = socket(libc::SOCK_NONBLOCK)?;
    // SAFETY: addr is a valid sockaddr_un of `len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // Room for bursts (a pool opened by hundreds of consumers at once);
    // the kernel caps it at net.core.somaxconn.
    // SAFETY: listen on our own socket.
    if unsafe { libc::listen(fd.as_raw_fd(), 4096) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A non-blocking connection to the socket listening at `name`.
/// `ECONNREFUSED`: nobody listens there; `EAGAIN`: its backlog is full.
pub fn connect(name: &str) -> io::Result<OwnedFd> {
    let (addr, len) = address(name)?;
    let fd = socket(libc::SOCK_NONBLOCK)?;
    loop {
        // SAFETY: addr is a valid sockaddr_un of `len` bytes.
        if unsafe { libc::connect(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } == 0 {
            return Ok(fd);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// The next pending connection of `listener` (`WouldBlock` if none), as a
/// blocking socket.
pub fn accept(listener: RawFd) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: accept4 on a listening socket; no address wanted.
        let fd = unsafe { libc::accept4(listener, std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
        if fd >= 0 {
            // SAFETY: a descriptor accept4 just returned to us alone.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// The process at the other end of a connected socket: (pid, uid).
pub use crate::fdpass::peer::credentials as peer;

/// A name no other socket has: `symm_mem-<pid>-<16 random hex digits>`.
pub fn unique_name() -> String {
    unique_name_with("symm_mem")
}

/// A name no other socket has: `<prefix>-<pid>-<16 random hex digits>`.
/// The random part keeps two channels of one process apart, and keeps a
/// name from being taken in advance by someone who guessed the pid.
pub fn unique_name_with(prefix: &str) -> String {
    let mut r = [0u8; 8];
    let n = crate::syscalls::getrandom(&mut r);
    let random = if n == 8 {
        u64::from_ne_bytes(r)
    } else {
        // No getrandom: the clock's nanoseconds still differ between calls.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)
    };
    format!("{prefix}-{}-{random:016x}", std::process::id())
}
