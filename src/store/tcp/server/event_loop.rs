//! The server's one thread: an epoll loop over the listening socket and every
//! connection, all non-blocking. Each readiness event costs one read; every
//! whole request in it is answered, and the replies go out in one write.
//!
//! What a peer can do to it, and what it costs:
//! - a peer that stops reading: its replies queue up to [`OUT_HIGH`], then
//!   its requests are no longer read; if a write makes no progress for
//!   [`WRITE_TIMEOUT`] it is closed. Nobody else waits on it.
//! - half a request: kept (only the bytes that came) until the rest comes;
//!   an idle connection costs a descriptor and a few hundred bytes.
//! - an over-limit request (more than `MAX_KEYS` keys, a key over
//!   `MAX_KEY_LEN` or a value over `MAX_VALUE_LEN`, PyTorch's libuv
//!   server's limits): refused by the scanner as soon as the count or
//!   length arrives, and that connection is closed; nothing is allocated
//!   ahead of the bytes, and other connections go on.
//! - many parked waits: indexed by key in the state, so another client's
//!   `SET`/`ADD` costs the same however many keys are waited on.
//! - running out of descriptors: the listener is left alone for
//!   [`ACCEPT_RETRY`] instead of failing accept in a spin.
//! - many connections: past [`ServerLimits`]' bound per peer address or in
//!   all (at most half the descriptor limit), a new connection is closed
//!   as soon as it is accepted; the others go on.
//! - big unfinished requests: one connection's may not pass its bound, and
//!   past the bound of all of them together, a connection whose unfinished
//!   request is over [`SMALL_REQUEST`] is closed.

use super::limits::{ServerLimits, SMALL_REQUEST};
use super::state::{ConnId, State};
use crate::poller::{Bell, Poller, READABLE, WRITABLE};
use crate::store::tcp::protocol::{parse_request, Request, RequestScanner, VALIDATION_MAGIC, WAIT_STOP_WAITING};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a connection's replies may wait to be written before it is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often connections with replies waiting are checked against it.
const SWEEP: Duration = Duration::from_secs(1);
/// How long the listener rests after a failed accept (out of descriptors).
const ACCEPT_RETRY: Duration = Duration::from_millis(20);
/// Reply bytes waiting for a peer beyond which its requests are not read.
const OUT_HIGH: usize = 1 << 20;
/// Bytes taken from a socket per readiness event.
const READ_CHUNK: usize = 64 * 1024;
/// A connection's reply buffer is given back above this size once empty.
const OUT_KEEP: usize = 64 * 1024;

const LISTENER: u64 = 0;
const BELL: u64 = 1;
const FIRST_CONN: u64 = 2;

struct Conn {
    stream: TcpStream,
    peer: IpAddr,
    /// The start of a request that has not fully arrived.
    input: Vec<u8>,
    scanner: RequestScanner,
    /// Replies; `out[sent..]` is still to be written.
    out: Vec<u8>,
    sent: usize,
    validated: bool,
    /// Whole requests wait in `input`, not read while replies are backed up.
    backlog: bool,
    /// Nothing more is read: the replies are written, then it is closed.
    closing: bool,
    interest: u32,
    /// Since when replies have waited with no write making progress.
    stalled_since: Option<Instant>,
}

impl Conn {
    fn pending(&self) -> usize {
        self.out.len() - self.sent
    }
}

pub struct EventLoop {
    poller: Poller,
    bell: Arc<Bell>,
    listener: TcpListener,
    listener_resumes: Option<Instant>,
    conns: Vec<Option<Conn>>,
    free: Vec<ConnId>,
    /// Slots closed during this batch of events, reused after it (a stale
    /// event must not reach a new connection).
    freed: Vec<ConnId>,
    state: State,
    scratch: Vec<u8>,
    woken: Vec<ConnId>,
    /// Connections owed a write at the end of this batch.
    dirty: Vec<ConnId>,
    /// Connections watched for writability (replies waiting).
    writers: usize,
    next_sweep: Instant,
    limits: ServerLimits,
    /// Open connections, in all and per peer address.
    open: usize,
    per_peer: HashMap<IpAddr, usize>,
    /// Bytes of unfinished requests held in all connections' `input`.
    buffered: usize,
}

impl EventLoop {
    pub fn new(listener: TcpListener, bell: Arc<Bell>, limits: ServerLimits) -> std::io::Result<EventLoop> {
        listener.set_nonblocking(true)?;
        let poller = Poller::new()?;
        poller.add(listener.as_raw_fd(), READABLE, LISTENER)?;
        poller.add(bell.raw(), READABLE, BELL)?;
        Ok(EventLoop {
            poller,
            bell,
            listener,
            listener_resumes: None,
            conns: Vec::new(),
            free: Vec::new(),
            freed: Vec::new(),
            state: State::default(),
            scratch: vec![0; READ_CHUNK],
            woken: Vec::new(),
            dirty: Vec::new(),
            writers: 0,
            next_sweep: Instant::now(),
            limits,
            open: 0,
            per_peer: HashMap::new(),
            buffered: 0,
        })
    }

