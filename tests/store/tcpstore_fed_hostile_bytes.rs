//! The TCPStore client and server fed hostile bytes through real sockets.
//!
//! Client: a fake server answers the handshake, then answers one request
//! with arbitrary or mutated reply bytes (corpus tests/corpus/tcpstore_reply/
//! first) and closes: every call returns its value or a typed error
//! (`Protocol`, `PeerGone`, `Timeout`, `InvalidArgument`), quickly, and a
//! value it returns is the one the bytes spell.
//!
//! Server: a raw TCP client sends a byte stream (the corpus of
//! tests/corpus/tcpstore_request/, valid sessions, mutated ones, random
//! bytes) and shuts its side down; the server must answer exactly what an
//! independent model of the protocol answers, then close, never hang.
//! Other clients keep working beside garbage and beside a client that
//! never reads its replies; a server out of descriptors does not spin.
//!
//! More cases: PROPTEST_CASES=5000 cargo test --release --test tcpstore_fed_hostile_bytes

#[path = "../common/mod.rs"]
mod common;

use common::*;
use proptest::prelude::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use storage_sharing::store::tcp::client::TcpClient;
use storage_sharing::store::tcp::protocol::{parse_counter, parse_request, Request, MAX_KEYS, VALIDATION_MAGIC};
use storage_sharing::store::tcp::server::TcpServer;
use storage_sharing::store::{Store, TcpStore};
use storage_sharing::ErrorKind;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).unwrap())).collect()
}

fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- the client against a fake server -----------------------------------

/// What the fake server answers: `handshake` replaces the PING echo when
/// set (then the connection closes), else `reply` answers the first request
/// after the handshake and the connection closes.
#[derive(Clone, Default)]
struct Script {
    handshake: Option<Vec<u8>>,
    reply: Vec<u8>,
}

