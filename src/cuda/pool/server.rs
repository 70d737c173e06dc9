//! The producer's server: a thread that listens on an abstract
//! `SOCK_SEQPACKET` socket, admits consumers of this user (`SO_PEERCRED`),
//! gives each a slot and a hold page of its own, sends it the control
//! block, its hold page, the segments and the manifest, and then watches
//! its connection: the connection is the consumer's liveness, so when it
//! hangs up (exit, crash, kill -9) its slot goes, and an update waiting
//! for it goes on.
//!
//! One poll loop serves every connection and never waits on any one of
//! them: sends are non-blocking and resume when the socket is writable, so
//! a consumer that does not read costs only its own connection, which is
//! dropped once its budget ([`BUDGET`]) to take the pool runs out. Hang-ups
//! are seen at the next turn of the loop whatever the other connections
//! do, and stopping the server (dropping the pool) waits on no peer.

use super::control::HoldSlot;
use super::inner::{Consumer, PoolInner};
use super::options::PoolKind;
use super::wire::{Hello, CHUNK, STATUS_FULL, STATUS_OK};
use crate::error::{Error, Result};
use crate::fdpass::parent_only::ParentOnlyFd;
use crate::fdpass::{abstract_socket, peer, send_fds_nowait};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a consumer may take to read the pool (hello and manifest)
/// before its connection and slot are dropped.
pub const BUDGET: Duration = Duration::from_secs(10);
/// How long the server stops accepting after the process ran out of
/// descriptors (the connections wait in the backlog meanwhile).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// Connections accepted per turn of the loop, so that a flood of them
/// cannot delay the hang-ups of the connected consumers.
const ACCEPTS_PER_TURN: usize = 64;

pub(crate) struct Server {
    name: String,
    wake: OwnedFd,
    thread: Option<JoinHandle<()>>,
    /// Says when the consumers were told the pool is gone (linger).
    told: Receiver<()>,
}

/// What is left to send a consumer.
struct Sending {
    /// The hello and the consumer's hold page, until the hello went (with
    /// the control block's, the page's and (Vmm) the segments' descriptors).
    hello: Option<(Hello, OwnedFd)>,
    /// Manifest bytes sent.
    sent: usize,
    deadline: Instant,
}

struct Conn {
    /// Not inherited by forked children: its hang-up is the consumer's death.
    fd: ParentOnlyFd,
    slot: usize,
    pid: i32,
    /// None once the consumer has the whole pool.
    sending: Option<Sending>,
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
            .spawn(move || Serving::new(inner, listener, wake_fd, tell).run())
            .map_err(|e| io_err(e, "starting the pool server thread".into()))?;
        Ok(Server { name, wake, thread: Some(thread), told })
    }

    pub fn socket_name(&self) -> &str {
        &self.name
    }

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
        // Once this returns, every consumer's next call reports the producer
        // gone. The loop answers at its next turn; the bound is only there
        // in case the thread is gone.
        let _ = self.told.recv_timeout(Duration::from_secs(5));
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

/// The server thread's state.
struct Serving {
    inner: Arc<PoolInner>,
    listener: Option<ParentOnlyFd>,
    wake: OwnedFd,
    told: Sender<()>,
    conns: Vec<Conn>,
    /// No accepting before this (the process ran out of descriptors).
    paused_until: Option<Instant>,
    /// Whether running out of descriptors was logged since the last accept.
    starved_logged: bool,
}

impl Serving {
    fn new(inner: Arc<PoolInner>, listener: ParentOnlyFd, wake: OwnedFd, told: Sender<()>) -> Serving {
        Serving { inner, listener: Some(listener), wake, told, conns: Vec::new(), paused_until: None, starved_logged: false }
    }