    /// Serves until the bell rings, then closes every connection.
    pub fn run(mut self) {
        let mut events = Vec::with_capacity(256);
        loop {
            if self.poller.wait(&mut events, self.timeout()).is_err() {
                break;
            }
            let mut stop = false;
            for ev in &events {
                match ev.u64 {
                    LISTENER => self.accept(),
                    BELL => stop = true,
                    token => self.conn_event((token - FIRST_CONN) as ConnId, ev.events),
                }
            }
            if stop {
                break;
            }
            while let Some(id) = self.dirty.pop() {
                self.pump(id);
            }
            self.free.append(&mut self.freed);
            self.timers();
        }
        for c in self.conns.drain(..).flatten() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        drop(self.bell);
    }

    fn timeout(&self) -> Option<Duration> {
        let mut until = self.listener_resumes;
        if self.writers > 0 {
            until = Some(until.map_or(self.next_sweep, |u| u.min(self.next_sweep)));
        }
        until.map(|u| u.saturating_duration_since(Instant::now()))
    }

    fn timers(&mut self) {
        if self.listener_resumes.is_none() && self.writers == 0 {
            return;
        }
        let now = Instant::now();
        if self.listener_resumes.is_some_and(|t| now >= t) {
            self.listener_resumes = None;
            let _ = self.poller.modify(self.listener.as_raw_fd(), READABLE, LISTENER);
        }
        if self.writers > 0 && now >= self.next_sweep {
            self.next_sweep = now + SWEEP;
            let stalled: Vec<ConnId> = (0..self.conns.len())
                .filter(|&i| self.conns[i].as_ref().is_some_and(|c| c.stalled_since.is_some_and(|t| now - t >= WRITE_TIMEOUT)))
                .collect();
            for id in stalled {
                self.close(id);
            }
            self.free.append(&mut self.freed);
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, addr)) => self.admit(stream, addr.ip()),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::ConnectionAborted => {}
                Err(_) => {
                    // Out of descriptors (EMFILE/ENFILE) or memory: the
                    // connection stays queued and accept would fail again
                    // at once; rest the listener instead of spinning on it.
                    let _ = self.poller.modify(self.listener.as_raw_fd(), 0, LISTENER);
                    self.listener_resumes = Some(Instant::now() + ACCEPT_RETRY);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, stream: TcpStream, peer: IpAddr) {
        let of_peer = self.per_peer.get(&peer).copied().unwrap_or(0);
        if self.open >= self.limits.connections_now() || of_peer >= self.limits.connections_per_peer {
            // Over a bound: closed at once (dropping the stream), so the
            // peer sees the refusal instead of a connection never served.
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let _ = stream.set_nodelay(true);
        let id = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        if self.poller.add(stream.as_raw_fd(), READABLE, id as u64 + FIRST_CONN).is_err() {
            self.free.push(id);
            return;
        }
        self.open += 1;
        *self.per_peer.entry(peer).or_default() += 1;
        self.conns[id] = Some(Conn {
            stream,
            peer,
            input: Vec::new(),
            scanner: RequestScanner::new(),
            out: Vec::new(),
            sent: 0,
            validated: false,
            backlog: false,
            closing: false,
            interest: READABLE,
            stalled_since: None,
        });
    }

    fn conn_event(&mut self, id: ConnId, events: u32) {
        let Some(conn) = self.conns.get_mut(id).and_then(Option::as_mut) else { return };
        let hangup = (libc::EPOLLHUP | libc::EPOLLERR) as u32;
        if events & (READABLE | hangup) != 0 && conn.interest & READABLE != 0 {
            match (&conn.stream).read(&mut self.scratch) {
                // End of stream: answer what came, then close.
                Ok(0) => conn.closing = true,
                Ok(n) => {
                    let before = conn.input.len();
                    take_requests(&mut self.state, conn, id, &self.scratch[..n], &mut self.woken);
                    let after = conn.input.len();
                    if after == 0 && conn.input.capacity() > READ_CHUNK {
                        // A big request's room is given back once answered.
                        conn.input = Vec::new();
                    }
                    self.buffered = self.buffered - before + after;
                    self.deliver_woken(id);
                    let over_own = after > self.limits.request_bytes_per_connection;
                    let over_all = self.buffered > self.limits.request_bytes && after > SMALL_REQUEST;
                    if over_own || over_all {
                        return self.close(id);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => return,
                Err(_) => return self.close(id),
            }
        }
        self.pump(id);
    }

    /// Owes each connection whose wait the last requests completed its
    /// `u8 0` (`id`'s own were queued in order already).
    fn deliver_woken(&mut self, id: ConnId) {
        for w in self.woken.drain(..) {
            if let Some(c) = self.conns[w].as_mut() {
                c.out.push(WAIT_STOP_WAITING);
                if w != id {
                    self.dirty.push(w);
                }
            }
        }
    }

    /// Writes a connection's replies, answers requests that waited for
    /// them to drain, and sets what it is watched for (or closes it).
    fn pump(&mut self, id: ConnId) {
        loop {
            let Some(conn) = self.conns[id].as_mut() else { return };
            let before = conn.pending();
            while conn.pending() > 0 {
                match (&conn.stream).write(&conn.out[conn.sent..]) {
                    Ok(n) => conn.sent += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => return self.close(id),
                }
            }
            if conn.pending() == 0 {
                conn.out.clear();
                conn.sent = 0;
                if conn.out.capacity() > OUT_KEEP {
                    conn.out = Vec::new();
                }
                conn.stalled_since = None;
            } else if conn.pending() < before || conn.stalled_since.is_none() {
                conn.stalled_since = Some(Instant::now());
            }
            if conn.closing && conn.pending() == 0 {
                return self.close(id);
            }
            if conn.backlog && !conn.closing && conn.pending() < OUT_HIGH {
                conn.backlog = false;
                let input = std::mem::take(&mut conn.input);
                let used = answer(&mut self.state, conn, id, &input, &mut self.woken);
                conn.input = input;
                conn.input.drain(..used);
                self.buffered -= used;
                self.deliver_woken(id);
                continue;
            }
            break;
        }
        let Some(conn) = self.conns[id].as_mut() else { return };
        let pending = conn.pending() > 0;
        let want = if conn.closing || conn.backlog { 0 } else { READABLE } | if pending { WRITABLE } else { 0 };
        if want != conn.interest {
            if self.poller.modify(conn.stream.as_raw_fd(), want, id as u64 + FIRST_CONN).is_err() {
                return self.close(id);
            }
            match (conn.interest & WRITABLE != 0, want & WRITABLE != 0) {
                (false, true) => self.writers += 1,
                (true, false) => self.writers -= 1,
                _ => {}
            }
            conn.interest = want;
        }
    }

    fn close(&mut self, id: ConnId) {
        let Some(conn) = self.conns[id].take() else { return };
        if conn.interest & WRITABLE != 0 {
            self.writers -= 1;
        }
        self.buffered -= conn.input.len();
        self.open -= 1;
        if let Some(n) = self.per_peer.get_mut(&conn.peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&conn.peer);
            }
        }
        self.state.drop_conn(id);
        let _ = conn.stream.shutdown(Shutdown::Both);
        self.freed.push(id);
    }
}

/// Answers the whole requests in `conn.input` followed by `fresh` bytes,
/// and keeps the part of a request that has not fully arrived (or, with
/// replies backed up, the requests not answered yet).
fn take_requests(state: &mut State, conn: &mut Conn, id: ConnId, fresh: &[u8], woken: &mut Vec<ConnId>) {
    if conn.input.is_empty() {
        // The common case: answered straight from the read, no copy.
        let used = answer(state, conn, id, fresh, woken);
        if !conn.closing {
            conn.input.extend_from_slice(&fresh[used..]);
        }
        return;
    }
    conn.input.extend_from_slice(fresh);
    let input = std::mem::take(&mut conn.input);
    let used = answer(state, conn, id, &input, woken);
    conn.input = input;
    conn.input.drain(..used);
}

/// Answers whole requests from the start of `buf`; returns the bytes used.
fn answer(state: &mut State, conn: &mut Conn, id: ConnId, buf: &[u8], woken: &mut Vec<ConnId>) -> usize {
    let mut used = 0;
    while !conn.closing {
        if conn.pending() >= OUT_HIGH {
            conn.backlog = true;
            break;
        }
        // Find the request's end first (no byte scanned twice), then
        // build it once.
        let n = match conn.scanner.scan(&buf[used..]) {
            Ok(Some(n)) => n,
            Ok(None) => break,
            Err(_) => {
                conn.closing = true;
                break;
            }
        };
        let req = match parse_request(&buf[used..used + n]) {
            Ok(Some((req, m))) if m == n => req,
            _ => {
                conn.closing = true;
                break;
            }
        };
        used += n;
        if !conn.validated {
            conn.validated = req == Request::Validate(VALIDATION_MAGIC);
            conn.closing = !conn.validated;
            continue;
        }
        let mark = conn.out.len();
        if state.apply(req, id, &mut conn.out, woken).is_err() {
            conn.out.truncate(mark);
            conn.closing = true;
            break;
        }
        // A wait this request completed on its own connection is
        // answered before the request itself.
        let own = woken.iter().filter(|&&w| w == id).count();
        if own > 0 {
            woken.retain(|&w| w != id);
            conn.out.splice(mark..mark, std::iter::repeat(WAIT_STOP_WAITING).take(own));
        }
    }
    used
}
