//! Passing block descriptors between the ranks of one host, as PyTorch's
//! `IpcChannel`: each process binds a Unix datagram socket at
//! `<TMPDIR|TMP|TEMP|TEMPDIR or /tmp>/symm_mem-<pid>` (unlinked when the
//! channel is dropped) and descriptors travel with SCM_RIGHTS.
//!
//! The all-gather is a ring: at step k (1..ws) each rank sends the
//! descriptor it holds to rank+1 and receives the one of rank-k from rank-1,
//! which it forwards at the next step. Each datagram carries the origin
//! rank (4 bytes) so a receiver checks it got what the ring promises.

use crate::error::{Error, ErrorKind, Result};
use crate::storage::{recv_fds, send_fds};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The socket path holds only the pid, so one process runs one channel at
/// a time: concurrent rendezvous of one process take turns. The turn is
/// the pid of its holder (0: free) rather than a mutex, so that waiting
/// for it honours the caller's deadline, and a child forked while a parent
/// thread holds it (a pid that is not the child's) takes it over: the
/// child's socket has its own path.
static TURN: AtomicI32 = AtomicI32::new(0);
/// The group whose rendezvous holds the turn, for the message of whoever
/// waits for it (only ever try-locked by waiters).
static TURN_GROUP: Mutex<String> = Mutex::new(String::new());

/// This process's turn at the descriptor socket; given back when dropped.
struct Turn;