    fn run(mut self) {
        while self.listener.is_some() || !self.conns.is_empty() {
            let now = Instant::now();
            if self.paused_until.is_some_and(|t| now >= t) {
                self.paused_until = None;
            }
            // A closed or paused listener polls as -1 (ignored).
            let listening = match (&self.listener, self.paused_until) {
                (Some(l), None) => l.as_raw_fd(),
                _ => -1,
            };
            let mut fds = vec![
                libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: listening, events: libc::POLLIN, revents: 0 },
            ];
            fds.extend(self.conns.iter().map(|c| {
                let out = if c.sending.is_some() { libc::POLLOUT } else { 0 };
                libc::pollfd { fd: c.fd.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP | out, revents: 0 }
            }));
            let next = self.conns.iter().filter_map(|c| c.sending.as_ref().map(|s| s.deadline)).chain(self.paused_until).min();
            let timeout_ms =
                next.map_or(-1, |t| (t.saturating_duration_since(now).as_millis().min(i32::MAX as u128) as i32).saturating_add(1));
            // SAFETY: fds is a valid array of pollfd for the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if n < 0 {
                if crate::error::errno() == libc::EINTR {
                    continue;
                }
                crate::log::warn(&format!("pool server: poll failed: {}; the server stops", std::io::Error::last_os_error()));
                break;
            }
            if fds[0].revents != 0 && !self.woken() {
                break;
            }
            self.serve_conns(&fds[2..]);
            if fds[1].revents != 0 {
                self.accept_some();
            }
        }
        for c in std::mem::take(&mut self.conns) {
            self.drop_consumer(c);
        }
    }

    /// The pool is going: false to stop now, true to linger (a Legacy
    /// pool whose consumers map its memory).
    fn woken(&mut self) -> bool {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes from our eventfd (clearing it).
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        if !self.inner.linger.load(std::sync::atomic::Ordering::SeqCst) {
            return false;
        }
        // The name goes now: no new consumer can connect. Those that have
        // the pool are told the producer is gone (their next call says so)
        // and keep their mappings until they hang up. One that has not
        // read it all has mapped nothing, and one whose buffer has no room
        // for the word has not read it all: both are let go now.
        self.listener = None;
        for c in std::mem::take(&mut self.conns) {
            let told = c.sending.is_none() && matches!(send_fds_nowait(c.fd.as_raw_fd(), b"bye", &[]), Ok(Some(_)));
            if told {
                self.conns.push(c);
            } else {
                self.drop_consumer(c);
            }
        }
        let _ = self.told.send(());
        true
    }

    /// Drops the connections that hung up (or sent anything: consumers
    /// never do) or ran out of budget, and sends on to the writable ones.
    fn serve_conns(&mut self, polled: &[libc::pollfd]) {
        let now = Instant::now();
        let mut keep = Vec::with_capacity(self.conns.len());
        for (mut c, p) in std::mem::take(&mut self.conns).into_iter().zip(polled) {
            let hung_up = p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0;
            let alive = !hung_up && (c.sending.is_none() || self.send_some(&mut c, now));
            if alive {
                keep.push(c);
            } else {
                self.drop_consumer(c);
            }
        }
        self.conns = keep;
    }

    /// Sends what the socket takes now; false when the connection is to
    /// be dropped (an error, or its budget ran out).
    fn send_some(&self, c: &mut Conn, now: Instant) -> bool {
        let Some(s) = c.sending.as_mut() else { return true };
        match send_pending(&self.inner, c.fd.as_raw_fd(), s) {
            Ok(true) => {
                c.sending = None;
                true
            }
            Ok(false) if now < s.deadline => true,
            Ok(false) => {
                crate::log::warn(&format!(
                    "pool server: consumer pid {} did not read the pool within {BUDGET:?}; its connection is dropped",
                    c.pid
                ));
                false
            }
            Err(_) => false,
        }
    }

    fn drop_consumer(&self, c: Conn) {
        let gone = super::lock(&self.inner.consumers)[c.slot].take();
        if let Some(consumer) = gone {
            // Wakes an update waiting for this consumer's hold.
            consumer.slot.let_go();
        }
        // Whatever a consumer could write in the control block (a kernel
        // without write seals lets it) is undone when it goes.
        if !self.inner.control.write_protected() {
            self.inner.control.restore();
        }
    }

    fn accept_some(&mut self) {
        let Some(listener) = self.listener.as_ref().map(|l| l.as_raw_fd()) else { return };
        for _ in 0..ACCEPTS_PER_TURN {
            let conn = match abstract_socket::accept(listener) {
                Ok(c) => ParentOnlyFd::new(c),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
                    self.starved(&format!("accept failed: {e}"));
                    return;
                }
                // The connecting side went away first (ECONNABORTED), and the like.
                Err(_) => continue,
            };
            // Only this user's processes get the pool (the name is public);
            // another user's connection is closed at once, costing nothing.
            let pid = match peer::credentials(conn.as_raw_fd()) {
                Ok((pid, uid)) if uid == peer::my_uid() => pid,
                _ => continue,
            };
            match self.admit(conn, pid) {
                Ok(Some(c)) => {
                    self.starved_logged = false;
                    self.conns.push(c);
                }
                Ok(None) => {}
                Err(e) => {
                    self.starved(&e.to_string());
                    return;
                }
            }
        }
    }

    /// The process is out of descriptors (or memory): accepting again at
    /// once would fail again at once, so the pending connections wait in
    /// the backlog a while. Logged once until a consumer gets in.
    fn starved(&mut self, what: &str) {
        if !self.starved_logged {
            crate::log::warn(&format!("pool server: {what}; consumers wait until descriptors are free (logged once until one gets in)"));
            self.starved_logged = true;
        }
        self.paused_until = Some(Instant::now() + ACCEPT_PAUSE);
    }

    /// Gives a new consumer a slot and starts sending it the pool. An
    /// error: this process cannot make the consumer's hold page now (the
    /// consumer was told, and gets `Busy`).
    fn admit(&self, conn: ParentOnlyFd, pid: i32) -> Result<Option<Conn>> {
        let fd = conn.as_raw_fd();
        // SAFETY: fcntl on our own descriptor: its sends never block the
        // loop (the consumer's end is a file of its own, unchanged).
        if unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
            return Ok(None);
        }
        let (hold, hold_fd) = match HoldSlot::create() {
            Ok(made) => made,
            Err(e) => {
                refuse(&self.inner, fd, &format!("the producer could not admit it now ({e}); try again"));
                return Err(e);
            }
        };
        let slot = {
            let mut consumers = super::lock(&self.inner.consumers);
            let free = consumers.iter().position(Option::is_none);
            if let Some(s) = free {
                consumers[s] = Some(Consumer { pid, slot: Arc::new(hold) });
            }
            free
        };
        let Some(slot) = slot else {
            let max = self.inner.opts.max_consumers;
            refuse(&self.inner, fd, &format!("the pool has {max} consumers connected, its max_consumers"));
            return Ok(None);
        };
        let (segments, manifest_len) = {
            let layout = super::lock(&self.inner.layout);
            (layout.segments.len(), layout.frozen.as_ref().map_or(0, |m| m.len()))
        };
        let hello = Hello {
            status: STATUS_OK,
            kind: self.inner.opts.kind.code(),
            slot: slot as u32,
            slots: self.inner.opts.max_consumers as u32,
            segments: segments as u32,
            manifest_len: manifest_len as u64,
        };
        let mut c = Conn {
            fd: conn,
            slot,
            pid,
            sending: Some(Sending { hello: Some((hello, hold_fd)), sent: 0, deadline: Instant::now() + BUDGET }),
        };
        if self.send_some(&mut c, Instant::now()) {
            Ok(Some(c))
        } else {
            self.drop_consumer(c);
            Ok(None)
        }
    }
}

