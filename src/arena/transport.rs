//! Sending shared blocks over a Unix socket: the handle as bytes, plus the
//! segment's descriptor the first time that segment goes to that peer
//! (SCM_RIGHTS once per segment per peer; with every share for a large
//! block, whose segment the receiver unmaps with its last view). Peers are told apart by the
//! socket's inode, so a closed and reconnected peer gets the fds again.

use super::allocator::Arena;
use super::handle::{ArenaHandle, Strategy, WIRE_SIZE};
use super::remote::{covers_whole_segment, has_segment, open_remote, open_with_fd, RemoteView};
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::{recv_fds, send_fds};
use crate::fork_safe::ForkSafeMutex;
use std::collections::HashSet;
use std::os::fd::RawFd;

/// (socket device, socket inode, segment id) already sent.
static SENT: ForkSafeMutex<Option<HashSet<(u64, u64, u64)>>> = ForkSafeMutex::new(None);

fn socket_id(sock: RawFd) -> Result<(u64, u64)> {
    // SAFETY: plain data filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid; a bad descriptor gives EBADF.
    if unsafe { libc::fstat(sock, &mut st) } != 0 {
        return Err(Error::last_os_error(format!("fstat of socket {sock}")));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("descriptor {sock} is not a socket")));
    }
    Ok((st.st_dev, st.st_ino))
}

/// Shares the block at `p` and sends its handle over `sock` (a connected
/// Unix stream socket), with the segment's fd if this peer lacks it.
pub fn send_block(arena: &Arena, sock: RawFd, p: *mut u8) -> Result<()> {
    let peer = socket_id(sock)?;
    let h = arena.share(p)?;
    let result = (|| {
        let mut fds = Vec::new();
        let key = (peer.0, peer.1, h.key.segment_id);
        // A large block's segment is unmapped by the receiver with its last
        // view: its fd goes with every share (and is not remembered).
        let whole = covers_whole_segment(&h);
        let first = h.strategy == Strategy::Fd && (whole || !SENT.lock_static().get_or_insert_with(HashSet::new).contains(&key));
        if first {
            fds.push(arena.segment_fd(h.key.segment_id)?);
        }
        let mut msg = [0u8; WIRE_SIZE + 1];
        msg[0] = fds.len() as u8;
        msg[1..].copy_from_slice(&h.encode());
        let mut sent = send_fds(sock, &msg, &fds)?;
        while sent < msg.len() {
            sent += send_fds(sock, &msg[sent..], &[])?;
        }
        if first && !whole {
            SENT.lock_static().get_or_insert_with(HashSet::new).insert(key);
        }
        Ok(())
    })();
    if result.is_err() {
        // The handle never left: give its hold back.
        let _ = arena.unshare(&h);
    }
    result
}

/// Receives one block sent by [`send_block`] and opens it.
pub fn recv_block(sock: RawFd) -> Result<RemoteView> {
    let mut msg = [0u8; WIRE_SIZE + 1];
    let (mut got, mut fds) = recv_fds(sock, &mut msg, 1)?;
    if got == 0 {
        return Err(Error::new(ErrorKind::PeerGone, format!("socket {sock}: the sender closed the connection")));
    }
    while got < msg.len() {
        let (n, more) = recv_fds(sock, &mut msg[got..], 1)?;
        if n == 0 {
            return Err(Error::new(ErrorKind::Protocol, format!("socket {sock}: connection closed inside an arena message")));
        }
        fds.extend(more);
        got += n;
    }
    if msg[0] as usize != fds.len() {
        return Err(Error::new(ErrorKind::Protocol, format!("arena message announces {} descriptors but {} arrived", msg[0], fds.len())));
    }
    let h = ArenaHandle::decode(&msg[1..])?;
    if let Some(fd) = fds.pop() {
        return open_with_fd(&h, fd);
    } else if h.strategy == Strategy::Fd && !has_segment(&h) {
        return Err(Error::new(ErrorKind::Protocol, "arena message without the fd of a segment this process has not mapped"));
    }
    open_remote(&h)
}
