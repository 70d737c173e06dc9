//! A client of a c10d `TCPStore` server (PyTorch's, or ours), with
//! PyTorch's key prefix, so it sees the same keys as PyTorch ranks of the
//! same job. One request at a time per connection, a pool of connections
//! so threads never wait on each other.

use super::protocol::{self, Request, KEY_PREFIX, VALIDATION_MAGIC};
use crate::error::{Error, ErrorKind, Result};
use crate::store::deadline::{deadline, remaining, timeout_error, Backoff};
use crate::store::Timeout;
use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
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

/// Most idle connections kept for reuse.
const MAX_IDLE: usize = 8;

/// A client of the TCPStore server at `host:port`.
///
/// Each call takes an idle connection (or opens one), so a thread blocked
/// in `get`/`wait` never holds up another thread's `set`. A connection
/// that failed mid-exchange (its byte stream may be out of step) is closed,
/// never reused.
pub struct TcpClient {
    host: String,
    port: u16,
    addr: String,
    idle: Mutex<Vec<Conn>>,
    /// How long any single reply may take (the store's timeout).
    reply_timeout: Timeout,
}

fn io_kind(e: &std::io::Error) -> ErrorKind {
    match e.kind() {
        IoKind::UnexpectedEof | IoKind::ConnectionReset | IoKind::ConnectionAborted | IoKind::BrokenPipe => {
            ErrorKind::PeerGone
        }
        IoKind::WouldBlock | IoKind::TimedOut => ErrorKind::Timeout,
        _ => e.raw_os_error().map_or(ErrorKind::Io, crate::error::kind_of_errno),
    }
}