/// Tells a consumer it was not admitted, and why (it gets `Busy`).
fn refuse(inner: &PoolInner, fd: RawFd, why: &str) {
    let hello = Hello {
        status: STATUS_FULL,
        kind: inner.opts.kind.code(),
        slot: 0,
        slots: inner.opts.max_consumers as u32,
        segments: 0,
        manifest_len: 0,
    };
    let mut msg = hello.encode().to_vec();
    msg.extend_from_slice(why.as_bytes());
    let _ = send_fds_nowait(fd, &msg, &[]);
}

/// Sends what the socket takes of the hello and the manifest: true once
/// all went, false when the socket is full for now.
fn send_pending(inner: &PoolInner, fd: RawFd, s: &mut Sending) -> Result<bool> {
    let layout = super::lock(&inner.layout);
    let manifest = layout.frozen.clone().expect("the server starts after the manifest is frozen");
    if let Some((hello, hold_fd)) = s.hello.as_ref() {
        let mut fds = vec![inner.control_fd.as_raw_fd(), hold_fd.as_raw_fd()];
        if inner.opts.kind == PoolKind::Vmm {
            fds.extend(layout.segments.iter().map(|seg| seg.fd().expect("a Vmm segment has a descriptor").as_raw_fd()));
        }
        if send_fds_nowait(fd, &hello.encode(), &fds)?.is_none() {
            return Ok(false);
        }
        s.hello = None;
    }
    drop(layout);
    while s.sent < manifest.len() {
        let end = (s.sent + CHUNK).min(manifest.len());
        match send_fds_nowait(fd, &manifest[s.sent..end], &[])? {
            Some(_) => s.sent = end,
            None => return Ok(false),
        }
    }
    Ok(true)
}
