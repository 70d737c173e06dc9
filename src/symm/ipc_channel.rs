//! Passing block descriptors between the ranks of one host, in the manner
//! of PyTorch's `IpcChannel` (descriptors travel with SCM_RIGHTS), over
//! sockets that leave nothing behind: each rendezvous listens on its own
//! abstract-namespace socket (see [`abstract_socket`]), named
//! `symm_mem-<pid>-<random>` and published to the peers through the store
//! after it listens. Every message is one short connection: the sender
//! checks that the listener is the peer's process, the receiver that the
//! connecting process is the peer it waits for (pid from the peer's
//! rendezvous request and start time from its side details, same user),
//! so neither hands a descriptor to, nor maps one from, a stranger, nor a
//! process that got the pid of a peer that exited.
//!
//! The all-gather is a ring: at step k (1..ws) each rank sends the
//! descriptor it holds to rank+1 and receives the one of rank-k from rank-1,
//! which it forwards at the next step. Each message carries the origin
//! rank (4 bytes) so a receiver checks it got what the ring promises.

use super::exchange::vec_for;
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::abstract_socket;
use crate::fdpass::peer::{is_process_of_mine as is_expected, my_uid};
use crate::fdpass::{recv_fds, send_fds};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Where a rank listens: its process (pid and start time, see
/// [`crate::proc_identity`]) and its socket's name.
#[derive(Clone, Debug)]
pub struct PeerSocket {
    pub pid: i32,
    pub start: u64,
    pub name: String,
}

impl PeerSocket {
    /// Whether (`pid`, `uid`) of a socket is this peer's process, running
    /// as this user (and not a process that got its pid after it exited).
    fn is(&self, pid: i32, uid: u32) -> bool {
        is_expected(pid, uid, self.pid) && crate::proc_identity::start_ticks(pid) == Some(self.start)
    }
}

/// This process's listening socket for one rendezvous; it is gone (with
/// its name) when the channel is dropped or the process dies.
pub struct IpcChannel {
    listener: OwnedFd,
    name: String,
}

/// How often a receiver looks whether the peer it waits for still lives.
const LIVENESS_CHECK: Duration = Duration::from_millis(100);

impl IpcChannel {
    /// Listens on a fresh abstract name. Channels of one process (of
    /// concurrent rendezvous) have different names and never wait for
    /// each other.
    pub fn open() -> Result<IpcChannel> {
        let mut last = None;
        for _ in 0..4 {
            let name = abstract_socket::unique_name();
            match abstract_socket::listen(&name) {
                Ok(listener) => return Ok(IpcChannel { listener, name }),
                Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => last = Some((name, e)),
                Err(e) => return Err(io_error(e, format!("unable to listen on the abstract socket @{name}"))),
            }
        }
        let (name, e) = last.expect("the loop ran");
        Err(io_error(e, format!("unable to find a free abstract socket name (last tried @{name})")))
    }

    /// The abstract name this channel listens on (without the leading NUL).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Ring all-gather of `own` among `peers` (indexed by rank); returns
    /// every peer's descriptor (`None` at `rank`).
    pub fn all_gather(&self, own: RawFd, rank: usize, peers: &[PeerSocket], deadline: Option<Instant>) -> Result<Vec<Option<OwnedFd>>> {
        let ws = peers.len();
        let next = (rank + 1) % ws;
        let prev = (rank + ws - 1) % ws;
        let mut fds: Vec<Option<OwnedFd>> = vec_for(ws, "block descriptors")?;
        fds.extend((0..ws).map(|_| None));
        let mut holding = (rank, own);
        for step in 1..ws {
            self.send(&[holding.1], holding.0, next, &peers[next], deadline)?;
            let origin = (rank + ws - step) % ws;
            let (got_origin, fd) = self.recv(prev, &peers[prev], deadline)?;
            if got_origin != origin {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("descriptor ring: rank {rank} expected the block of rank {origin} from rank {prev}, got rank {got_origin}'s"),
                ));
            }
            holding = (origin, fd.as_raw_fd());
            fds[origin] = Some(fd);
        }
        Ok(fds)
    }

    /// Rank `src`'s descriptor (or none: a message without one) on every
    /// rank: `src` sends it to each other rank, the others receive it. The
    /// caller makes sure no ring message is still in flight (a store
    /// barrier after the ring), as both use this socket.
    pub fn broadcast(
        &self,
        fd: Option<RawFd>,
        src: usize,
        rank: usize,
        peers: &[PeerSocket],
        deadline: Option<Instant>,
    ) -> Result<Option<OwnedFd>> {
        if rank == src {
            let fds: Vec<RawFd> = fd.into_iter().collect();
            for (r, peer) in peers.iter().enumerate().filter(|&(r, _)| r != src) {
                self.send(&fds, src, r, peer, deadline)?;
            }
            return Ok(None);
        }
        let (origin, fd) = self.recv_any(src, &peers[src], deadline)?;
        if origin != src {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("descriptor broadcast: rank {rank} expected a message of rank {src}, got one of rank {origin}"),
            ));
        }
        Ok(fd)
    }

    /// Sends descriptors `fds` (of rank `origin`) to rank `to_rank`, after
    /// checking that the process listening there is that rank's. A socket
    /// nobody listens on is retried while the peer process lives (its
    /// rendezvous may not have reached us yet), until `deadline`.
    fn send(&self, fds: &[RawFd], origin: usize, to_rank: usize, to: &PeerSocket, deadline: Option<Instant>) -> Result<()> {
        let reach = || format!("unable to reach rank {to_rank} (pid {}) at @{}", to.pid, to.name);
        let mut pause = Duration::from_micros(50);
        let conn = loop {
            let e = match abstract_socket::connect(&to.name) {
                Ok(c) => break c,
                Err(e) => e,
            };
            let not_yet = matches!(e.raw_os_error(), Some(libc::ECONNREFUSED) | Some(libc::EAGAIN));
            if !not_yet {
                return Err(io_error(e, reach()));
            }
            if !crate::proc_identity::alive(to.pid, to.start) {
                return Err(Error::new(ErrorKind::PeerGone, format!("{}: the process exited", reach())));
            }
            if deadline.is_some_and(|d| Instant::now() + pause > d) {
                return Err(Error::new(ErrorKind::Timeout, format!("{}: nobody accepted in time", reach())));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        };
        let (pid, uid) = abstract_socket::peer(conn.as_raw_fd()).map_err(|e| io_error(e, reach()))?;
        if !to.is(pid, uid) {
            return Err(Error::new(
                ErrorKind::Permission,
                format!(
                    "{}: the socket belongs to pid {pid} (uid {uid}, started at clock tick {}), not to rank {to_rank}'s process {} \
                     of uid {} started at tick {} (a pid reused after that rank exited, or another process); its block descriptor was not sent",
                    reach(),
                    start_text(pid),
                    to.pid,
                    my_uid(),
                    to.start
                ),
            ));
        }
        send_fds(conn.as_raw_fd(), &(origin as u32).to_ne_bytes(), fds)
            .map_err(|e| e.context(format!("sending a block descriptor to rank {to_rank} (pid {})", to.pid)))?;
        Ok(())
    }

    fn recv(&self, from_rank: usize, from: &PeerSocket, deadline: Option<Instant>) -> Result<(usize, OwnedFd)> {
        match self.recv_any(from_rank, from, deadline)? {
            (origin, Some(fd)) => Ok((origin, fd)),
            (_, None) => Err(Error::new(ErrorKind::Protocol, format!("message from rank {from_rank} had no descriptor, expected one"))),
        }
    }

    /// One message of rank `from_rank`: its origin rank and its descriptor,
    /// if it has one. Connections of any other process are closed unread.
    fn recv_any(&self, from_rank: usize, from: &PeerSocket, deadline: Option<Instant>) -> Result<(usize, Option<OwnedFd>)> {
        let waiting = || format!("waiting for a block descriptor from rank {from_rank} (pid {})", from.pid);
        let mut refused: Option<(i32, u32)> = None;
        let conn = loop {
            match wait_readable(self.listener.as_raw_fd(), deadline, from) {
                Ok(()) => {}
                Err(e) => {
                    let e = e.context(waiting());
                    return Err(match refused {
                        Some((pid, uid)) => e.context(format!("(a connection of pid {pid}, uid {uid}, was refused)")),
                        None => e,
                    });
                }
            }
            let conn = match abstract_socket::accept(self.listener.as_raw_fd()) {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(io_error(e, format!("accept on @{}", self.name))),
            };
            let (pid, uid) = abstract_socket::peer(conn.as_raw_fd()).map_err(|e| io_error(e, waiting()))?;
            if from.is(pid, uid) {
                break conn;
            }
            refused = Some((pid, uid));
        };
        wait_readable(conn.as_raw_fd(), deadline, from).map_err(|e| e.context(waiting()))?;
        let mut buf = [0u8; 4];
        let (n, mut fds) = recv_fds(conn.as_raw_fd(), &mut buf, 1)?;
        if n != 4 || fds.len() > 1 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("message from rank {from_rank} had {n} bytes and {} descriptors, expected 4 and at most 1", fds.len()),
            ));
        }
        Ok((u32::from_ne_bytes(buf) as usize, fds.pop()))
    }
}

/// The start time of `pid` for a message ("?" when it is gone).
fn start_text(pid: i32) -> String {
    crate::proc_identity::start_ticks(pid).map_or_else(|| "?".to_string(), |s| s.to_string())
}

fn io_error(e: std::io::Error, what: String) -> Error {
    Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), what)
}

/// Polls `fd` for input until `deadline` (None: forever); gives up early
/// with `PeerGone` once the process of `peer` has exited.
fn wait_readable(fd: RawFd, deadline: Option<Instant>, peer: &PeerSocket) -> Result<()> {
    loop {
        let slice = match deadline {
            None => LIVENESS_CHECK,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(ErrorKind::Timeout, "timed out"));
                }
                left.min(LIVENESS_CHECK)
            }
        };
        let ms = slice.as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd on the stack for the duration of the call.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 && crate::error::errno() != libc::EINTR {
            return Err(Error::last_os_error("poll"));
        }
        if rc == 0 && !crate::proc_identity::alive(peer.pid, peer.start) {
            return Err(Error::new(ErrorKind::PeerGone, format!("process {} exited", peer.pid)));
        }
    }
}