impl Turn {
    fn take(group: &str, deadline: Option<Instant>) -> Result<Turn> {
        let me = std::process::id() as i32;
        let mut pause = Duration::from_micros(200);
        loop {
            let holder = TURN.load(Ordering::Acquire);
            // Free, or held by the process we were forked from.
            if (holder == 0 || holder != me)
                && TURN.compare_exchange(holder, me, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                if let Ok(mut g) = TURN_GROUP.try_lock() {
                    *g = group.to_string();
                }
                return Ok(Turn);
            }
            if deadline.is_some_and(|d| Instant::now() + pause > d) {
                let other = TURN_GROUP.try_lock().map(|g| g.clone()).unwrap_or_default();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rendezvous of group {group} timed out waiting for this process's descriptor socket, \
                         which the rendezvous of group {} still holds (one rendezvous per process at a time)",
                        if other.is_empty() { "?" } else { &other }
                    ),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let _ = TURN.compare_exchange(std::process::id() as i32, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// The temporary folder, by the variables PyTorch reads, in its order.
pub fn temp_dir() -> PathBuf {
    for var in ["TMPDIR", "TMP", "TEMP", "TEMPDIR"] {
        if let Ok(v) = std::env::var(var) {
            if !v.is_empty() {
                return PathBuf::from(v);
            }
        }
    }
    PathBuf::from("/tmp")
}

/// The socket path of process `pid`.
pub fn socket_path(pid: i32) -> PathBuf {
    temp_dir().join(format!("symm_mem-{pid}"))
}

pub struct IpcChannel {
    sock: UnixDatagram,
    path: PathBuf,
    _turn: Turn,
}

impl IpcChannel {
    /// Binds this process's socket for a rendezvous of `group` (replacing
    /// a stale file a dead process with the same pid left behind), waiting
    /// until `deadline` for another rendezvous of this process to finish.
    pub fn new(group: &str, deadline: Option<Instant>) -> Result<IpcChannel> {
        let turn = Turn::take(group, deadline)?;
        let path = socket_path(std::process::id() as i32);
        // Only this process could be using its own pid's path, and it
        // holds the turn: any file there is stale.
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).map_err(|e| io_error(e, format!("unable to bind the socket {}", path.display())))?;
        Ok(IpcChannel { sock, path, _turn: turn })
    }

    /// Ring all-gather of `own` among processes `pids` (indexed by rank);
    /// returns every peer's descriptor (`None` at `rank`).
    pub fn all_gather(&self, own: RawFd, rank: usize, pids: &[i32], deadline: Option<Instant>) -> Result<Vec<Option<OwnedFd>>> {
        let ws = pids.len();
        let next = (rank + 1) % ws;
        let prev = (rank + ws - 1) % ws;
        let mut fds: Vec<Option<OwnedFd>> = (0..ws).map(|_| None).collect();
        let mut holding = (rank, own);
        for step in 1..ws {
            self.send(&[holding.1], holding.0, next, pids[next], deadline)?;
            let origin = (rank + ws - step) % ws;
            let (got_origin, fd) = self.recv(prev, pids[prev], deadline)?;
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

    /// Rank `src`'s descriptor (or none: a datagram without one) on every
    /// rank: `src` sends it to each other rank, the others receive it. The
    /// caller makes sure no ring datagram is still in flight (a store
    /// barrier after the ring), as both share this socket.
    pub fn broadcast(&self, fd: Option<RawFd>, src: usize, rank: usize, pids: &[i32], deadline: Option<Instant>) -> Result<Option<OwnedFd>> {
        if rank == src {
            let fds: Vec<RawFd> = fd.into_iter().collect();
            for (r, &pid) in pids.iter().enumerate().filter(|&(r, _)| r != src) {
                self.send(&fds, src, r, pid, deadline)?;
            }
            return Ok(None);
        }
        let (origin, fd) = self.recv_any(src, pids[src], deadline)?;
        if origin != src {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("descriptor broadcast: rank {rank} expected a datagram of rank {src}, got one of rank {origin}"),
            ));
        }
        Ok(fd)
    }

    /// Sends descriptors `fds` (of rank `origin`) to rank `to_rank`. The peer
    /// binds its socket only after the request all-gather, so a missing or
    /// refusing socket is retried while the peer process lives, until
    /// `deadline`.
    fn send(&self, fds: &[RawFd], origin: usize, to_rank: usize, to_pid: i32, deadline: Option<Instant>) -> Result<()> {
        let path = socket_path(to_pid);
        let out = UnixDatagram::unbound().map_err(|e| io_error(e, "unable to create a datagram socket".into()))?;
        let mut pause = Duration::from_micros(50);
        loop {
            let e = match out.connect(&path) {
                Ok(()) => break,
                Err(e) => e,
            };
            let not_yet = matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ECONNREFUSED));
            let reach = || format!("unable to reach rank {to_rank} (pid {to_pid}) at {}", path.display());
            if !not_yet {
                return Err(io_error(e, reach()));
            }
            if !process_alive(to_pid) {
                return Err(Error::new(
                    ErrorKind::PeerGone,
                    format!("{}: the process exited before opening its descriptor socket", reach()),
                ));
            }
            if deadline.is_some_and(|d| Instant::now() + pause > d) {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{}: its descriptor socket did not open in time", reach()),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        send_fds(out.as_raw_fd(), &(origin as u32).to_ne_bytes(), fds)
            .map_err(|e| e.context(format!("sending a block descriptor to rank {to_rank} (pid {to_pid})")))?;
        Ok(())
    }

    fn recv(&self, from_rank: usize, from_pid: i32, deadline: Option<Instant>) -> Result<(usize, OwnedFd)> {
        match self.recv_any(from_rank, from_pid, deadline)? {
            (origin, Some(fd)) => Ok((origin, fd)),
            (_, None) => Err(Error::new(
                ErrorKind::Protocol,
                format!("datagram from rank {from_rank} had no descriptor, expected one"),
            )),
        }
    }

    /// One datagram: its origin rank and its descriptor, if it has one.
    fn recv_any(&self, from_rank: usize, from_pid: i32, deadline: Option<Instant>) -> Result<(usize, Option<OwnedFd>)> {
        wait_readable(self.sock.as_raw_fd(), deadline).map_err(|e| {
            e.context(format!("waiting for a block descriptor from rank {from_rank} (pid {from_pid})"))
        })?;
        let mut buf = [0u8; 4];
        let (n, mut fds) = recv_fds(self.sock.as_raw_fd(), &mut buf, 1)?;
        if n != 4 || fds.len() > 1 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("datagram from rank {from_rank} had {n} bytes and {} descriptors, expected 4 and at most 1", fds.len()),
            ));
        }
        Ok((u32::from_ne_bytes(buf) as usize, fds.pop()))
    }
}

/// Whether process `pid` exists (EPERM: it does, owned by someone else).
fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 || crate::error::errno() == libc::EPERM }
}

impl Drop for IpcChannel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn io_error(e: std::io::Error, what: String) -> Error {
    Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), what)
}

/// Polls `fd` for input until `deadline` (None: forever).
fn wait_readable(fd: RawFd, deadline: Option<Instant>) -> Result<()> {
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(ErrorKind::Timeout, "timed out"));
                }
                left.as_millis().clamp(1, i32::MAX as u128) as i32
            }
        };
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd on the stack for the duration of the call.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 && crate::error::errno() != libc::EINTR {
            return Err(Error::last_os_error("poll"));
        }
        if rc == 0 && deadline.is_none() {
            std::thread::sleep(Duration::ZERO);
        }
    }
}
