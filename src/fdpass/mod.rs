//! Sending and receiving file descriptors with a payload over a Unix
//! socket (SCM_RIGHTS). Unlike CPython's reduction (which PyTorch uses), a
//! receiver at its open-file limit gets a `TooManyFiles` error instead of a
//! message whose descriptors the kernel silently dropped. [`peer`] tells
//! who is at the other end of a socket, [`seals`] whether a received
//! descriptor is safe to map, [`parent_only`] keeps sockets whose hang-up
//! means "this process is gone" out of forked children.

pub mod abstract_socket;
pub mod parent_only;
pub mod peer;
pub mod seals;

use crate::error::{errno, Error, ErrorKind, Result};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message may carry (the kernel's SCM_MAX_FD).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

fn cmsg_space(nfds: usize) -> usize {
    // SAFETY: CMSG_SPACE is pure arithmetic.
    unsafe { libc::CMSG_SPACE((nfds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends `payload` (at least one byte: a stream socket carries descriptors
/// only with data) and `fds` over the connected Unix socket `sock`. The
/// descriptors stay open here. Returns the payload bytes sent (all of them
/// for a datagram socket; a stream socket may take fewer, the descriptors
/// go with the first byte).
pub fn send_fds(sock: RawFd, payload: &[u8], fds: &[RawFd]) -> Result<usize> {
    Ok(send_with(sock, payload, fds, 0)?.expect("a blocking send does not give up"))
}

/// [`send_fds`] that never waits: `None` when the socket's buffer has no
/// room for the message now (`EAGAIN`), so a server can serve others and
/// try again when `poll` says the socket is writable.
pub fn send_fds_nowait(sock: RawFd, payload: &[u8], fds: &[RawFd]) -> Result<Option<usize>> {
    send_with(sock, payload, fds, libc::MSG_DONTWAIT)
}

fn send_with(sock: RawFd, payload: &[u8], fds: &[RawFd], flags: libc::c_int) -> Result<Option<usize>> {
    if payload.is_empty() {
        return Err(Error::new(ErrorKind::InvalidArgument, "send_fds needs at least one payload byte"));
    }
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{} descriptors in one message, the kernel allows {MAX_FDS_PER_MESSAGE}", fds.len()),
        ));
    }
    if let Some(bad) = fds.iter().find(|fd| **fd < 0) {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("invalid file descriptor {bad} to send")));
    }
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut _, iov_len: payload.len() };
    // u64 storage keeps the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; cmsg_space(fds.len()).div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space(fds.len()) as _;
        // SAFETY: the control buffer has room for one header and the fds.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), fds.len());
        }
    }
    loop {
        // SAFETY: msg points at valid buffers for the duration of the call.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | flags) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = errno();
        if flags & libc::MSG_DONTWAIT != 0 && (e == libc::EAGAIN || e == libc::EWOULDBLOCK) {
            return Ok(None);
        }
        if e != libc::EINTR {
            return Err(Error::from_errno(e, format!("sendmsg of {} bytes and {} descriptors on socket {sock}", payload.len(), fds.len())));
        }
    }
}

/// Moves the descriptors of the `SCM_RIGHTS` control messages of `msg`
/// into `fds` (they are ours from then on).
///
/// # Safety
/// `msg` is a header that `recvmsg` has just filled, its control buffer
/// still alive, and its descriptors not taken yet.
pub unsafe fn take_passed_fds(msg: &libc::msghdr, fds: &mut Vec<OwnedFd>) {
    // SAFETY: walking the control messages the kernel wrote into the
    // caller's buffer (the caller's contract).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
}

