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
//! its own user; and the segment itself must come sealed against
//! shrinking (checked when it is mapped, `Segment::open`).
//!
//! Each connection is answered on a thread of its own with a short time
//! limit, so a connection that never sends its request delays nobody.

use crate::arena::SharedArena;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
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
/// Connections answered at once; past it a new connection is closed
/// unanswered (the consumer gets an error and may retry).
const MAX_ACTIVE: usize = 64;

fn serve(listener: UnixListener, arena: SharedArena) {
    let fd = listener.as_raw_fd();
    let active = std::sync::Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if arena.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            break;
        }
        let Ok(conn) = conn else { continue };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_ACTIVE {
            active.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let (arena, done) = (arena.clone(), active.clone());
        let spawned = std::thread::Builder::new().name("ss-arena-fd".into()).spawn(move || {
            let _ = answer(&conn, &arena);
            done.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
    for l in &LISTENERS {
        let _ = l.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Whether the connecting process runs as this user, or as root.
fn same_user(sock: RawFd) -> bool {
    peer::credentials(sock).is_ok_and(|(_, uid)| uid == peer::my_uid() || uid == 0)
}

fn answer(conn: &UnixStream, arena: &SharedArena) -> std::io::Result<()> {
    conn.set_read_timeout(Some(CONNECTION_LIMIT))?;
    conn.set_write_timeout(Some(CONNECTION_LIMIT))?;
    if !same_user(conn.as_raw_fd()) {
        return Ok(());
    }
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

/// Asks the server `name` of process `producer_pid` for the descriptor of
/// segment `segment_id`. Whoever else answers there is refused before
/// the request is sent (`Permission`).
pub fn fetch(name: &str, producer_pid: i32, segment_id: u64, timeout: Duration) -> Result<OwnedFd> {
    let what = format!("arena fd server <@{name}>");
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| io_err(e, &what))?;
    let conn = UnixStream::connect_addr(&addr).map_err(|e| {
        Error::new(ErrorKind::PeerGone, format!("{what}: {e} (the process that shared the block exited before it was opened)"))
    })?;
    // The producer's server gone, another process may have taken its name.
    peer::expect_process(conn.as_raw_fd(), producer_pid, &what)?;
    conn.set_write_timeout(Some(timeout)).map_err(|e| io_err(e, &what))?;
    (&conn).write_all(&segment_id.to_le_bytes()).map_err(|e| io_err(e, &what))?;
    let mut pfd = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
    if ready == 0 {
        return Err(Error::new(ErrorKind::Timeout, format!("{what}: no answer for segment {segment_id} in {timeout:?}")));
    }
    let mut buf = [0u8; 1024];
    let (n, mut fds) = recv_fds(conn.as_raw_fd(), &mut buf, 1)?;
    if n == 0 {
        return Err(Error::new(ErrorKind::PeerGone, format!("{what} closed the connection without an answer")));
    }
    match (buf[0], fds.pop()) {
        (0, Some(fd)) => Ok(fd),
        _ => Err(Error::new(ErrorKind::NotFound, format!("{what}: segment {segment_id}: {}", String::from_utf8_lossy(&buf[1..n])))),
    }
}
