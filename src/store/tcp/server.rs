//! A c10d `TCPStore` server: what a master rank runs so plain C/Go ranks
//! need no Python, and PyTorch clients can join it. One thread accepts,
//! one thread per connection reads its requests; waits are parked in the
//! shared state and answered by whichever request sets their last key.

use super::protocol::{self, parse_request, Request, RequestScanner, VALIDATION_MAGIC};
use crate::error::{Error, ErrorKind, Result};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// How long one reply may take to write before the connection is dropped.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long the accept loop pauses after a failed accept.
const ACCEPT_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

/// Where a connection's replies go. Replies are queued under the state
/// lock (so each connection gets them in the order the state changed) and
/// written after it is released, so a client that stops reading stalls
/// only its own connection, never the others.
struct Outbox {
    queue: Mutex<Vec<u8>>,
    stream: Mutex<TcpStream>,
    /// Set by a thread that queued bytes without writing them (see
    /// [`Outbox::flush`]).
    orphans: AtomicBool,
}

type Out = Arc<Outbox>;

impl Outbox {
    fn new(stream: TcpStream) -> Out {
        Arc::new(Outbox { queue: Mutex::new(Vec::new()), stream: Mutex::new(stream), orphans: AtomicBool::new(false) })
    }

    /// Queues bytes (call with the state lock held; never blocks on I/O).
    fn queue(&self, bytes: &[u8]) {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(bytes);
    }

    /// Writes what is queued, in order (call without the state lock). A
    /// write that fails or times out shuts the connection down, which ends
    /// its reader thread.
    ///
    /// `wait` (the connection's own thread, after its request): waits for
    /// the write side and writes until the queue is empty, so a client that
    /// does not read stalls its own requests and nothing else. Without
    /// `wait` (another connection's thread, which only woke a waiter here):
    /// when someone is writing already, leaves the bytes to that writer
    /// and returns at once; otherwise writes what is queued now, once.
    fn flush(&self, wait: bool) -> std::io::Result<()> {
        if !wait {
            // Before trying the lock: a writer that holds it looks at this
            // flag after letting go, and sends what we queued.
            self.orphans.store(true, Ordering::SeqCst);
        }
        loop {
            let mut stream = if wait {
                self.stream.lock().unwrap_or_else(|p| p.into_inner())
            } else {
                match self.stream.try_lock() {
                    Ok(s) => s,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
                }
            };
            // Whatever was queued before this is taken below.
            self.orphans.store(false, Ordering::SeqCst);
            loop {
                let pending = std::mem::take(&mut *self.queue.lock().unwrap_or_else(|p| p.into_inner()));
                if pending.is_empty() {
                    break;
                }
                if let Err(e) = stream.write_all(&pending) {
                    let _ = stream.shutdown(Shutdown::Both);
                    return Err(e);
                }
                if !wait {
                    break;
                }
            }
            drop(stream);
            if !self.orphans.load(Ordering::SeqCst) {
                return Ok(());
            }
        }
    }
}

struct Waiter {
    conn: u64,
    until: Until,
    out: Out,
}

/// What a parked request waits for.
enum Until {
    /// `WAIT` (and a blocking queue pop): these keys, each set or a
    /// non-empty queue.
    Present(Vec<Vec<u8>>),
    /// `BARRIER`: the counter at this key reaching `world_size`.
    Count { key: Vec<u8>, world_size: i64 },
}

#[derive(Default)]
struct State {
    data: HashMap<Vec<u8>, Vec<u8>>,
    /// Queues live beside the keys: not counted or listed as keys, but a
    /// non-empty one satisfies `CHECK` and `WAIT` on its name.
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiters: Vec<Waiter>,
    /// Every open connection, to shut down when the server stops.
    conns: HashMap<u64, TcpStream>,
    next_conn: u64,
}

