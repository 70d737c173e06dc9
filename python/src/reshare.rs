//! Sharing on a block received from another process (A -> B -> C): B asks
//! the producer A, on A's fd server, for a new share of the block it holds,
//! so C gets a handle of A's arena and maps A's segment, and all three see
//! the same bytes. B proves its hold with the handle it opened; A checks
//! it against the slot in the segment (see `Arena::reshare`).
//!
//! On the wire, after the fd server's 8-byte request word `REQUEST` (no
//! segment has that id): the 112-byte held handle. The answer: 0 and the
//! new handle, or 1 and a message.

use crate::arena::SharedArena;
use crate::fd_server::{self, Producer};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;
use storage_sharing::arena::handle::WIRE_SIZE;
use storage_sharing::arena::ArenaHandle;
use storage_sharing::{Error, ErrorKind, Result};

/// The request word that asks for a reshare instead of a segment's fd.
pub const REQUEST: u64 = u64::MAX;

const MAX_ANSWER: usize = 1 + 1024;

/// The fd server's side: reads the held handle from `conn`, answers a new one.
pub fn answer(conn: &UnixStream, arena: &SharedArena) -> std::io::Result<()> {
    let mut held = [0u8; WIRE_SIZE];
    (&*conn).read_exact(&mut held)?;
    let arena = arena.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let made = match arena {
        Some(a) => ArenaHandle::decode(&held).and_then(|h| a.reshare(&h)),
        None => Err(Error::new(ErrorKind::Closed, "the producer closed its arena")),
    };
    let mut msg = Vec::with_capacity(1 + WIRE_SIZE);
    match made {
        Ok(h) => {
            msg.push(0);
            msg.extend_from_slice(&h.encode());
        }
        Err(e) => {
            msg.push(1);
            msg.extend(e.message().bytes().take(MAX_ANSWER - 1));
        }
    }
    (&*conn).write_all(&msg)
}

/// The consumer's side: asks the producer's fd server `name` for a new
/// share of the block `held` (a handle this process opened and holds).
/// Only the producer itself may answer (the process of the handle's pid
/// and start time): one that took over the name, or the pid, after the
/// producer went could hand out a handle of its own.
pub fn request(name: &str, held: &ArenaHandle, timeout: Duration) -> Result<ArenaHandle> {
    let producer = Producer { name, pid: held.key.producer_pid, start: held.key.producer_start };
    fd_server::ask(&producer, timeout, |conn, _, what| {
        let io = |e: std::io::Error| Error::new(ErrorKind::Io, format!("{what}: sharing on a received block: {e}"));
        let mut req = Vec::with_capacity(8 + WIRE_SIZE);
        req.extend_from_slice(&REQUEST.to_le_bytes());
        req.extend_from_slice(&held.encode());
        if let Err(e) = (&*conn).write_all(&req) {
            return if fd_server::hung_up(&e) { Ok(None) } else { Err(io(e)) };
        }
        let mut buf = Vec::new();
        conn.take(MAX_ANSWER as u64).read_to_end(&mut buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Error::new(ErrorKind::Timeout, format!("{what}: no answer to a reshare in {timeout:?}"))
            }
            _ => io(e),
        })?;
        match buf.split_first() {
            None | Some((&fd_server::BUSY, _)) => Ok(None),
            Some((0, h)) => ArenaHandle::decode(h).map(Some),
            Some((_, why)) => Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{what} refused to share the block on: {}", String::from_utf8_lossy(why)),
            )),
        }
    })
}