struct FakeServer {
    port: u16,
    script: Arc<Mutex<Script>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Reads until `n` whole requests have arrived (None: the peer closed,
/// timed out or sent bytes that are no request).
fn read_requests(s: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> Option<Vec<Request>> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    while out.len() < n {
        match parse_request(buf) {
            Ok(Some((r, used))) => {
                buf.drain(..used);
                out.push(r);
                continue;
            }
            Ok(None) => {}
            Err(_) => return None,
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
    Some(out)
}

impl FakeServer {
    fn start() -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let script = Arc::new(Mutex::new(Script::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sc, st) = (script.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for s in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut s) = s else { continue };
                let script = sc.lock().unwrap().clone();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut buf = Vec::new();
                let Some(hello) = read_requests(&mut s, &mut buf, 2) else { continue };
                let Request::Ping(nonce) = hello[1] else { continue };
                match &script.handshake {
                    Some(garbage) => {
                        let _ = s.write_all(garbage);
                        let _ = s.shutdown(Shutdown::Both);
                        continue;
                    }
                    None => {
                        let _ = s.write_all(&nonce.to_le_bytes());
                    }
                }
                if read_requests(&mut s, &mut buf, 1).is_some() {
                    let _ = s.write_all(&script.reply);
                }
                let _ = s.shutdown(Shutdown::Both);
            }
        });
        FakeServer { port, script, stop, thread: Some(thread) }
    }

    fn answer(&self, handshake: Option<Vec<u8>>, reply: Vec<u8>) {
        *self.script.lock().unwrap() = Script { handshake, reply };
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const CLIENT_KINDS: [ErrorKind; 4] = [ErrorKind::Protocol, ErrorKind::PeerGone, ErrorKind::Timeout, ErrorKind::InvalidArgument];

/// One client call answered with `reply`: a value it returns is what the
/// bytes spell; a failure is typed; nothing takes long (the fake server
/// closes after its reply, so no call may wait out a timeout).
fn check_client_op(server: &FakeServer, op: usize, reply: &[u8]) {
    server.answer(None, reply.to_vec());
    let client = TcpClient::connect("127.0.0.1", server.port, Some(Duration::from_secs(5))).expect("fake handshake");
    let t = Instant::now();
    let le8 = |b: &[u8]| b.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    let err = match op {
        0 => match client.get(b"k", Some(Duration::from_secs(5))) {
            Ok(v) => {
                assert_eq!(le8(reply), Some(v.len() as u64), "get returned {} bytes from {reply:?}", v.len());
                assert_eq!(&reply[8..8 + v.len()], &v[..]);
                None
            }
            Err(e) => Some(e),
        },
        1 => match client.add(b"k", 3) {
            Ok(n) => {
                assert_eq!(le8(reply), Some(n as u64), "add returned {n} from {reply:?}");
                None
            }
            Err(e) => Some(e),
        },
        2 => match client.check(&[b"k".as_slice()]) {
            Ok(ready) => {
                assert_eq!(reply.first(), Some(&if ready { 0 } else { 1 }), "check returned {ready} from {reply:?}");
                None
            }
            Err(e) => Some(e),
        },
        3 => match client.wait(&[b"k".as_slice()], Some(Duration::from_secs(5))) {
            Ok(()) => {
                assert_eq!(reply.first(), Some(&0), "wait returned from {reply:?}");
                None
            }
            Err(e) => Some(e),
        },
        _ => client.set(b"k", b"v").err(),
    };
    if let Some(e) = err {
        assert!(CLIENT_KINDS.contains(&e.kind()), "op {op} on {reply:?}: {e}");
        assert!(e.message().contains("TCPStore"), "op {op}: message does not say where: {}", e.message());
    }
    assert!(t.elapsed() < Duration::from_secs(4), "op {op} took {:?} on a reply the server closed after", t.elapsed());
}

fn shared_fake() -> &'static Mutex<FakeServer> {
    static FAKE: std::sync::OnceLock<Mutex<FakeServer>> = std::sync::OnceLock::new();
    FAKE.get_or_init(|| Mutex::new(FakeServer::start()))
}

#[test]
fn client_reply_corpus() {
    let fake = shared_fake().lock().unwrap_or_else(|p| p.into_inner());
    for (path, data) in corpus("tcpstore_reply") {
        for op in 0..5 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_client_op(&fake, op, &data)));
            assert!(r.is_ok(), "corpus input {} broke client op {op}", path.display());
        }
    }
}

/// Valid replies of each call, for mutation.
fn valid_reply(op: usize, v: u64) -> Vec<u8> {
    match op {
        0 => {
            let body = v.to_le_bytes();
            let n = (v % 9) as usize;
            [(n as u64).to_le_bytes().as_slice(), &body[..n]].concat()
        }
        1 => v.to_le_bytes().to_vec(),
        2 => vec![(v % 2) as u8],
        _ => vec![0],
    }
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn client_replies_any_bytes(op in 0usize..5, reply in proptest::collection::vec(any::<u8>(), 0..40)) {
        let fake = shared_fake().lock().unwrap_or_else(|p| p.into_inner());
        check_client_op(&fake, op, &reply);
    }

    #[test]
    fn client_replies_mutated(op in 0usize..4, v in any::<u64>(), edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
                              cut in 0usize..3, extra in proptest::collection::vec(any::<u8>(), 0..3)) {
        let fake = shared_fake().lock().unwrap_or_else(|p| p.into_inner());
        let mut reply = valid_reply(op, v);
        for (at, b) in edits {
            let i = at % reply.len();
            reply[i] = b;
        }
        reply.truncate(reply.len().saturating_sub(cut));
        reply.extend_from_slice(&extra);
        check_client_op(&fake, op, &reply);
    }
}