struct Shared {
    state: Mutex<State>,
    stopping: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running server; stops (closing every connection) when dropped.
pub struct TcpServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl TcpServer {
    /// Listens on `host:port` (port 0: any free port, see [`Self::port`]).
    /// A port already in use is `ErrorKind::Busy`.
    pub fn start(host: &str, port: u16) -> Result<TcpServer> {
        let name = format!("{host}:{port}");
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("cannot resolve TCPStore host {name}: {e}")))?
            .collect();
        let mut last = None;
        let mut listener = None;
        for a in &addrs {
            match TcpListener::bind(a) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let listener = listener.ok_or_else(|| match last {
            Some(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {
                Error::new(ErrorKind::Busy, format!("cannot serve a TCPStore on {name}: the port is in use by another server"))
            }
            Some(e) => {
                let kind = e.raw_os_error().map_or(ErrorKind::Io, crate::error::kind_of_errno);
                Error::new(kind, format!("cannot serve a TCPStore on {name}: {e}"))
            }
            None => Error::new(ErrorKind::InvalidArgument, format!("TCPStore host {name} resolves to no address")),
        })?;
        let addr = listener.local_addr().map_err(|e| Error::new(ErrorKind::Io, format!("{name}: {e}")))?;
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), stopping: AtomicBool::new(false) });
        let s2 = shared.clone();
        let accept = std::thread::Builder::new()
            .name("ss-tcpstore-accept".into())
            .spawn(move || accept_loop(listener, s2))
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start the TCPStore server thread: {e}")))?;
        Ok(TcpServer { shared, addr, accept: Some(accept) })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() });
        }
        let _ = TcpStream::connect(wake);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for (_, c) in self.shared.lock().conns.drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(_) => {
                // Out of descriptors (EMFILE/ENFILE) or memory: the pending
                // connection stays queued and accept would fail again at
                // once; pause instead of spinning on it.
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // A client that stops reading its replies must not stall everyone
        // (its connection's thread would block in write for good): give up on it.
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let (Ok(out), Ok(keep)) = (stream.try_clone(), stream.try_clone()) else { continue };
        let id = {
            let mut st = shared.lock();
            st.next_conn += 1;
            let id = st.next_conn;
            st.conns.insert(id, keep);
            id
        };
        let s2 = shared.clone();
        let spawned = std::thread::Builder::new().name("ss-tcpstore-conn".into()).spawn(move || serve(stream, Outbox::new(out), id, &s2));
        if spawned.is_err() {
            shared.lock().conns.remove(&id);
        }
    }
}

/// Reads and answers one connection's requests until it closes or breaks
/// the protocol (then we close it, as PyTorch's servers do).
fn serve(mut stream: TcpStream, out: Out, id: u64, shared: &Shared) {
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = vec![0u8; 64 * 1024];
    let mut validated = false;
    let mut scanner = RequestScanner::new();
    'conn: loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        let mut used = 0;
        loop {
            // Find the request's end first (no byte scanned twice), then
            // build it once.
            let whole = match scanner.scan(&buf[used..]) {
                Ok(Some(n)) => match parse_request(&buf[used..used + n]) {
                    Ok(Some((req, m))) if m == n => Ok(Some((req, n))),
                    Ok(_) => Err(Error::new(ErrorKind::Protocol, "request scanner and parser disagree")),
                    Err(e) => Err(e),
                },
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            };
            match whole {
                Ok(Some((req, n))) => {
                    used += n;
                    if !validated {
                        if req != Request::Validate(VALIDATION_MAGIC) {
                            break 'conn;
                        }
                        validated = true;
                        continue;
                    }
                    if handle(req, &out, id, shared).is_err() {
                        break 'conn;
                    }
                }
                Ok(None) => break,
                Err(_) => break 'conn,
            }
        }
        buf.drain(..used);
    }
    let mut st = shared.lock();
    st.waiters.retain(|w| w.conn != id);
    st.conns.remove(&id);
    drop(st);
    let _ = stream.shutdown(Shutdown::Both);
}

impl State {
    /// A key is present when it is set or names a non-empty queue.
    fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn counter(&self, key: &[u8]) -> Option<i64> {
        self.data.get(key).and_then(|v| protocol::parse_counter(v))
    }
}

/// `key` was set (or its queue filled): queues the answer of every waiter
/// now complete and notes their connections in `woken`, to flush.
fn wake(st: &mut State, woken: &mut Vec<Out>, key: &[u8]) {
    // Parsed only if a barrier waits on this key (not on every set).
    let mut count: Option<Option<i64>> = None;
    let mut i = 0;
    while i < st.waiters.len() {
        let done = match &mut st.waiters[i].until {
            Until::Present(missing) => {
                missing.retain(|k| k != key);
                missing.is_empty()
            }
            Until::Count { key: k, world_size } => {
                let world_size = *world_size;
                k == key && count.get_or_insert_with(|| st.counter(key)).is_some_and(|c| c >= world_size)
            }
        };
        if done {
            let w = st.waiters.swap_remove(i);
            w.out.queue(&[protocol::WAIT_STOP_WAITING]);
            woken.push(w.out);
        } else {
            i += 1;
        }
    }
}

/// Adds `delta` to the counter at `key` (a missing key counts as 0); `None`
/// when the value there is not a number.
fn add_to_counter(st: &mut State, woken: &mut Vec<Out>, key: Vec<u8>, delta: i64) -> Option<i64> {
    let old = match st.data.get(&key) {
        None => 0,
        Some(v) => protocol::parse_counter(v)?,
    };
    let new = old.wrapping_add(delta);
    set_key(st, woken, key, new.to_string().into_bytes());
    Some(new)
}

fn set_key(st: &mut State, woken: &mut Vec<Out>, key: Vec<u8>, value: Vec<u8>) {
    let k = key.clone();
    st.data.insert(key, value);
    wake(st, woken, &k);
}