/// Receives one message into `buf` with up to `max_fds` descriptors
/// (close-on-exec). Returns the payload length (0 when the peer closed)
/// and the descriptors. If the kernel had to drop descriptors, everything
/// received is closed and the error says why: `TooManyFiles` when this
/// process is at its open-file limit, `BufferTooSmall` when the sender sent
/// more than `max_fds`. A datagram longer than `buf` (its tail dropped by
/// the kernel) is `BufferTooSmall` too, its descriptors closed.
pub fn recv_fds(sock: RawFd, buf: &mut [u8], max_fds: usize) -> Result<(usize, Vec<OwnedFd>)> {
    if max_fds > MAX_FDS_PER_MESSAGE {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("max_fds {max_fds} above the kernel's {MAX_FDS_PER_MESSAGE}")));
    }
    let space = cmsg_space(max_fds);
    let mut control = vec![0u64; space.div_ceil(8).max(1)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; the pointers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if max_fds > 0 {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
    }
    let n = loop {
        // SAFETY: as above.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = errno();
        if e != libc::EINTR {
            return Err(Error::from_errno(e, format!("recvmsg on socket {sock}")));
        }
    };
    let mut fds = Vec::new();
    if max_fds > 0 {
        // SAFETY: walking the control messages the kernel wrote into our buffer.
        unsafe {
            take_passed_fds(&msg, &mut fds);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        let got = fds.len();
        drop(fds);
        if got < max_fds || max_fds == 0 && at_fd_limit() {
            return Err(Error::new(
                ErrorKind::TooManyFiles,
                format!(
                    "received a message whose descriptors were dropped: this process is at its open-file limit ({}); raise `ulimit -n` or share by name",
                    fd_limit_text()
                ),
            ));
        }
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!("the sender sent more than the {max_fds} descriptors this receive had room for; all were closed"),
        ));
    }
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        // A datagram longer than `buf`: the kernel dropped the rest.
        let got = fds.len();
        drop(fds);
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!(
                "the message was longer than the {}-byte buffer and was cut (a datagram socket drops the rest); its {got} descriptor(s) were closed",
                buf.len()
            ),
        ));
    }
    if fds.len() > max_fds {
        let got = fds.len();
        drop(fds);
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!("received {got} descriptors, more than the {max_fds} asked for; all were closed"),
        ));
    }
    Ok((n, fds))
}

/// Above this soft limit, counting by probing each number costs too much.
const MAX_PROBED: u64 = 1 << 16;

/// How many descriptors this process has open. At the limit
/// /proc/self/fd cannot be listed (that takes one more), so then each
/// number below the soft limit is probed instead; `None` when that is too
/// many to probe.
fn open_fd_count() -> Option<u64> {
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        // Less the listing's own descriptor.
        return Some(dir.count().saturating_sub(1) as u64);
    }
    let limit = soft_limit();
    if limit > MAX_PROBED {
        return None;
    }
    // SAFETY: F_GETFD only reads a descriptor's flags.
    Some((0..limit as i32).filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1).count() as u64)
}

fn soft_limit() -> u64 {
    // SAFETY: rlimit is plain data filled by getrlimit.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return u64::MAX;
    }
    r.rlim_cur
}

fn at_fd_limit() -> bool {
    open_fd_count().map_or(true, |n| n + 2 >= soft_limit())
}

/// This process's descriptor use, for messages: "N open, soft limit M".
pub(crate) fn fd_limit_text() -> String {
    match open_fd_count() {
        Some(n) => format!("{n} open, soft limit {}", soft_limit()),
        None => format!("soft limit {}", soft_limit()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn roundtrip_and_limits() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        assert_eq!(send_fds(a.as_raw_fd(), b"hi", &[f.as_raw_fd(), f.as_raw_fd()]).unwrap(), 2);
        let mut buf = [0u8; 8];
        let (n, fds) = recv_fds(b.as_raw_fd(), &mut buf, 4).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"hi"[..], 2));
        assert_eq!(send_fds(a.as_raw_fd(), b"", &[]).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(send_fds(a.as_raw_fd(), b"x", &[-1]).unwrap_err().kind(), ErrorKind::InvalidArgument);
        // More descriptors than the receiver has room for.
        let many: Vec<RawFd> = vec![f.as_raw_fd(); 5];
        send_fds(a.as_raw_fd(), b"m", &many).unwrap();
        let e = recv_fds(b.as_raw_fd(), &mut buf, 2).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BufferTooSmall, "{e}");
    }
}