proptest! {
    #![proptest_config(config(40))]

    /// A wrong PING echo (at least 4 bytes: a shorter one is a server that
    /// went away, which connect retries until its timeout).
    #[test]
    fn client_handshake_any_bytes(echo in proptest::collection::vec(any::<u8>(), 4..12)) {
        let fake = shared_fake().lock().unwrap_or_else(|p| p.into_inner());
        fake.answer(Some(echo), Vec::new());
        match TcpClient::connect("127.0.0.1", fake.port, Some(Duration::from_millis(300))) {
            Ok(_) => {}
            Err(e) => {
                prop_assert!(CLIENT_KINDS.contains(&e.kind()), "{}", e);
                prop_assert!(e.kind() != ErrorKind::Protocol || e.message().contains("PING"), "{}", e);
            }
        }
    }
}

/// Regression: a reply length of 2 GiB (the limit) was allocated whole
/// before a byte of it arrived. Under an address-space limit that is an
/// allocation failure, which aborts the process; now the buffer grows with
/// the bytes that really come and the call fails with `PeerGone`.
#[test]
fn huge_reply_length_allocates_only_what_arrives() {
    let out = run_ok(child_command("huge_reply", &[]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("huge reply refused"), "{}", String::from_utf8_lossy(&out.stdout));
}

fn huge_reply_child() {
    let fake = FakeServer::start();
    let reply =
        std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/tcpstore_reply/regression_length_2gib.bin")).unwrap();
    fake.answer(None, reply);
    let client = TcpClient::connect("127.0.0.1", fake.port, Some(Duration::from_secs(5))).unwrap();
    // Room for everything but the 2 GiB buffer.
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split(' ').next().unwrap().parse().unwrap();
    let limit = pages * 4096 + (1 << 30);
    // SAFETY: plain data in; only this child's limit changes.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_AS, &mut r), 0);
        r.rlim_cur = limit.min(r.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &r), 0);
    }
    let e = client.get(b"k", Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    println!("huge reply refused: {e}");
}

#[test]
#[ignore = "entry point of the child process"]
fn child_role() {
    let Some((role, _)) = my_role() else { return };
    match role.as_str() {
        "huge_reply" => huge_reply_child(),
        "emfile" => emfile_child(),
        "trickle" => trickle_child(),
        "idle_flood" => idle_flood_child(),
        other => panic!("unknown role {other}"),
    }
}

// ---- the server against raw byte streams --------------------------------

