//! How a consumer gets a by-fd segment it has not mapped: it asks the
//! producer. Each process that shares by-fd blocks answers on an abstract
//! Unix socket (gone with the process, nothing on disk); a request is the
//! segment id, the answer its descriptor by SCM_RIGHTS. A consumer asks
//! once per segment, so descriptors and connections stay O(segments)
//! whatever the number of blocks.
//!
//! An abstract name has no permissions: once the producer's server is gone
//! (its arena closed, the process exited) anyone may bind the name. So
//! both sides check who is at the other end (SO_PEERCRED): the server
//! answers only processes of its user (or root), the consumer takes a
//! descriptor only from the producer process the handle names, running as
//! its own user, and started when the handle says (a process that got
//! the pid of an exited producer is not it); and the segment itself must
//! come sealed against shrinking (checked when it is mapped,
//! `Segment::open`).
//!
//! Each connection is answered on a thread of its own with a short time
//! limit, so a connection that never sends its request delays nobody.
//! Connections of other users are closed at once; past a few connections
//! per process, or past the server's total, a connection is told `BUSY`
//! and closed, and the consumer tries again until its timeout: a live
//! producer is never reported gone because its server was busy.

use crate::arena::SharedArena;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage_sharing::fdpass::peer;
use storage_sharing::storage::{recv_fds, send_fds};
use storage_sharing::{Error, ErrorKind, Result};

/// Listening sockets of this process, closed in a fork child (which has
/// none of the threads that answer on them).
static LISTENERS: [AtomicI32; 16] = [const { AtomicI32::new(-1) }; 16];

extern "C" fn close_listeners_in_child() {
    for l in &LISTENERS {
        let fd = l.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the descriptor was ours in the parent; only close().
            unsafe { libc::close(fd) };
        }
    }
}

pub fn install_fork_handler() {
    // SAFETY: registers a handler that only closes descriptors.
    unsafe { libc::pthread_atfork(None, None, Some(close_listeners_in_child)) };
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // Through syscall(2): glibc's wrapper would need glibc 2.25, above the wheel's 2.17.
    if storage_sharing::syscalls::getrandom(&mut b) == 8 {
        return u64::from_ne_bytes(b);
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    t as u64 ^ ((std::process::id() as u64) << 32)
}

fn io_err(e: std::io::Error, what: impl std::fmt::Display) -> Error {
    match e.raw_os_error() {
        Some(n) => Error::from_errno(n, what),
        None => Error::new(ErrorKind::Io, format!("{what}: {e}")),
    }
}

/// Starts answering for `arena` on a new abstract socket; returns its name.
pub fn start(arena: SharedArena) -> Result<String> {
    let name = format!("ss_arena_fds_{}_{:016x}", std::process::id(), random_u64());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| io_err(e, "abstract socket name"))?;
    let listener = UnixListener::bind_addr(&addr).map_err(|e| io_err(e, format!("bind of arena fd server <@{name}>")))?;
    let fd = listener.as_raw_fd();
    // Past 16 servers a fork child keeps the extra listeners open: harmless.
    let _ = LISTENERS.iter().any(|l| l.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire).is_ok());
    std::thread::Builder::new()
        .name("ss-arena-fds".into())
        .spawn(move || serve(listener, arena))
        .map_err(|e| io_err(e, "starting the arena fd server thread"))?;
    Ok(name)
}

/// Wakes the server of `name` so it sees its arena closed and exits.
pub fn stop(name: &str) {
    if let Ok(addr) = SocketAddr::from_abstract_name(name.as_bytes()) {
        let _ = UnixStream::connect_addr(&addr);
    }
}

/// How long one connection may take to send its request and take the
/// answer (both are a few bytes).
const CONNECTION_LIMIT: Duration = Duration::from_secs(2);
/// Connections answered at once; past it a new connection is told
/// `BUSY` (the consumer tries again).
const MAX_ACTIVE: usize = 64;
/// Connections of one process answered at once: a consumer asks once per
/// segment, so a process with more open is stalling, and must not take
/// every slot.
const MAX_PER_PROCESS: usize = 4;

/// The first byte of the answer to a connection the server has no room
/// for now: try again.
pub const BUSY: u8 = 2;

/// The connections being answered, in all and per peer pid.
#[derive(Default)]
struct Load {
    total: usize,
    per_pid: HashMap<i32, usize>,
}

impl Load {
    fn take(&mut self, pid: i32) -> bool {
        let mine = self.per_pid.entry(pid).or_insert(0);
        if self.total >= MAX_ACTIVE || *mine >= MAX_PER_PROCESS {
            return false;
        }
        *mine += 1;
        self.total += 1;
        true
    }

    fn give_back(&mut self, pid: i32) {
        self.total -= 1;
        if let Some(n) = self.per_pid.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                self.per_pid.remove(&pid);
            }
        }
    }
}

fn lock(load: &Mutex<Load>) -> std::sync::MutexGuard<'_, Load> {
    load.lock().unwrap_or_else(|p| p.into_inner())
}

