//! The producer's server: a thread that listens on an abstract
//! `SOCK_SEQPACKET` socket, admits consumers of this user (`SO_PEERCRED`),
//! gives each a slot of the control block, sends it the control block,
//! the segments and the manifest, and then watches its connection: the
//! connection is the consumer's liveness, so when it hangs up (exit,
//! crash, kill -9) its slot is cleared and an update waiting for it goes on.

use super::options::PoolKind;
use super::producer::PoolInner;
use super::wire::{Hello, CHUNK, STATUS_FULL, STATUS_OK};
use crate::error::{Error, Result};
use crate::fdpass::parent_only::ParentOnlyFd;
use crate::fdpass::{abstract_socket, peer, send_fds};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// How long a consumer may leave the server's messages unread before it
/// is dropped (a stalled consumer must not stall the others).
const SEND_TIMEOUT_S: i64 = 10;

pub(crate) struct Server {
    name: String,
    wake: OwnedFd,
    thread: Option<JoinHandle<()>>,
    /// Says when the consumers were told the pool is gone (linger).
    told: Receiver<()>,
}

struct Conn {
    /// Not inherited by forked children: its hang-up is the consumer's death.
    fd: ParentOnlyFd,
    slot: usize,
}

impl Server {
    pub fn start(inner: Arc<PoolInner>) -> Result<Server> {
        let name = abstract_socket::unique_name_with("ss_pool");
        let listener = abstract_socket::listen(&name).map_err(|e| io_err(e, format!("listening on the pool socket {name}")))?;
        // A forked child keeping the name bound would take (and never
        // answer) connections after this process is gone.
        let listener = ParentOnlyFd::new(listener);
        // SAFETY: eventfd takes plain integers.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(Error::last_os_error("eventfd for the pool server"));
        }
        // SAFETY: a fresh descriptor of ours.
        let wake = unsafe { OwnedFd::from_raw_fd(raw) };
        let wake_fd = wake.try_clone().map_err(|e| io_err(e, "dup of the pool server's eventfd".into()))?;
        let (tell, told) = channel();
        let thread = std::thread::Builder::new()
            .name("ss-pool-server".into())
            .spawn(move || serve(inner, listener, wake_fd, tell))
            .map_err(|e| io_err(e, "starting the pool server thread".into()))?;
        Ok(Server { name, wake, thread: Some(thread), told })
    }

    pub fn socket_name(&self) -> &str {
        &self.name
    }
}

impl Server {
    fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Stops taking consumers but serves the connected ones until they
    /// all hang up, then ends (dropping the pool's memory). For a Legacy
    /// pool dropped while consumers map its memory.
    pub fn linger(mut self) {
        self.wake();
        // Once this returns, every consumer's next call reports the producer gone.
        let _ = self.told.recv_timeout(std::time::Duration::from_secs(5));
        drop(self.thread.take());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn io_err(e: std::io::Error, what: String) -> Error {
    Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), what)
}

fn serve(inner: Arc<PoolInner>, listener: ParentOnlyFd, wake: OwnedFd, told: Sender<()>) {
    let mut conns: Vec<Conn> = Vec::new();
    let mut listener = Some(listener);
    loop {
        if listener.is_none() && conns.is_empty() {
            break;
        }
        // A closed listener polls as -1 (ignored).
        let listening = listener.as_ref().map_or(-1, |l| l.as_raw_fd());
        let mut fds = vec![
            libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: listening, events: libc::POLLIN, revents: 0 },
        ];
        fds.extend(conns.iter().map(|c| libc::pollfd { fd: c.fd.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }));
        // SAFETY: fds is a valid array of pollfd for the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            if crate::error::errno() == libc::EINTR {
                continue;
            }
            crate::log::warn(&format!("pool server: poll failed: {}; the server stops", std::io::Error::last_os_error()));
            break;
        }
        if fds[0].revents != 0 {
            let mut count = 0u64;
            // SAFETY: reads 8 bytes from our eventfd (clearing it).
            unsafe { libc::read(wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
            if !inner.linger.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            // The name goes now: no new consumer can connect; those
            // connected are told the producer is gone (their next call
            // says so) and keep their mappings until they hang up.
            listener = None;
            for c in &conns {
                let _ = send_fds(c.fd.as_raw_fd(), b"bye", &[]);
            }
            let _ = told.send(());
            continue;
        }
        // Consumers that hung up (or sent anything: they never should).
        let mut gone = Vec::new();
        for (i, p) in fds[2..].iter().enumerate() {
            if p.revents != 0 {
                gone.push(i);
            }
        }
        for i in gone.into_iter().rev() {
            let c = conns.swap_remove(i);
            drop_consumer(&inner, c);
        }
        if let (Some(l), true) = (listener.as_ref(), fds[1].revents != 0) {
            accept_all(&inner, l.as_raw_fd(), &mut conns);
        }
    }
    for c in conns {
        drop_consumer(&inner, c);
    }
}