/// What the server must send back for `bytes` on one connection: an
/// independent model of the protocol (one connection, so a WAIT can only
/// be completed by a later request of the same stream). It stops where the
/// server closes: a first request other than VALIDATE with the magic, a
/// second VALIDATE, bytes that are no request, GET/MULTI_GET of a missing
/// key, ADD to a value that is no integer.
fn model_replies(bytes: &[u8]) -> Vec<u8> {
    /// A parked WAIT (the keys still missing) or BARRIER (key, world size).
    enum Parked {
        Keys(Vec<Vec<u8>>),
        Count(Vec<u8>, i64),
    }
    let mut out = Vec::new();
    let mut data: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let mut queues: HashMap<Vec<u8>, std::collections::VecDeque<Vec<u8>>> = HashMap::new();
    let mut waiters: Vec<Parked> = Vec::new();
    let mut validated = false;
    let mut at = 0;
    // `k` became present (set, or its queue filled; `v` its new value when set).
    let wake = |waiters: &mut Vec<Parked>, out: &mut Vec<u8>, k: &[u8], v: Option<&[u8]>| {
        waiters.retain_mut(|w| {
            let done = match w {
                Parked::Keys(missing) => {
                    missing.retain(|m| m != k);
                    missing.is_empty()
                }
                Parked::Count(key, ws) => key == k && v.and_then(parse_counter).is_some_and(|c| c >= *ws),
            };
            if done {
                out.push(0);
            }
            !done
        });
    };
    let set = |data: &mut HashMap<Vec<u8>, Vec<u8>>, waiters: &mut Vec<Parked>, out: &mut Vec<u8>, k: Vec<u8>, v: Vec<u8>| {
        wake(waiters, out, &k, Some(&v));
        data.insert(k, v);
    };
    let present = |data: &HashMap<Vec<u8>, Vec<u8>>, queues: &HashMap<Vec<u8>, std::collections::VecDeque<Vec<u8>>>, k: &[u8]| {
        data.contains_key(k) || queues.get(k).is_some_and(|q| !q.is_empty())
    };
    let bytes_reply = |out: &mut Vec<u8>, v: &[u8]| {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        out.extend_from_slice(v);
    };
    while let Ok(Some((req, n))) = parse_request(&bytes[at..]) {
        at += n;
        if !validated {
            if req != Request::Validate(VALIDATION_MAGIC) {
                break;
            }
            validated = true;
            continue;
        }
        match req {
            Request::Validate(_) => break,
            Request::Ping(n) => out.extend_from_slice(&n.to_le_bytes()),
            Request::Set { key, value } => set(&mut data, &mut waiters, &mut out, key, value),
            Request::CompareSet { key, expected, desired } => {
                let now = data.get(&key).cloned();
                let answer = match now {
                    None if !expected.is_empty() => expected,
                    Some(cur) if cur != expected => cur,
                    _ => {
                        set(&mut data, &mut waiters, &mut out, key, desired.clone());
                        desired
                    }
                };
                bytes_reply(&mut out, &answer);
            }
            Request::Get(key) => match data.get(&key) {
                Some(v) => bytes_reply(&mut out, &v.clone()),
                None => break,
            },
            Request::Add { key, delta } => {
                let old = match data.get(&key) {
                    None => 0,
                    Some(v) => match parse_counter(v) {
                        Some(n) => n,
                        None => break,
                    },
                };
                let new = old.wrapping_add(delta);
                set(&mut data, &mut waiters, &mut out, key, new.to_string().into_bytes());
                out.extend_from_slice(&new.to_le_bytes());
            }
            Request::Check(keys) => out.push(if keys.iter().all(|k| present(&data, &queues, k)) { 0 } else { 1 }),
            Request::Wait(keys) => {
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !present(&data, &queues, k)).collect();
                if missing.is_empty() {
                    out.push(0);
                } else {
                    waiters.push(Parked::Keys(missing));
                }
            }
            Request::CancelWait => {
                waiters.clear();
                out.push(1);
            }
            Request::GetNumKeys => out.extend_from_slice(&(data.len() as i64).to_le_bytes()),
            Request::DeleteKey(key) => out.extend_from_slice(&i64::from(data.remove(&key).is_some()).to_le_bytes()),
            Request::Append { key, value } => {
                let mut cur = data.remove(&key).unwrap_or_default();
                cur.extend_from_slice(&value);
                set(&mut data, &mut waiters, &mut out, key, cur);
            }
            Request::MultiGet(keys) => {
                if !keys.iter().all(|k| data.contains_key(k)) {
                    break;
                }
                for k in &keys {
                    bytes_reply(&mut out, &data[k].clone());
                }
            }
            Request::MultiSet(pairs) => {
                for (k, v) in pairs {
                    set(&mut data, &mut waiters, &mut out, k, v);
                }
            }
            Request::QueuePush { key, value } => {
                queues.entry(key.clone()).or_default().push_back(value);
                wake(&mut waiters, &mut out, &key, None);
            }
            Request::QueuePop(key) => {
                let q = queues.entry(key).or_default();
                out.extend_from_slice(&(q.len() as u64).to_le_bytes());
                if let Some(v) = q.pop_front() {
                    bytes_reply(&mut out, &v);
                }
            }
            Request::QueueLen(key) => out.extend_from_slice(&(queues.get(&key).map_or(0, |q| q.len()) as i64).to_le_bytes()),
            Request::ListKeys => {
                let mut keys: Vec<&Vec<u8>> = data.keys().collect();
                keys.sort();
                out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
                for k in keys {
                    bytes_reply(&mut out, k);
                }
            }
            Request::Barrier { key, world_size } => {
                let old = match data.get(&key) {
                    None => 0,
                    Some(v) => match parse_counter(v) {
                        Some(n) => n,
                        None => break,
                    },
                };
                let new = old.wrapping_add(1);
                set(&mut data, &mut waiters, &mut out, key.clone(), new.to_string().into_bytes());
                if new >= world_size {
                    out.push(0);
                } else {
                    waiters.push(Parked::Count(key, world_size));
                }
            }
        }
    }
    out
}

