//! A client of a c10d `TCPStore` server (PyTorch's, or ours), with
//! PyTorch's key prefix, so it sees the same keys as PyTorch ranks of the
//! same job.
//!
//! Every request that the server answers at once goes over one connection,
//! one request at a time under a lock, so a handle's requests reach the
//! server in the order they were made: a thread reads its own writes, and
//! a `set` (which has no reply) is never overtaken by a later request.
//! Only `WAIT`, which may block for long, takes a connection of its own,
//! so a thread waiting for a key never holds up the thread that sets it.

use super::protocol::{self, Request, KEY_PREFIX, VALIDATION_MAGIC};
use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::fork_generation;
use crate::store::deadline::{deadline, remaining, timeout_error, Backoff};
use crate::store::{show_key, Timeout};
use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

/// A `get` first reads with `COMPARE_SET(key, SENTINEL, SENTINEL)`: both
/// PyTorch servers answer it with the current value without changing it,
/// or with `SENTINEL` itself when the key is missing (nothing is created).
/// That is one round trip instead of `WAIT` + `GET`; only an answer equal
/// to the sentinel falls back to waiting. Checked against torch 2.15.
const GET_SENTINEL: &[u8] = b"\0storage-sharing:get-probe\0";

struct Conn {
    stream: TcpStream,
    read_timeout: Option<Duration>,
    /// Reply bytes read but not yet used: one `read` usually brings a
    /// whole reply (length and value), so it costs one system call.
    rbuf: Box<[u8; 4096]>,
    rpos: usize,
    rlen: usize,
}

/// A reply's value is read into a buffer grown by at most this much (or
/// doubled) at a time, so a bogus length costs no more memory than the
/// bytes that really come.
const READ_STEP: usize = 1 << 20;

/// Most idle `WAIT` connections kept for reuse.
const MAX_IDLE: usize = 8;

