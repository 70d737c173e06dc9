//! Who is at the other end of a Unix socket. An abstract socket name has
//! no file permissions, so whoever binds it first (any user) answers
//! there; before trusting a descriptor or sending one, a side checks the
//! kernel's record of the peer (`SO_PEERCRED`: the process that connected,
//! or the one that listened). A pid is checked with the start time the
//! caller recorded for it ([`crate::proc_identity`]): a process that got
//! the pid of an exited one passes for it by pid and uid alone.

use crate::error::{Error, ErrorKind, Result};
use std::io;
use std::os::fd::RawFd;

/// The process at the other end of connected socket `sock`: (pid, uid),
/// as the kernel recorded them when it connected (or listened). The uid
/// is the effective one.
pub fn credentials(sock: RawFd) -> io::Result<(i32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    let rc = unsafe { libc::getsockopt(sock, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid))
}

/// This process's effective uid: what `SO_PEERCRED` reports for it.
pub fn my_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether (`pid`, `uid`) is process `want` running as this user.
pub fn is_process_of_mine(pid: i32, uid: u32, want: i32) -> bool {
    pid == want && uid == my_uid()
}

/// Checks that the process at the other end of `sock` is `want` and runs
/// as this user; else a `Permission` error naming who is there instead.
/// `what` says what the socket is for the message.
pub fn expect_process(sock: RawFd, want: i32, what: &str) -> Result<()> {
    let (pid, uid) =
        credentials(sock).map_err(|e| Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("{what}: SO_PEERCRED")))?;
    if is_process_of_mine(pid, uid, want) {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Permission,
        format!("{what}: the socket belongs to pid {pid} (uid {uid}), not to process {want} of uid {}; refused", my_uid()),
    ))
}

/// [`expect_process`] for the process that started at `want_start` (clock
/// ticks since boot, as [`crate::proc_identity::start_ticks`] reads it):
/// a process that got pid `want` after the one the caller means exited is
/// refused (`Permission`). A peer that is gone by the time its start time
/// is read cannot be told apart and is `PeerGone`.
pub fn expect_process_started(sock: RawFd, want: i32, want_start: u64, what: &str) -> Result<()> {
    expect_process(sock, want, what)?;
    match crate::proc_identity::start_and_state(want) {
        Some((start, state)) if start == want_start && state != 'Z' && state != 'X' => Ok(()),
        Some((start, _)) if start != want_start => Err(Error::new(
            ErrorKind::Permission,
            format!(
                "{what}: the socket belongs to pid {want}, but to a process that started at clock tick {start}, not to the one of tick {want_start} \
                 expected there (the pid was reused after that process exited); refused"
            ),
        )),
        _ => Err(Error::new(ErrorKind::PeerGone, format!("{what}: process {want} exited while it was being checked"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_socket_pair_is_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let me = std::process::id() as i32;
        assert_eq!(credentials(a.as_raw_fd()).unwrap(), (me, my_uid()));
        expect_process(a.as_raw_fd(), me, "test").unwrap();
        let e = expect_process(a.as_raw_fd(), me + 1, "test").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
        assert!(e.message().contains(&format!("pid {me}")), "{e}");
        let start = crate::proc_identity::me().1;
        expect_process_started(a.as_raw_fd(), me, start, "test").unwrap();
        let e = expect_process_started(a.as_raw_fd(), me, start + 1, "test").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
        assert!(e.message().contains("reused"), "{e}");
    }
}