/// Sends `bytes` to a fresh server in pieces cut at `cuts`, shuts the
/// write side and reads until the server closes. The server must close
/// (after the client's end at the latest) and have sent exactly what the
/// model says; if it reset the connection (it closed with bytes of ours
/// unread) what arrived must be the start of that.
fn check_server_stream(bytes: &[u8], cuts: &[usize]) {
    let server = TcpServer::start("127.0.0.1", 0).unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    ends.push(bytes.len());
    ends.sort_unstable();
    let mut from = 0;
    for end in ends {
        if s.write_all(&bytes[from..end]).is_err() {
            break; // the server closed already
        }
        from = end;
    }
    let _ = s.shutdown(Shutdown::Write);
    let mut got = Vec::new();
    let want = model_replies(bytes);
    let t = Instant::now();
    match s.read_to_end(&mut got) {
        Ok(_) => assert_eq!(got, want, "server answered {got:?}, the model {want:?}, to {bytes:?}"),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
            assert!(want.starts_with(&got), "server answered {got:?} (then reset), the model {want:?}, to {bytes:?}")
        }
        Err(e) => panic!("server neither answered nor closed in {:?} ({e}); input {bytes:?}", t.elapsed()),
    }
}

#[test]
fn server_request_corpus() {
    let hello = [Request::Validate(VALIDATION_MAGIC).to_bytes(), Request::Ping(7).to_bytes()].concat();
    for (path, data) in corpus("tcpstore_request") {
        for stream in [data.clone(), [hello.clone(), data.clone()].concat()] {
            let r = std::panic::catch_unwind(|| check_server_stream(&stream, &[3, 11]));
            assert!(r.is_ok(), "corpus input {} broke the server check", path.display());
        }
    }
}

fn small_key() -> impl Strategy<Value = Vec<u8>> + Clone {
    prop::sample::select(vec![b"/a".to_vec(), b"/b".to_vec(), b"/n".to_vec(), Vec::new()])
}

fn small_value() -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![
        prop::sample::select(vec![b"1".to_vec(), b"-2".to_vec(), b" 9x".to_vec(), b"x".to_vec(), Vec::new()]),
        proptest::collection::vec(any::<u8>(), 0..6),
    ]
}

fn session_request() -> impl Strategy<Value = Request> {
    let keys = proptest::collection::vec(small_key(), 0..3);
    prop_oneof![
        (small_key(), small_value()).prop_map(|(key, value)| Request::Set { key, value }),
        (small_key(), small_value(), small_value()).prop_map(|(key, expected, desired)| Request::CompareSet { key, expected, desired }),
        small_key().prop_map(Request::Get),
        (small_key(), prop_oneof![-3i64..3, any::<i64>()]).prop_map(|(key, delta)| Request::Add { key, delta }),
        keys.clone().prop_map(Request::Check),
        keys.clone().prop_map(Request::Wait),
        Just(Request::GetNumKeys),
        small_key().prop_map(Request::DeleteKey),
        (small_key(), small_value()).prop_map(|(key, value)| Request::Append { key, value }),
        keys.prop_map(Request::MultiGet),
        proptest::collection::vec((small_key(), small_value()), 0..3).prop_map(Request::MultiSet),
        Just(Request::CancelWait),
        any::<u32>().prop_map(Request::Ping),
        Just(Request::Validate(VALIDATION_MAGIC)),
        (small_key(), small_value()).prop_map(|(key, value)| Request::QueuePush { key, value }),
        small_key().prop_map(Request::QueuePop),
        small_key().prop_map(Request::QueueLen),
        Just(Request::ListKeys),
        (small_key(), -1i64..3).prop_map(|(key, world_size)| Request::Barrier { key, world_size }),
    ]
}

