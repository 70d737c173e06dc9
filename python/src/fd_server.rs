//! How a consumer gets a by-fd segment it has not mapped: it asks the
//! producer. Each process that shares by-fd blocks answers on an abstract
//! Unix socket (gone with the process, nothing on disk); a request is the
//! segment id, the answer its descriptor by SCM_RIGHTS. A consumer asks
//! once per segment, so descriptors and connections stay O(segments)
//! whatever the number of blocks. Only processes of the same user are
//! answered (SO_PEERCRED), as only they could open a 0600 shm file.

use crate::arena::SharedArena;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;
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
    let mut v = 0u64;
    // SAFETY: getrandom writes at most 8 bytes into v.
    let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut libc::c_void, 8, 0) };
    if n != 8 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        v = t as u64 ^ ((std::process::id() as u64) << 32);
    }
    v
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

fn serve(listener: UnixListener, arena: SharedArena) {
    let fd = listener.as_raw_fd();
    for conn in listener.incoming() {
        if arena.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            break;
        }
        if let Ok(conn) = conn {
            let _ = answer(&conn, &arena);
        }
    }
    for l in &LISTENERS {
        let _ = l.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire);
    }
}

fn same_user(sock: RawFd) -> bool {
    // SAFETY: plain data filled by getsockopt.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for the call.
    let rc = unsafe { libc::getsockopt(sock, libc::SOL_SOCKET, libc::SO_PEERCRED, &mut cred as *mut _ as *mut libc::c_void, &mut len) };
    // SAFETY: geteuid cannot fail.
    rc == 0 && (cred.uid == unsafe { libc::geteuid() } || cred.uid == 0)
}

fn answer(conn: &UnixStream, arena: &SharedArena) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
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

/// Asks the server `name` for the descriptor of segment `segment_id`.
pub fn fetch(name: &str, segment_id: u64, timeout: Duration) -> Result<OwnedFd> {
    let what = format!("arena fd server <@{name}>");
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| io_err(e, &what))?;
    let conn = UnixStream::connect_addr(&addr).map_err(|e| {
        Error::new(ErrorKind::PeerGone, format!("{what}: {e} (the process that shared the block exited before it was opened)"))
    })?;
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