impl TcpClient {
    /// Connects to `host:port`, retrying while nobody listens yet (ranks
    /// start in any order) until `timeout`, then validates the connection
    /// as PyTorch's client does (`VALIDATE` magic, then a `PING`).
    pub fn connect(host: &str, port: u16, timeout: Timeout) -> Result<TcpClient> {
        let addr = format!("{host}:{port}");
        let client = TcpClient { host: host.to_string(), port, addr, idle: Mutex::new(Vec::new()), reply_timeout: timeout };
        let end = deadline(timeout);
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
        let conn = loop {
            match client.open_conn() {
                Ok(c) => break c,
                Err(e) if e.kind() == ErrorKind::PeerGone && remaining(end).map_or(true, |d| !d.is_zero()) => {
                    backoff.sleep(end)
                }
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
        client.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
        Ok(client)
    }

    /// One new, validated connection (no retry).
    fn open_conn(&self) -> Result<Conn> {
        let stream = Self::try_connect(&self.host, self.port, &self.addr)?;
        let _ = stream.set_nodelay(true);
        let mut conn = Conn { stream, read_timeout: None, rbuf: Box::new([0; 4096]), rpos: 0, rlen: 0 };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        // SAFETY: getpid has no preconditions; the nonce only needs to vary.
        let nonce = (unsafe { libc::getpid() } as u32).rotate_left(16) ^ nanos;
        let mut out = Request::Validate(VALIDATION_MAGIC).to_bytes();
        Request::Ping(nonce).encode(&mut out);
        let echoed = self.run(&mut conn, &out, self.reply_timeout, |c| c.read_u32())?;
        if echoed != nonce {
            return Err(self.protocol(format!("PING answered with {echoed:#x}, expected {nonce:#x}")));
        }
        Ok(conn)
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

    /// Sends `bytes` on an idle (or new) connection, then reads the reply
    /// with `read` (each read may take up to `timeout`). The connection goes
    /// back to the pool only if the whole exchange worked and left no
    /// unread bytes.
    fn exchange<T>(&self, bytes: &[u8], timeout: Timeout, read: impl FnOnce(&mut Reader<'_>) -> Result<T>) -> Result<T> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let conn = match idle {
            Some(c) => c,
            None => self.open_conn()?,
        };
        self.finish(conn, bytes, timeout, read)
    }

    /// Sends a request that has no reply (`SET`). An idle connection the
    /// server closed meanwhile would swallow it silently, so it is checked
    /// first and replaced by a new one (which reports a server that is gone).
    fn send_only(&self, bytes: &[u8]) -> Result<()> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        if idle.as_ref().is_some_and(|c| !c.still_open()) {
            idle = None;
        }
        let conn = match idle {
            Some(c) => c,
            None => self.open_conn()?,
        };
        self.finish(conn, bytes, self.reply_timeout, |_| Ok(()))
    }

    fn finish<T>(&self, mut conn: Conn, bytes: &[u8], timeout: Timeout, read: impl FnOnce(&mut Reader<'_>) -> Result<T>) -> Result<T> {
        let result = self.run(&mut conn, bytes, timeout, read);
        if result.is_ok() && conn.rpos == conn.rlen {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
        result
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

    fn key(key: &str) -> Vec<u8> {
        format!("{KEY_PREFIX}{key}").into_bytes()
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let bytes = Request::Set { key: Self::key(key), value: value.to_vec() }.to_bytes();
        self.send_only(&bytes)
    }

    pub fn get(&self, key: &str, timeout: Timeout) -> Result<Vec<u8>> {
        let k = Self::key(key);
        let probe = Request::CompareSet { key: k.clone(), expected: GET_SENTINEL.to_vec(), desired: GET_SENTINEL.to_vec() };
        let now = self.exchange(&probe.to_bytes(), self.reply_timeout, |r| r.read_bytes())?;
        if now != GET_SENTINEL {
            return Ok(now);
        }
        self.wait_raw(std::slice::from_ref(&k), &[key], timeout)?;
        self.exchange(&Request::Get(k).to_bytes(), self.reply_timeout, |r| r.read_bytes())
    }

    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.add_raw(Self::key(key), delta).map_err(|e| self.add_refused(e, key))
    }

    /// A server (ours, and PyTorch's both) answers ADD on a key that holds
    /// no integer by closing the connection. If a new connection works, that
    /// is what happened: say so instead of "the server went away".
    fn add_refused(&self, e: Error, key: &str) -> Error {
        if e.kind() != ErrorKind::PeerGone {
            return e;
        }
        match self.open_conn() {
            Ok(conn) => {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                if idle.len() < MAX_IDLE {
                    idle.push(conn);
                }
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "TCPStore at {} closed the connection on ADD to key {key:?}: the key does not hold an integer",
                        self.addr
                    ),
                )
            }
            Err(_) => e,
        }
    }

    /// `ADD` on a key without the prefix (the `init/` join counter).
    pub fn add_raw(&self, key: Vec<u8>, delta: i64) -> Result<i64> {
        self.exchange(&Request::Add { key, delta }.to_bytes(), self.reply_timeout, |r| r.read_i64())
    }

    /// `GET` of a key without the prefix, which must exist.
    pub fn get_raw_now(&self, key: Vec<u8>) -> Result<Vec<u8>> {
        self.exchange(&Request::Get(key).to_bytes(), self.reply_timeout, |r| r.read_bytes())
    }

    /// Whether every key is set now.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let bytes = Request::Check(keys.iter().map(|k| Self::key(k)).collect()).to_bytes();
        self.exchange(&bytes, self.reply_timeout, |r| match r.read_u8()? {
            protocol::CHECK_READY => Ok(true),
            protocol::CHECK_NOT_READY => Ok(false),
            other => Err(self.protocol(format!("CHECK answered {other}, expected 0 or 1"))),
        })
    }

    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let req = Request::CompareSet { key: Self::key(key), expected: expected.to_vec(), desired: desired.to_vec() };
        self.exchange(&req.to_bytes(), self.reply_timeout, |r| r.read_bytes())
    }

    pub fn delete_key(&self, key: &str) -> Result<bool> {
        self.exchange(&Request::DeleteKey(Self::key(key)).to_bytes(), self.reply_timeout, |r| match r.read_i64()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.protocol(format!("DELETE_KEY answered {other}, expected 0 or 1"))),
        })
    }

    pub fn num_keys(&self) -> Result<i64> {
        self.exchange(&Request::GetNumKeys.to_bytes(), self.reply_timeout, |r| r.read_i64())
    }

    pub fn wait(&self, keys: &[&str], timeout: Timeout) -> Result<()> {
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| Self::key(k)).collect();
        self.wait_raw(&raw, keys, timeout)
    }

    /// `WAIT`; on expiry `CANCEL_WAIT` as PyTorch's client does, then a
    /// `CHECK` per key to name the ones still missing.
    fn wait_raw(&self, raw: &[Vec<u8>], names: &[&str], timeout: Timeout) -> Result<()> {
        let bytes = Request::Wait(raw.to_vec()).to_bytes();
        let answer = self.exchange(&bytes, timeout, |r| match r.read_u8() {
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
                    if !self.check(&[name])? {
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
        let n = unsafe {
            libc::recv(self.stream.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
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