proptest! {
    #![proptest_config(config(150))]

    /// A valid handshake, then a session of requests on a few keys
    /// (sometimes with bytes changed or the end cut): the server's replies
    /// are the model's, byte for byte.
    #[test]
    fn server_sessions_match_the_model(reqs in proptest::collection::vec(session_request(), 0..12),
                                       edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..2),
                                       cut in 0usize..3, cuts in proptest::collection::vec(any::<usize>(), 0..3)) {
        let mut bytes = Request::Validate(VALIDATION_MAGIC).to_bytes();
        for r in &reqs {
            r.encode(&mut bytes);
        }
        for (at, v) in edits {
            let i = 5 + at % (bytes.len() - 5).max(1);
            if i < bytes.len() {
                bytes[i] = v;
            }
        }
        bytes.truncate(bytes.len().saturating_sub(cut).max(5));
        check_server_stream(&bytes, &cuts);
    }

    #[test]
    fn server_any_bytes(handshake in any::<bool>(), garbage in proptest::collection::vec(any::<u8>(), 0..60),
                        cuts in proptest::collection::vec(any::<usize>(), 0..3)) {
        let mut bytes = if handshake { Request::Validate(VALIDATION_MAGIC).to_bytes() } else { Vec::new() };
        bytes.extend_from_slice(&garbage);
        check_server_stream(&bytes, &cuts);
    }
}

/// Small deterministic generator for the threads below (no proptest
/// runner inside threads).
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Garbage connections from 4 threads (half with a valid handshake first,
/// some left open mid-request) while a well-behaved rank works: every one
/// of its calls succeeds, every garbage connection is answered or closed,
/// and the server still serves afterwards.
#[test]
fn garbage_clients_do_not_disturb_others() {
    let store = TcpStore::open("127.0.0.1", 0, true, 1, Some(Duration::from_secs(10))).unwrap();
    let port = store.port();
    let done = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let done = done.clone();
            std::thread::spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                let mut conns = 0;
                let mut held = Vec::new();
                while !done.load(Ordering::SeqCst) || conns < 30 {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    let mut bytes = if xorshift(&mut rng) % 2 == 0 { Request::Validate(VALIDATION_MAGIC).to_bytes() } else { Vec::new() };
                    let n = xorshift(&mut rng) % 64;
                    bytes.extend((0..n).map(|_| (xorshift(&mut rng) % 16) as u8));
                    let _ = s.write_all(&bytes);
                    if xorshift(&mut rng) % 8 == 0 && held.len() < 16 {
                        held.push(s); // left open, maybe mid-request
                    } else {
                        let _ = s.shutdown(Shutdown::Write);
                        let mut sink = Vec::new();
                        match s.read_to_end(&mut sink) {
                            Ok(_) => {}
                            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "garbage connection not closed: {e}"),
                        }
                    }
                    conns += 1;
                }
                conns
            })
        })
        .collect();
    for i in 0..300 {
        let key = format!("good/{i}");
        store.set(key.as_bytes(), format!("{i}").as_bytes()).unwrap();
        assert_eq!(store.get(key.as_bytes(), Some(Duration::from_secs(10))).unwrap(), format!("{i}").as_bytes());
        assert_eq!(store.add(b"good/count", 1).unwrap(), i + 1);
    }
    done.store(true, Ordering::SeqCst);
    let conns: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(conns >= 120);
    let other = TcpStore::open("127.0.0.1", port, false, 0, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(other.get(b"good/299", None).unwrap(), b"299");
}