/// The connections of one process. A child made by fork() must not use
/// its parent's: their sockets are shared with the parent, so replies
/// would go to whichever process reads first, and their locks may be held
/// by parent threads that do not exist in the child. So a child opens its
/// own set (a new, validated connection, as any new client) and never
/// touches the inherited one.
struct Links {
    /// The fork generation (see `fork_safe`) of the process these belong to.
    generation: u64,
    /// The connection of every request but `WAIT`; `None` until opened,
    /// or after an exchange on it failed (its byte stream may be out of
    /// step, so it is closed, never reused).
    main: Mutex<Option<Conn>>,
    /// Idle connections for `WAIT`.
    waiting: Mutex<Vec<Conn>>,
    /// The previous process's set, kept until the client is dropped: a
    /// thread may still be comparing its generation.
    older: *mut Links,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl Links {
    fn new(generation: u64, older: *mut Links) -> Links {
        Links { generation, main: Mutex::new(None), waiting: Mutex::new(Vec::new()), older }
    }

    /// Closes this process's copies of the sockets, where no thread of
    /// the parent held them at the fork (those are left open: their lock
    /// will never be released).
    fn close_inherited(&self) {
        if let Some(mut m) = try_lock(&self.main) {
            m.take();
        }
        if let Some(mut w) = try_lock(&self.waiting) {
            w.clear();
        }
    }
}

/// A client of the TCPStore server at `host:port`. Every method may be
/// called from several threads at once, and in a forked child.
pub struct TcpClient {
    host: String,
    port: u16,
    addr: String,
    /// This process's connections (never NULL; see `Links`).
    links: AtomicPtr<Links>,
    /// How long any single reply may take (the store's timeout).
    reply_timeout: Timeout,
    /// Set once the server closed a connection on `PING`: PyTorch's
    /// servers before 2.5 do not know it, so connections are validated
    /// with `GETNUMKEYS`, which every release answers.
    no_ping: AtomicBool,
}

impl Drop for TcpClient {
    fn drop(&mut self) {
        let mut p = *self.links.get_mut();
        while !p.is_null() {
            // SAFETY: every `Links` was made by Box::into_raw, is reachable
            // once through this chain, and nobody else uses the client now.
            let links = unsafe { Box::from_raw(p) };
            p = links.older;
            links.close_inherited();
            // A parent thread's lock may still be held in the child: leak
            // the (small) set rather than drop a locked mutex.
            let unlocked = try_lock(&links.main).is_some() && try_lock(&links.waiting).is_some();
            if unlocked {
                drop(links);
            } else {
                std::mem::forget(links);
            }
        }
    }
}

fn io_kind(e: &std::io::Error) -> ErrorKind {
    match e.kind() {
        IoKind::UnexpectedEof | IoKind::ConnectionReset | IoKind::ConnectionAborted | IoKind::BrokenPipe => ErrorKind::PeerGone,
        IoKind::WouldBlock | IoKind::TimedOut => ErrorKind::Timeout,
        _ => e.raw_os_error().map_or(ErrorKind::Io, crate::error::kind_of_errno),
    }
}

impl TcpClient {
    /// Connects to `host:port`, retrying while nobody listens yet (ranks
    /// start in any order) until `timeout`, then validates the connection
    /// as PyTorch's client does (`VALIDATE` magic, then a `PING`; for a
    /// server older than `PING`, `GETNUMKEYS`).
    pub fn connect(host: &str, port: u16, timeout: Timeout) -> Result<TcpClient> {
        let addr = format!("{host}:{port}");
        let links = Box::into_raw(Box::new(Links::new(fork_generation(), std::ptr::null_mut())));
        let client = TcpClient {
            host: host.to_string(),
            port,
            addr,
            links: AtomicPtr::new(links),
            reply_timeout: timeout,
            no_ping: AtomicBool::new(false),
        };
        let end = deadline(timeout);
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
        let conn = loop {
            match client.open_conn() {
                Ok(c) => break c,
                Err(e) if e.kind() == ErrorKind::PeerGone && remaining(end).map_or(true, |d| !d.is_zero()) => backoff.sleep(end),
                Err(e) if e.kind() == ErrorKind::PeerGone => {
                    let waited = timeout.map_or(0, |t| t.as_millis());
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("timed out after {waited} ms connecting to TCPStore at {}: {}", client.addr, e.message()),
                    ));
                }
                Err(e) => return Err(e),
            }
        };
        *lock(&client.links().main) = Some(conn);
        Ok(client)
    }

    /// This process's connections: after a fork, the child's first call
    /// makes its own set (no system call to find out: see `fork_safe`).
    fn links(&self) -> &Links {
        let generation = fork_generation();
        loop {
            let current = self.links.load(Ordering::Acquire);
            // SAFETY: never NULL, and every `Links` lives as long as the client.
            let links = unsafe { &*current };
            if links.generation == generation {
                return links;
            }
            let fresh = Box::into_raw(Box::new(Links::new(generation, current)));
            match self.links.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => links.close_inherited(),
                Err(_) => {
                    // Another thread of the child made them first: use those.
                    // SAFETY: ours, never published.
                    drop(unsafe { Box::from_raw(fresh) });
                }
            }
        }
    }

    /// One new, validated connection (no retry).
    fn open_conn(&self) -> Result<Conn> {
        if !self.no_ping.load(Ordering::Relaxed) {
            if let Some(conn) = self.open_conn_with_ping()? {
                return Ok(conn);
            }
            self.no_ping.store(true, Ordering::Relaxed);
        }
        let mut conn = self.new_conn()?;
        let mut out = Request::Validate(VALIDATION_MAGIC).to_bytes();
        Request::GetNumKeys.encode(&mut out);
        let keys = self.run(&mut conn, &out, self.reply_timeout, |c| c.read_i64())?;
        if keys < 0 {
            return Err(self.protocol(format!("GETNUMKEYS answered {keys}, a negative count")));
        }
        Ok(conn)
    }

    /// `None` when the server closed the connection on `PING`: one from
    /// before `PING` (PyTorch 2.4 and older) drops a client that sends a
    /// query it does not know.
    fn open_conn_with_ping(&self) -> Result<Option<Conn>> {
        let mut conn = self.new_conn()?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        // SAFETY: getpid has no preconditions; the nonce only needs to vary.
        let nonce = (unsafe { libc::getpid() } as u32).rotate_left(16) ^ nanos;
        let mut out = Request::Validate(VALIDATION_MAGIC).to_bytes();
        Request::Ping(nonce).encode(&mut out);
        let echoed = match self.run(&mut conn, &out, self.reply_timeout, |c| c.read_u32()) {
            Ok(v) => v,
            Err(e) if e.kind() == ErrorKind::PeerGone => return Ok(None),
            Err(e) => return Err(e),
        };
        if echoed != nonce {
            return Err(self.protocol(format!("PING answered with {echoed:#x}, expected {nonce:#x}")));
        }
        Ok(Some(conn))
    }

    fn new_conn(&self) -> Result<Conn> {
        let stream = Self::try_connect(&self.host, self.port, &self.addr)?;
        let _ = stream.set_nodelay(true);
        Ok(Conn { stream, read_timeout: None, rbuf: Box::new([0; 4096]), rpos: 0, rlen: 0 })
    }

    fn try_connect(host: &str, port: u16, addr: &str) -> Result<TcpStream> {
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("cannot resolve TCPStore host {addr}: {e}")))?
            .collect();
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect(a) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        let e = last.map_or_else(|| "no address".to_string(), |e| e.to_string());
        Err(Error::new(ErrorKind::PeerGone, format!("cannot connect to TCPStore at {addr}: {e}")))
    }

    /// `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn protocol(&self, what: String) -> Error {
        Error::new(ErrorKind::Protocol, format!("TCPStore at {}: {what}", self.addr))
    }

    /// Sends `bytes` on the main connection (opened first if there is
    /// none), then reads the reply with `read`, all under the main lock.
    /// The connection stays only if the whole exchange worked and left no
    /// unread bytes.
    fn exchange<T>(&self, bytes: &[u8], read: impl FnOnce(&mut Reader<'_>) -> Result<T>) -> Result<T> {
        self.within_limits(bytes)?;
        let mut main = lock(&self.links().main);
        let mut conn = match main.take() {
            Some(c) => c,
            None => self.open_conn()?,
        };
        let result = self.run(&mut conn, bytes, self.reply_timeout, read);
        if result.is_ok() && conn.rpos == conn.rlen {
            *main = Some(conn);
        }
        result
    }

    /// Sends a request that has no reply (`SET`) on the main connection.
    /// A connection the server closed meanwhile would swallow it silently,
    /// so it is checked first and replaced by a new one (which reports a
    /// server that is gone).
    fn send_only(&self, bytes: &[u8]) -> Result<()> {
        self.within_limits(bytes)?;
        let mut main = lock(&self.links().main);
        let mut conn = match main.take().filter(Conn::still_open) {
            Some(c) => c,
            None => self.open_conn()?,
        };
        self.run(&mut conn, bytes, self.reply_timeout, |_| Ok(()))?;
        *main = Some(conn);
        Ok(())
    }

    /// A `WAIT` exchange on an idle (or new) connection of its own, each
    /// read taking up to `timeout`; the connection goes back to the idle
    /// ones only if the exchange worked and left no unread bytes.
    fn exchange_waiting<T>(&self, bytes: &[u8], timeout: Timeout, read: impl FnOnce(&mut Reader<'_>) -> Result<T>) -> Result<T> {
        self.within_limits(bytes)?;
        let links = self.links();
        let idle = lock(&links.waiting).pop();
        let mut conn = match idle {
            Some(c) => c,
            None => self.open_conn()?,
        };
        let result = self.run(&mut conn, bytes, timeout, read);
        if result.is_ok() && conn.rpos == conn.rlen {
            let mut idle = lock(&links.waiting);
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
        result
    }

    /// Refuses a request over the servers' limits (a key over 8 KiB with
    /// its prefix, a value over 8 MiB, more than 128 Ki keys) before it is
    /// sent: our server and PyTorch's libuv server would only close the
    /// connection, which the caller would see as a server gone.
    fn within_limits(&self, bytes: &[u8]) -> Result<()> {
        protocol::RequestScanner::new().scan(bytes).map(|_| ()).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "TCPStore at {}: request not sent: {} (a TCPStore server closes the connection on such a request)",
                    self.addr,
                    e.message()
                ),
            )
        })
    }

    fn run<T>(&self, conn: &mut Conn, bytes: &[u8], timeout: Timeout, read: impl FnOnce(&mut Reader<'_>) -> Result<T>) -> Result<T> {
        conn.stream.write_all(bytes).map_err(|e| self.io_error(e, "send to"))?;
        let mut reader = Reader { client: self, conn, timeout };
        read(&mut reader)
    }

    fn io_error(&self, e: std::io::Error, doing: &str) -> Error {
        let kind = io_kind(&e);
        let what = match kind {
            ErrorKind::PeerGone => format!("TCPStore server at {} went away ({e})", self.addr),
            ErrorKind::Timeout => format!("no reply from TCPStore at {} in time", self.addr),
            _ => format!("cannot {doing} TCPStore at {}: {e}", self.addr),
        };
        Error::new(kind, what)
    }

    /// A key as on the wire: PyTorch's prefix, then the key's bytes.
    fn key(key: &[u8]) -> Vec<u8> {
        [KEY_PREFIX.as_bytes(), key].concat()
    }

    pub fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let bytes = Request::Set { key: Self::key(key), value: value.to_vec() }.to_bytes();
        self.send_only(&bytes)
    }

    pub fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        let k = Self::key(key);
        let probe = Request::CompareSet { key: k.clone(), expected: GET_SENTINEL.to_vec(), desired: GET_SENTINEL.to_vec() };
        let now = self.exchange(&probe.to_bytes(), |r| r.read_bytes())?;
        if now != GET_SENTINEL {
            return Ok(now);
        }
        self.wait_raw(std::slice::from_ref(&k), &[key], timeout)?;
        self.exchange(&Request::Get(k).to_bytes(), |r| r.read_bytes())
    }

    pub fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.add_raw(Self::key(key), delta).map_err(|e| self.add_refused(e, key))
    }

    /// A server (ours, and PyTorch's both) answers ADD on a key that holds
    /// no integer by closing the connection. If a new connection works, that
    /// is what happened: say so instead of "the server went away".
    fn add_refused(&self, e: Error, key: &[u8]) -> Error {
        if e.kind() != ErrorKind::PeerGone {
            return e;
        }
        let mut main = lock(&self.links().main);
        match self.open_conn() {
            Ok(conn) => {
                if main.is_none() {
                    *main = Some(conn);
                }
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "TCPStore at {} closed the connection on ADD to key {}: the key does not hold an integer",
                        self.addr,
                        show_key(key)
                    ),
                )
            }
            Err(_) => e,
        }
    }

    /// `ADD` on a key without the prefix (the `init/` join counter).
    pub fn add_raw(&self, key: Vec<u8>, delta: i64) -> Result<i64> {
        self.exchange(&Request::Add { key, delta }.to_bytes(), |r| r.read_i64())
    }

    /// Whether every key is set now.
    pub fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.check_raw(keys.iter().map(|k| Self::key(k)).collect())
    }

    fn check_raw(&self, raw: Vec<Vec<u8>>) -> Result<bool> {
        self.exchange(&Request::Check(raw).to_bytes(), |r| match r.read_u8()? {
            protocol::CHECK_READY => Ok(true),
            protocol::CHECK_NOT_READY => Ok(false),
            other => Err(self.protocol(format!("CHECK answered {other}, expected 0 or 1"))),
        })
    }

    pub fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let req = Request::CompareSet { key: Self::key(key), expected: expected.to_vec(), desired: desired.to_vec() };
        self.exchange(&req.to_bytes(), |r| r.read_bytes())
    }

    pub fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.exchange(&Request::DeleteKey(Self::key(key)).to_bytes(), |r| match r.read_i64()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.protocol(format!("DELETE_KEY answered {other}, expected 0 or 1"))),
        })
    }

    pub fn num_keys(&self) -> Result<i64> {
        self.exchange(&Request::GetNumKeys.to_bytes(), |r| r.read_i64())
    }

    /// Waits until every key is set. A `CHECK` on the main connection
    /// comes first, so keys this handle set just before are seen at once
    /// (the `WAIT` goes over another connection, which its `SET`s may not
    /// have reached yet).
    pub fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| Self::key(k)).collect();
        if self.check_raw(raw.clone())? {
            return Ok(());
        }
        self.wait_raw(&raw, keys, timeout)
    }

    /// `WAIT`; on expiry `CANCEL_WAIT` as PyTorch's client does, then a
    /// `CHECK` per key to name the ones still missing.
    fn wait_raw(&self, raw: &[Vec<u8>], names: &[&[u8]], timeout: Timeout) -> Result<()> {
        let bytes = Request::Wait(raw.to_vec()).to_bytes();
        let answer = self.exchange_waiting(&bytes, timeout, |r| match r.read_u8() {
            Ok(protocol::WAIT_STOP_WAITING) => Ok(Some(())),
            Ok(other) => Err(self.protocol(format!("WAIT answered {other}, expected 0"))),
            Err(e) if e.kind() == ErrorKind::Timeout && timeout.is_some() => {
                // Cancel; the server may have answered STOP_WAITING just
                // before it saw the cancel, then WAIT_CANCELED follows.
                r.conn.stream.write_all(&[protocol::query::CANCEL_WAIT]).map_err(|e| self.io_error(e, "send to"))?;
                r.timeout = self.reply_timeout;
                let mut b = r.read_u8()?;
                if b == protocol::WAIT_STOP_WAITING {
                    b = r.read_u8()?;
                }
                if b != protocol::WAIT_CANCELED {
                    return Err(self.protocol(format!("CANCEL_WAIT answered {b}, expected 1")));
                }
                Ok(None)
            }
            Err(e) => Err(e),
        })?;
        match answer {
            Some(()) => Ok(()),
            None => {
                let mut missing = Vec::new();
                for name in names {
                    if !self.check(&[*name])? {
                        missing.push(*name);
                    }
                }
                if missing.is_empty() {
                    // Set just after we gave up: report the wait's keys.
                    missing = names.to_vec();
                }
                Err(timeout_error(timeout, &missing, &format!("TCPStore at {}", self.addr)))
            }
        }
    }
}