fn drop_consumer(inner: &PoolInner, c: Conn) {
    inner.control.clear_slot(c.slot);
    super::lock(&inner.consumers)[c.slot] = None;
}

fn accept_all(inner: &PoolInner, listener: RawFd, conns: &mut Vec<Conn>) {
    loop {
        let conn = match abstract_socket::accept(listener) {
            Ok(c) => ParentOnlyFd::new(c),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => {
                crate::log::warn(&format!("pool server: accept failed: {e}"));
                return;
            }
        };
        // Only this user's processes get the pool (the name is public).
        let pid = match peer::credentials(conn.as_raw_fd()) {
            Ok((pid, uid)) if uid == peer::my_uid() => pid,
            _ => continue,
        };
        set_send_timeout(conn.as_raw_fd());
        let slot = {
            let mut consumers = super::lock(&inner.consumers);
            let free = consumers.iter().position(Option::is_none);
            if let Some(s) = free {
                consumers[s] = Some(pid);
            }
            free
        };
        let Some(slot) = slot else {
            refuse_full(inner, conn.as_raw_fd());
            continue;
        };
        // A slot freed by a consumer that died holding it is clear already;
        // clear it again in case a consumer wrote it after its hang-up was seen.
        inner.control.clear_slot(slot);
        if send_pool(inner, conn.as_raw_fd(), slot).is_ok() {
            conns.push(Conn { fd: conn, slot });
        } else {
            drop_consumer(inner, Conn { fd: conn, slot });
        }
    }
}

fn set_send_timeout(fd: RawFd) {
    let tv = libc::timeval { tv_sec: SEND_TIMEOUT_S, tv_usec: 0 };
    // SAFETY: a timeval of the right size for SO_SNDTIMEO.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, (&tv as *const libc::timeval).cast(), std::mem::size_of_val(&tv) as u32)
    };
}

fn refuse_full(inner: &PoolInner, fd: RawFd) {
    let hello = Hello {
        status: STATUS_FULL,
        kind: inner.opts.kind.code(),
        slot: 0,
        slots: inner.opts.max_consumers as u32,
        segments: 0,
        manifest_len: 0,
    };
    let mut msg = hello.encode().to_vec();
    msg.extend_from_slice(format!("the pool has {} consumers connected, its max_consumers", inner.opts.max_consumers).as_bytes());
    let _ = send_fds(fd, &msg, &[]);
}

fn send_pool(inner: &PoolInner, fd: RawFd, slot: usize) -> Result<()> {
    let layout = super::lock(&inner.layout);
    let manifest = layout.frozen.clone().expect("the server starts after the manifest is frozen");
    let mut fds = vec![inner.control_fd.as_raw_fd()];
    if inner.opts.kind == PoolKind::Vmm {
        fds.extend(layout.segments.iter().map(|s| s.fd().expect("a Vmm segment has a descriptor").as_raw_fd()));
    }
    let hello = Hello {
        status: STATUS_OK,
        kind: inner.opts.kind.code(),
        slot: slot as u32,
        slots: inner.opts.max_consumers as u32,
        segments: layout.segments.len() as u32,
        manifest_len: manifest.len() as u64,
    };
    send_fds(fd, &hello.encode(), &fds)?;
    drop(layout);
    for chunk in manifest.chunks(CHUNK) {
        send_fds(fd, chunk, &[])?;
    }
    Ok(())
}