/// Regression: replies were written while the server's state lock was
/// held, so a client that sends requests but never reads the replies
/// (once its socket buffers were full) stalled every other client for the
/// 10 s write timeout, per reply. Now its replies wait only on its own
/// connection: the other ranks' calls, with a 5 s timeout, all succeed.
#[test]
fn a_client_that_never_reads_stalls_no_one() {
    let store = TcpStore::open("127.0.0.1", 0, true, 0, Some(Duration::from_secs(5))).unwrap();
    let big = vec![7u8; 1 << 20];
    store.set(b"big", &big).unwrap();
    let mut hog = TcpStream::connect(("127.0.0.1", store.port())).unwrap();
    hog.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut req = Request::Validate(VALIDATION_MAGIC).to_bytes();
    for _ in 0..64 {
        Request::Get(b"/big".to_vec()).encode(&mut req);
    }
    hog.write_all(&req).unwrap();
    // 64 MiB of replies nobody reads: the server's writes to the hog block.
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    for i in 0..50 {
        store.set(format!("k{i}").as_bytes(), b"v").unwrap();
        assert_eq!(store.get(format!("k{i}").as_bytes(), None).unwrap(), b"v");
        store.add(b"n", 1).unwrap();
    }
    println!("50 rounds beside the hog in {:?}", t.elapsed());
    drop(hog);
}

/// Regression (review): the rank whose request woke a parked WAIT wrote
/// that reply itself, waiting for the woken connection's write lock. A
/// client that parked a WAIT and then pipelined requests whose replies it
/// never reads holds that lock (its own thread is blocked writing to it)
/// for the 10 s write timeout, so the waking rank's connection stalled
/// with it: its next call timed out. Now a waker only queues the reply
/// when the connection is busy, and the writer there sends it.
#[test]
fn waking_a_client_that_never_reads_stalls_no_one() {
    let store = TcpStore::open("127.0.0.1", 0, true, 0, Some(Duration::from_secs(5))).unwrap();
    store.set(b"big", &vec![7u8; 1 << 20]).unwrap();
    let mut hog = TcpStream::connect(("127.0.0.1", store.port())).unwrap();
    let mut req = Request::Validate(VALIDATION_MAGIC).to_bytes();
    Request::Wait(vec![b"/go".to_vec()]).encode(&mut req);
    for _ in 0..64 {
        Request::Get(b"/big".to_vec()).encode(&mut req);
    }
    hog.write_all(&req).unwrap();
    // 64 MiB of replies nobody reads: the server's writes to the hog block.
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    store.set(b"go", b"1").unwrap();
    assert_eq!(store.get(b"go", None).unwrap(), b"1");
    store.add(b"n", 1).unwrap();
    println!("waking the hog and two more calls in {:?}", t.elapsed());
    drop(hog);
}