impl Conn {
    /// Whether the peer has neither closed the connection nor sent bytes
    /// we did not ask for (either makes the connection useless).
    fn still_open(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: a non-blocking peek of at most 1 byte into a local buffer
        // on a socket we own.
        let n = unsafe { libc::recv(self.stream.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        n < 0 && matches!(crate::error::errno(), libc::EAGAIN | libc::EINTR)
    }
}

/// Reads a reply's fields under one connection lock.
struct Reader<'a> {
    client: &'a TcpClient,
    conn: &'a mut Conn,
    timeout: Timeout,
}

impl Reader<'_> {
    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        let want = match self.timeout {
            Some(t) if t.is_zero() => Some(Duration::from_micros(1)),
            t => t,
        };
        if self.conn.read_timeout != want {
            self.conn.stream.set_read_timeout(want).map_err(|e| self.client.io_error(e, "configure"))?;
            self.conn.read_timeout = want;
        }
        let c = &mut *self.conn;
        let mut at = 0;
        while at < buf.len() {
            if c.rpos < c.rlen {
                let n = (c.rlen - c.rpos).min(buf.len() - at);
                buf[at..at + n].copy_from_slice(&c.rbuf[c.rpos..c.rpos + n]);
                c.rpos += n;
                at += n;
                continue;
            }
            let got = if buf.len() - at >= c.rbuf.len() {
                c.stream.read(&mut buf[at..]).map(|n| (n, true))
            } else {
                c.stream.read(&mut c.rbuf[..]).map(|n| (n, false))
            };
            match got {
                Ok((0, _)) => {
                    let eof = std::io::Error::new(IoKind::UnexpectedEof, "connection closed");
                    return Err(self.client.io_error(eof, "read from"));
                }
                Ok((n, true)) => at += n,
                Ok((n, false)) => {
                    c.rpos = 0;
                    c.rlen = n;
                }
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => return Err(self.client.io_error(e, "read from")),
            }
        }
        Ok(())
    }

    fn read_u8(&mut self) -> Result<u8> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    fn read_u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn read_i64(&mut self) -> Result<i64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(i64::from_le_bytes(b))
    }

    fn read_bytes(&mut self) -> Result<Vec<u8>> {
        let len = self.read_i64()? as u64;
        if len > protocol::MAX_FIELD {
            return Err(self.client.protocol(format!("reply length {len} is over the limit of {} bytes", protocol::MAX_FIELD)));
        }
        // The length comes from the peer: grow the buffer as bytes arrive
        // instead of trusting it with one allocation up front.
        let len = len as usize;
        let mut v = Vec::with_capacity(len.min(READ_STEP));
        while v.len() < len {
            let at = v.len();
            let step = (len - at).min(READ_STEP.max(at));
            v.resize(at + step, 0);
            self.read_exact(&mut v[at..])?;
        }
        Ok(v)
    }
}