/// Answers one request; an error closes the connection. The state lock is
/// held only while the state changes and replies are queued; the writes
/// happen after it is released.
fn handle(req: Request, out: &Out, id: u64, shared: &Shared) -> std::result::Result<(), ()> {
    let mut woken = Vec::new();
    let result = update(req, out, id, shared, &mut woken);
    for w in &woken {
        if !Arc::ptr_eq(w, out) {
            let _ = w.flush(false);
        }
    }
    let flushed = out.flush(true);
    result.and(flushed.map_err(|_| ()))
}

fn update(req: Request, out: &Out, id: u64, shared: &Shared, woken: &mut Vec<Out>) -> std::result::Result<(), ()> {
    let mut reply = Vec::new();
    let mut st = shared.lock();
    match req {
        Request::Validate(_) => return Err(()),
        Request::Ping(n) => reply.extend_from_slice(&n.to_le_bytes()),
        Request::Set { key, value } => set_key(&mut st, woken, key, value),
        Request::CompareSet { key, expected, desired } => {
            let answer = match st.data.get(&key) {
                None if expected.is_empty() => {
                    set_key(&mut st, woken, key, desired.clone());
                    desired
                }
                None => expected,
                Some(cur) if *cur == expected => {
                    set_key(&mut st, woken, key, desired.clone());
                    desired
                }
                Some(cur) => cur.clone(),
            };
            protocol::encode_bytes_reply(&mut reply, &answer);
        }
        // A missing key: PyTorch's libuv server answers an empty value,
        // its classic one closes the connection; clients WAIT first.
        Request::Get(key) => match st.data.get(&key) {
            Some(v) => protocol::encode_bytes_reply(&mut reply, v),
            None => return Err(()),
        },
        Request::Add { key, delta } => {
            let new = add_to_counter(&mut st, woken, key, delta).ok_or(())?;
            reply.extend_from_slice(&new.to_le_bytes());
        }
        Request::Check(keys) => {
            let ready = keys.iter().all(|k| st.present(k));
            reply.push(if ready { protocol::CHECK_READY } else { protocol::CHECK_NOT_READY });
        }
        Request::Wait(keys) => {
            let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !st.present(k)).collect();
            if missing.is_empty() {
                reply.push(protocol::WAIT_STOP_WAITING);
            } else {
                st.waiters.push(Waiter { conn: id, until: Until::Present(missing), out: out.clone() });
            }
        }
        Request::CancelWait => {
            st.waiters.retain(|w| w.conn != id);
            reply.push(protocol::WAIT_CANCELED);
        }
        Request::GetNumKeys => reply.extend_from_slice(&(st.data.len() as i64).to_le_bytes()),
        Request::DeleteKey(key) => {
            let n: i64 = st.data.remove(&key).is_some().into();
            reply.extend_from_slice(&n.to_le_bytes());
        }
        Request::Append { key, value } => {
            let mut cur = st.data.remove(&key).unwrap_or_default();
            cur.extend_from_slice(&value);
            set_key(&mut st, woken, key, cur);
        }
        Request::MultiGet(keys) => {
            for k in &keys {
                protocol::encode_bytes_reply(&mut reply, st.data.get(k).ok_or(())?);
            }
        }
        Request::MultiSet(pairs) => {
            for (k, v) in pairs {
                set_key(&mut st, woken, k, v);
            }
        }
        Request::QueuePush { key, value } => {
            st.queues.entry(key.clone()).or_default().push_back(value);
            wake(&mut st, woken, &key);
        }
        // PyTorch's client WAITs on the queue's name before a blocking pop.
        Request::QueuePop(key) => {
            let queue = st.queues.get_mut(&key);
            let len = queue.as_ref().map_or(0, |q| q.len());
            reply.extend_from_slice(&(len as u64).to_le_bytes());
            if let Some(value) = queue.and_then(|q| q.pop_front()) {
                protocol::encode_bytes_reply(&mut reply, &value);
            }
            if st.queues.get(&key).is_some_and(|q| q.is_empty()) {
                st.queues.remove(&key);
            }
        }
        Request::QueueLen(key) => {
            let len = st.queues.get(&key).map_or(0, |q| q.len()) as i64;
            reply.extend_from_slice(&len.to_le_bytes());
        }
        // Sorted, so the answer does not depend on the map's order.
        Request::ListKeys => {
            let mut keys: Vec<&Vec<u8>> = st.data.keys().collect();
            keys.sort();
            reply.extend_from_slice(&(keys.len() as u64).to_le_bytes());
            for k in keys {
                protocol::encode_bytes_reply(&mut reply, k);
            }
        }
        Request::Barrier { key, world_size } => {
            let count = add_to_counter(&mut st, woken, key.clone(), 1).ok_or(())?;
            if count >= world_size {
                reply.push(protocol::WAIT_STOP_WAITING);
            } else {
                st.waiters.push(Waiter { conn: id, until: Until::Count { key, world_size }, out: out.clone() });
            }
        }
    }
    if !reply.is_empty() {
        out.queue(&reply);
    }
    Ok(())
}