/// Regression: when accept failed (out of descriptors: the pending
/// connection stays queued) the accept loop retried at once, forever, one
/// core at 100 %. The child runs at a low RLIMIT_NOFILE, fills it, and
/// measures its own CPU time while connections wait to be accepted.
#[test]
fn accept_out_of_descriptors_does_not_spin() {
    let out = run_ok(child_command("emfile", &[]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cpu while out of descriptors"), "{text}");
    println!("{}", text.lines().find(|l| l.contains("cpu while")).unwrap());
}

fn cpu_time() -> Duration {
    // SAFETY: plain data out.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn emfile_child() {
    let server = TcpServer::start("127.0.0.1", 0).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    // SAFETY: plain data in; only this child's limit changes.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = open + 12;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
    // Each accepted connection costs the server a descriptor and us 1:
    // a few connections exhaust the limit, the rest wait in the backlog.
    let mut clients = Vec::new();
    for _ in 0..8 {
        match TcpStream::connect(("127.0.0.1", server.port())) {
            Ok(c) => clients.push(c),
            Err(_) => break,
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let (c0, t0) = (cpu_time(), Instant::now());
    std::thread::sleep(Duration::from_millis(1000));
    let (cpu, wall) = (cpu_time() - c0, t0.elapsed());
    println!("cpu while out of descriptors: {cpu:?} in {wall:?} ({} clients)", clients.len());
    assert!(cpu < wall / 10, "the accept loop spins: {cpu:?} of CPU in {wall:?}");
    drop(clients);
    drop(server);
}

/// Regression: the server parsed a request again from its first byte after
/// every read, so a key list that arrives a few bytes at a time cost work
/// quadratic in its length (one rank could keep a core busy for minutes
/// with one CHECK). Now a scanner frames the request reading each byte
/// once. The child sends a CHECK of `MAX_KEYS` keys (the limit, 128 Ki; a
/// million before the limits became PyTorch's) in 4 KiB pieces and
/// measures its own CPU time (the server runs in it).
#[test]
fn trickled_key_list_costs_linear_work() {
    let out = run_ok(child_command("trickle", &[]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cpu for a trickled CHECK"), "{text}");
    println!("{}", text.lines().find(|l| l.contains("cpu for")).unwrap());
}

fn trickle_child() {
    let server = TcpServer::start("127.0.0.1", 0).unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let keys: Vec<Vec<u8>> = (0..MAX_KEYS as u32).map(|i| vec![(i % 251) as u8]).collect();
    let bytes = [Request::Validate(VALIDATION_MAGIC).to_bytes(), Request::Check(keys).to_bytes()].concat();
    let c0 = cpu_time();
    for piece in bytes.chunks(4096) {
        s.write_all(piece).unwrap();
        // Let the server read each piece on its own, as a slow sender's
        // pieces arrive.
        std::thread::sleep(Duration::from_micros(300));
    }
    let mut answer = [0u8; 1];
    s.read_exact(&mut answer).unwrap();
    let cpu = cpu_time() - c0;
    assert_eq!(answer[0], 1, "CHECK of keys nobody set");
    println!("cpu for a trickled CHECK of {MAX_KEYS} keys in {} pieces: {cpu:?}", bytes.len().div_ceil(4096));
    assert!(cpu < Duration::from_millis(2500), "the server re-parses: {cpu:?} of CPU");
}

/// An idle flood: hundreds of connections that sent half a request and
/// stopped. The server had a thread per connection (a task and a stack
/// each, up to the process's thread limit); one event loop serves them all
/// now. The child counts its own threads with the connections held open,
/// and a well-behaved client is answered beside them.
#[test]
fn idle_flood_costs_no_thread_per_connection() {
    let out = run_ok(child_command("idle_flood", &[]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("threads with"), "{text}");
    println!("{}", text.lines().find(|l| l.contains("threads with")).unwrap());
}

fn idle_flood_child() {
    let threads = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let server = TcpServer::start("127.0.0.1", 0).unwrap();
    let before = threads();
    let mut half = Request::Validate(VALIDATION_MAGIC).to_bytes();
    let set = Request::Set { key: b"/k".to_vec(), value: vec![1; 64] }.to_bytes();
    half.extend_from_slice(&set[..set.len() / 2]);
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
            s.write_all(&half).unwrap();
            s
        })
        .collect();
    // Every connection is accepted and its bytes read once this answers
    // (connections are served in the order they come).
    let store = TcpStore::open("127.0.0.1", server.port(), false, 0, Some(Duration::from_secs(30))).unwrap();
    store.set(b"after", b"v").unwrap();
    assert_eq!(store.get(b"after", None).unwrap(), b"v");
    let during = threads();
    println!("threads with {} idle connections: {during} (before them: {before})", idle.len());
    assert!(during < before + 10, "a thread per idle connection: {before} threads before, {during} with {} idle", idle.len());
    drop(idle);
}