fn serve(listener: UnixListener, arena: SharedArena) {
    let fd = listener.as_raw_fd();
    let load = Arc::new(Mutex::new(Load::default()));
    for conn in listener.incoming() {
        if arena.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            break;
        }
        let Ok(conn) = conn else { continue };
        // Another user's connection takes no slot: closed unanswered.
        let Some(pid) = same_user(conn.as_raw_fd()) else { continue };
        if !lock(&load).take(pid) {
            tell_busy(&conn);
            continue;
        }
        let (arena, load2) = (arena.clone(), load.clone());
        let spawned = std::thread::Builder::new().name("ss-arena-fd".into()).spawn(move || {
            let _ = answer(&conn, &arena);
            lock(&load2).give_back(pid);
        });
        if spawned.is_err() {
            lock(&load).give_back(pid);
        }
    }
    for l in &LISTENERS {
        let _ = l.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// The pid of the connecting process if it runs as this user, or as root.
fn same_user(sock: RawFd) -> Option<i32> {
    peer::credentials(sock).ok().filter(|(_, uid)| *uid == peer::my_uid() || *uid == 0).map(|(pid, _)| pid)
}

/// Tells a connection there is no room for it now, without waiting: a
/// fresh connection's send buffer is empty.
fn tell_busy(conn: &UnixStream) {
    // SAFETY: send of one byte from our stack on a socket we own.
    unsafe { libc::send(conn.as_raw_fd(), [BUSY].as_ptr().cast(), 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
}

fn answer(conn: &UnixStream, arena: &SharedArena) -> std::io::Result<()> {
    conn.set_read_timeout(Some(CONNECTION_LIMIT))?;
    conn.set_write_timeout(Some(CONNECTION_LIMIT))?;
    let mut req = [0u8; 8];
    (&*conn).read_exact(&mut req)?;
    let id = u64::from_le_bytes(req);
    if id == crate::reshare::REQUEST {
        return crate::reshare::answer(conn, arena);
    }
    let arena = arena.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let found = match arena {
        Some(a) => a.segment_fd(id),
        None => Err(Error::new(ErrorKind::Closed, "the producer closed its arena")),
    };
    let sent = match found {
        Ok(fd) => send_fds(conn.as_raw_fd(), &[0u8], &[fd]),
        Err(e) => {
            let mut msg = vec![1u8];
            msg.extend(e.message().bytes().take(1000));
            send_fds(conn.as_raw_fd(), &msg, &[])
        }
    };
    sent.map(|_| ()).map_err(|e| std::io::Error::other(e.message().to_string()))
}

/// Asks the server `name` of process (`producer_pid`, `producer_start`)
/// for the descriptor of segment `segment_id`. Whoever else answers there
/// is refused before the request is sent (`Permission`); a busy server is
/// asked again until `timeout` (then `Busy`).
pub fn fetch(name: &str, producer_pid: i32, producer_start: u64, segment_id: u64, timeout: Duration) -> Result<OwnedFd> {
    let producer = Producer { name, pid: producer_pid, start: producer_start };
    ask(&producer, timeout, |conn, left, what| {
        if let Err(e) = (&*conn).write_all(&segment_id.to_le_bytes()) {
            return if hung_up(&e) { Ok(None) } else { Err(io_err(e, what)) };
        }
        let mut pfd = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready == 0 {
            return Err(Error::new(ErrorKind::Timeout, format!("{what}: no answer for segment {segment_id} in {timeout:?}")));
        }
        let mut buf = [0u8; 1024];
        let (n, mut fds) = recv_fds(conn.as_raw_fd(), &mut buf, 1)?;
        if n == 0 || buf[0] == BUSY {
            return Ok(None);
        }
        match (buf[0], fds.pop()) {
            (0, Some(fd)) => Ok(Some(fd)),
            _ => Err(Error::new(ErrorKind::NotFound, format!("{what}: segment {segment_id}: {}", String::from_utf8_lossy(&buf[1..n])))),
        }
    })
}

/// Whether a write failed because the server closed the connection (it
/// had no room for it: the `BUSY` byte was its last word).
pub fn hung_up(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPIPE) | Some(libc::ECONNRESET))
}

/// The process whose fd server a consumer asks, as its handle names it.
pub struct Producer<'a> {
    pub name: &'a str,
    pub pid: i32,
    pub start: u64,
}

/// Connects to the fd server of `producer`, checks that the producer
/// itself listens there, and runs `exchange` on the connection (given the
/// time left and a description for messages). An exchange that returns
/// `None` met a server with no room for it (`BUSY`, or closed unanswered):
/// while the producer lives it is tried again, with growing pauses, until
/// `timeout`, then `Busy`; once the producer is gone, `PeerGone`.
pub fn ask<T>(
    producer: &Producer<'_>,
    timeout: Duration,
    mut exchange: impl FnMut(&UnixStream, Duration, &str) -> Result<Option<T>>,
) -> Result<T> {
    let what = format!("arena fd server <@{}>", producer.name);
    let addr = SocketAddr::from_abstract_name(producer.name.as_bytes()).map_err(|e| io_err(e, &what))?;
    let deadline = std::time::Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    let mut tries = 0u32;
    loop {
        tries += 1;
        let conn = UnixStream::connect_addr(&addr).map_err(|e| {
            Error::new(ErrorKind::PeerGone, format!("{what}: {e} (the process that shared the block is gone or closed its arena)"))
        })?;
        // The producer's server gone, another process may have taken its
        // name, even one that got the producer's pid.
        peer::expect_process_started(conn.as_raw_fd(), producer.pid, producer.start, &what)?;
        let left = deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
        conn.set_write_timeout(Some(left)).map_err(|e| io_err(e, &what))?;
        conn.set_read_timeout(Some(left)).map_err(|e| io_err(e, &what))?;
        if let Some(answer) = exchange(&conn, left, &what)? {
            return Ok(answer);
        }
        drop(conn);
        if !storage_sharing::proc_identity::alive(producer.pid, producer.start) {
            return Err(Error::new(ErrorKind::PeerGone, format!("{what} closed the connection without an answer: the producer exited")));
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "{what} is busy: the producer (pid {}) lives, but its server had no room for this request in {tries} tries over {timeout:?} \
                     (other connections take its slots); try again later or with a longer timeout",
                    producer.pid
                ),
            ));
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}
