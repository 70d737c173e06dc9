//! The TCPStore protocol: our client and server across processes, against
//! PyTorch's server (libuv and classic) and PyTorch's client, misbehaving
//! servers (bad replies, gone away, port in use), and a property test of
//! the request parser.

#[path = "../common/mod.rs"]
mod common;

use common::{child_command, my_role, python, torch_available};
use proptest::prelude::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use storage_sharing::store::tcp::protocol::{parse_request, Request};
use storage_sharing::store::{Store, TcpStore};
use storage_sharing::ErrorKind;

const T: Option<Duration> = Some(Duration::from_secs(30));

fn peer_script() -> String {
    format!("{}/tests/python/tcpstore_peer.py", env!("CARGO_MANIFEST_DIR"))
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    let port: u16 = args[0].parse().unwrap();
    match role.as_str() {
        "rank" => {
            let rank: usize = args[1].parse().unwrap();
            let s = TcpStore::open("127.0.0.1", port, false, 3, T).unwrap();
            for _ in 0..100 {
                s.add(b"counter", 1).unwrap();
            }
            s.set(format!("rank/{rank}").as_bytes(), format!("value of {rank}").as_bytes()).unwrap();
            s.wait(&[b"rank/0".as_slice(), b"rank/1", b"rank/2"], T).unwrap();
            for r in 0..3 {
                assert_eq!(s.get(format!("rank/{r}").as_bytes(), T).unwrap(), format!("value of {r}").as_bytes());
            }
            println!("RANK_OK");
        }
        "master" => {
            let s = TcpStore::open("127.0.0.1", port, true, 0, T).unwrap();
            s.set(b"ready", b"1").unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown role {other}"),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn three_ranks_in_three_processes_through_our_server() {
    let port = free_port();
    let p = port.to_string();
    let kids: Vec<_> = (1..3).map(|r| child_command("rank", &[&p, &r.to_string()]).stdout(Stdio::piped()).spawn().unwrap()).collect();
    // The master returns once all three ranks joined (init/ counter).
    let s = TcpStore::open("127.0.0.1", port, true, 3, T).unwrap();
    assert_eq!(s.port(), port);
    assert_eq!(s.describe(), format!("TCPStore at 127.0.0.1:{port}"));
    for _ in 0..100 {
        s.add(b"counter", 1).unwrap();
    }
    s.set(b"rank/0", b"value of 0").unwrap();
    s.wait(&[b"rank/0".as_slice(), b"rank/1", b"rank/2"], T).unwrap();
    for k in kids {
        let out = k.wait_with_output().unwrap();
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("RANK_OK"));
    }
    assert_eq!(s.add(b"counter", 0).unwrap(), 300);
    assert!(s.check(&[b"rank/1".as_slice(), b"rank/2"]).unwrap());
}

#[test]
fn timeouts_name_keys_and_the_connection_stays_usable() {
    let s = TcpStore::open("127.0.0.1", 0, true, 0, T).unwrap();
    let addr = format!("127.0.0.1:{}", s.port());
    s.set(b"here", b"x").unwrap();
    let t0 = Instant::now();
    let e = s.wait(&[b"here".as_slice(), b"g/0/1", b"g/0/2"], Some(Duration::from_millis(100))).unwrap_err();
    assert!(t0.elapsed() >= Duration::from_millis(100));
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.message().contains("\"g/0/1\", \"g/0/2\"") && !e.message().contains("\"here\""), "{e}");
    assert!(e.message().contains(&addr), "{e}");
    let e = s.get(b"late", Some(Duration::from_millis(50))).unwrap_err();
    assert!(e.message().contains("\"late\""), "{e}");
    // After the cancelled waits the connection is still in step.
    assert_eq!(s.get(b"here", T).unwrap(), b"x");
    let s2 = std::sync::Arc::new(s);
    let s3 = s2.clone();
    let setter = std::thread::spawn(move || {
        let c = TcpStore::open("127.0.0.1", s3.port(), false, 0, T).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        c.set(b"late", b"now").unwrap();
    });
    assert_eq!(s2.get(b"late", T).unwrap(), b"now");
    setter.join().unwrap();
    assert_eq!(s2.get(b"empty-or-not", Some(Duration::from_millis(1))).unwrap_err().kind(), ErrorKind::Timeout);
    s2.set(b"e", b"").unwrap();
    assert_eq!(s2.get(b"e", T).unwrap(), b"");
}

#[test]
fn a_blocked_get_does_not_hold_up_a_set_from_another_thread() {
    let s = std::sync::Arc::new(TcpStore::open("127.0.0.1", 0, true, 0, T).unwrap());
    let s2 = s.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        s2.set(b"k", b"v").unwrap();
    });
    assert_eq!(s.get(b"k", None).unwrap(), b"v");
    setter.join().unwrap();
}

#[test]
fn port_in_use_and_no_server_are_typed_errors_naming_the_address() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = TcpStore::open("127.0.0.1", port, true, 0, T).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");
    drop(taken);
    let port = free_port();
    let t0 = Instant::now();
    let e = TcpStore::open("127.0.0.1", port, false, 0, Some(Duration::from_millis(300))).err().unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");
}

/// A server that answers the handshake, then plays `script` on the next
/// request.
fn rogue_server(script: fn(&mut TcpStream)) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut hello = [0u8; 10];
        c.read_exact(&mut hello).unwrap();
        c.write_all(&hello[6..10]).unwrap();
        script(&mut c);
    });
    port
}

#[test]
fn bad_replies_and_a_vanished_server_are_typed_errors() {
    // CHECK answered with a byte that is neither READY nor NOT_READY.
    let port = rogue_server(|c| {
        let mut b = [0u8; 64];
        let _ = c.read(&mut b).unwrap();
        c.write_all(&[7]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let s = TcpStore::open("127.0.0.1", port, false, 0, T).unwrap();
    let e = s.check(&[b"k".as_slice()]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");

    // A server that closes the connection mid-request.
    let port = rogue_server(|c| {
        let mut b = [0u8; 64];
        let _ = c.read(&mut b).unwrap();
    });
    let s = TcpStore::open("127.0.0.1", port, false, 0, T).unwrap();
    let e = s.add(b"n", 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");

    // A reply length beyond any sane value.
    let port = rogue_server(|c| {
        let mut b = [0u8; 64];
        let _ = c.read(&mut b).unwrap();
        c.write_all(&u64::MAX.to_le_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let s = TcpStore::open("127.0.0.1", port, false, 0, T).unwrap();
    assert_eq!(s.get(b"k", T).unwrap_err().kind(), ErrorKind::Protocol);

    // A handshake answered with the wrong nonce.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut hello = [0u8; 10];
        c.read_exact(&mut hello).unwrap();
        c.write_all(&[1, 2, 3, 4]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let e = TcpStore::open("127.0.0.1", port, false, 0, T).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
}

/// Stands in front of our server as PyTorch's servers before 2.5 do: a
/// connection whose first query after `VALIDATE` is `PING`, which they do
/// not know, is closed; every other byte is relayed both ways. Returns
/// the port and the count of connections closed on `PING`.
fn server_without_ping(server_port: u16) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let refused = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = refused.clone();
    std::thread::spawn(move || {
        for client in l.incoming() {
            let mut client = client.unwrap();
            // VALIDATE is the query byte and a 4-byte magic; then the
            // next query's byte.
            let mut first = [0u8; 6];
            if client.read_exact(&mut first).is_err() {
                continue;
            }
            if first[5] == 13 {
                counted.fetch_add(1, Ordering::SeqCst);
                continue; // dropped: closed
            }
            let mut upstream = TcpStream::connect(("127.0.0.1", server_port)).unwrap();
            upstream.write_all(&first).unwrap();
            let (mut c2, mut u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut c2, &mut u2));
            std::thread::spawn(move || std::io::copy(&mut upstream, &mut client));
        }
    });
    (port, refused)
}

#[test]
fn a_server_older_than_ping_is_validated_with_getnumkeys() {
    use std::sync::atomic::Ordering;
    let master = TcpStore::open("127.0.0.1", 0, true, 0, T).unwrap();
    let (port, refused) = server_without_ping(master.port());
    let s = std::sync::Arc::new(TcpStore::open("127.0.0.1", port, false, 0, T).unwrap());
    assert_eq!(refused.load(Ordering::SeqCst), 1, "one PING tried, then the older handshake");
    s.set(b"k", b"v").unwrap();
    assert_eq!(master.get(b"k", T).unwrap(), b"v");
    assert_eq!(s.add(b"n", 5).unwrap(), 5);
    // A wait takes a connection of its own: validated without PING too.
    let s2 = s.clone();
    let waiter = std::thread::spawn(move || s2.get(b"late", T).unwrap());
    std::thread::sleep(Duration::from_millis(50));
    master.set(b"late", b"now").unwrap();
    assert_eq!(waiter.join().unwrap(), b"now");
    assert_eq!(refused.load(Ordering::SeqCst), 1, "PING is not tried again on this handle");
}

#[test]
fn a_master_killed_with_9_leaves_its_clients_a_peer_gone_error() {
    let port = free_port();
    let mut master = child_command("master", &[&port.to_string()]).stdout(Stdio::null()).spawn().unwrap();
    let s = TcpStore::open("127.0.0.1", port, false, 0, T).unwrap();
    assert_eq!(s.get(b"ready", T).unwrap(), b"1");
    master.kill().unwrap();
    master.wait().unwrap();
    // A set has no reply, yet it still learns that the server is gone.
    let e = s.set(b"k", b"v").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");
    let e = s.get(b"never", T).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");
}

/// Our half of the exchange in tests/python/tcpstore_peer.py.
fn play_exchange(s: &TcpStore) {
    s.set(b"from_c", b"hello from C").unwrap();
    assert_eq!(s.get(b"from_py", T).unwrap(), b"hello\0from python");
    s.add(b"counter", 5).unwrap();
    s.set(b"after_add", b"").unwrap();
    s.wait(&[b"py_done".as_slice()], T).unwrap();
    assert_eq!(s.get(b"counter", T).unwrap(), b"15");
    assert_eq!(s.get(b"m2", T).unwrap(), b"bb");
    assert_eq!(s.get(b"ap", T).unwrap(), b"1234");
    assert!(!s.check(&[b"cas".as_slice()]).unwrap());
    s.set(b"c_done", b"1").unwrap();
}

fn wait_ok(mut child: std::process::Child) {
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success() && out.contains("PY_OK"), "python side failed: {status}\n{out}");
}

#[test]
fn our_client_against_pytorch_servers() {
    if !torch_available("our_client_against_pytorch_servers") {
        return;
    }
    for libuv in ["1", "0"] {
        let mut child = Command::new(python()).args([&peer_script(), "server", libuv]).stdout(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        let port: u16 = line.trim().strip_prefix("PORT ").unwrap_or_else(|| panic!("python said {line:?}")).parse().unwrap();
        let s = TcpStore::open("127.0.0.1", port, false, 2, T).unwrap();
        play_exchange(&s);
        child.stdout = Some(lines.into_inner());
        wait_ok(child);
        println!("our client against PyTorch's {} server: ok", if libuv == "1" { "libuv" } else { "classic" });
    }
}

#[test]
fn pytorch_client_against_our_server() {
    if !torch_available("pytorch_client_against_our_server") {
        return;
    }
    let port = free_port();
    let child = Command::new(python()).args([&peer_script(), "client", &port.to_string()]).stdout(Stdio::piped()).spawn().unwrap();
    // Returns once PyTorch's client joined (it adds 1 to init/ too).
    let s = TcpStore::open("127.0.0.1", port, true, 2, T).unwrap();
    play_exchange(&s);
    wait_ok(child);
}

#[test]
fn pytorch_client_queues_list_keys_and_barrier_against_our_server() {
    if !torch_available("pytorch_client_queues_list_keys_and_barrier_against_our_server") {
        return;
    }
    let port = free_port();
    let _server = TcpStore::open("127.0.0.1", port, true, 0, T).unwrap();
    let child = Command::new(python()).args([&peer_script(), "extended", &port.to_string()]).stdout(Stdio::piped()).spawn().unwrap();
    wait_ok(child);
}

fn arb_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..40)
}

fn arb_request() -> impl Strategy<Value = Request> {
    let keys = || proptest::collection::vec(arb_bytes(), 0..5);
    prop_oneof![
        any::<u32>().prop_map(Request::Validate),
        (arb_bytes(), arb_bytes()).prop_map(|(key, value)| Request::Set { key, value }),
        (arb_bytes(), arb_bytes(), arb_bytes()).prop_map(|(key, expected, desired)| Request::CompareSet { key, expected, desired }),
        arb_bytes().prop_map(Request::Get),
        (arb_bytes(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        keys().prop_map(Request::Check),
        keys().prop_map(Request::Wait),
        Just(Request::GetNumKeys),
        arb_bytes().prop_map(Request::DeleteKey),
        (arb_bytes(), arb_bytes()).prop_map(|(key, value)| Request::Append { key, value }),
        keys().prop_map(Request::MultiGet),
        proptest::collection::vec((arb_bytes(), arb_bytes()), 0..4).prop_map(Request::MultiSet),
        Just(Request::CancelWait),
        any::<u32>().prop_map(Request::Ping),
        (arb_bytes(), arb_bytes()).prop_map(|(key, value)| Request::QueuePush { key, value }),
        arb_bytes().prop_map(Request::QueuePop),
        arb_bytes().prop_map(Request::QueueLen),
        Just(Request::ListKeys),
        (arb_bytes(), any::<i64>()).prop_map(|(key, world_size)| Request::Barrier { key, world_size }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Every request survives encode -> parse, also when it arrives in
    /// two pieces and followed by the next one.
    #[test]
    fn requests_round_trip(a in arb_request(), b in arb_request(), cut in any::<prop::sample::Index>()) {
        let (ea, eb) = (a.to_bytes(), b.to_bytes());
        let both = [ea.clone(), eb].concat();
        let at = cut.index(ea.len());
        prop_assert_eq!(parse_request(&both[..at]).unwrap(), None);
        let (got, used) = parse_request(&both).unwrap().unwrap();
        prop_assert_eq!(got, a);
        prop_assert_eq!(used, ea.len());
        let (got_b, _) = parse_request(&both[used..]).unwrap().unwrap();
        prop_assert_eq!(got_b, b);
    }

    /// Arbitrary bytes never panic, and a parsed request never claims more
    /// bytes than it was given.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(Some((_, used))) = parse_request(&bytes) {
            prop_assert!(used <= bytes.len() && used > 0);
        }
    }

    /// Corrupting one byte of a valid request gives a request, "need more",
    /// or a protocol error: never a panic or an overrun.
    #[test]
    fn mutated_requests_never_panic(r in arb_request(), at in any::<prop::sample::Index>(), v in any::<u8>()) {
        let mut bytes = r.to_bytes();
        let i = at.index(bytes.len());
        bytes[i] = v;
        match parse_request(&bytes) {
            Ok(Some((_, used))) => prop_assert!(used <= bytes.len()),
            Ok(None) => {}
            Err(e) => prop_assert_eq!(e.kind(), ErrorKind::Protocol),
        }
    }
}

/// ADD on a key that holds no integer: the server (ours, as PyTorch's)
/// closes the connection. The client must say so, not that the server
/// went away (found in review: it said SS_ERR_PEER_GONE while the server
/// ran on).
#[test]
fn add_to_a_non_integer_is_invalid_argument_not_a_vanished_server() {
    let s = TcpStore::open("127.0.0.1", 0, true, 0, T).unwrap();
    let c = TcpStore::open("127.0.0.1", s.port(), false, 0, T).unwrap();
    c.set(b"text", b"hello").unwrap();
    let e = c.add(b"text", 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("\"text\"") && e.message().contains("integer"), "{e}");
    assert!(e.message().contains(&format!("127.0.0.1:{}", s.port())), "{e}");
    // The store is still fine, on this client and the server's own.
    assert_eq!(c.add(b"n", 2).unwrap(), 2);
    assert_eq!(c.get(b"text", T).unwrap(), b"hello");
    assert_eq!(s.add(b"n", 3).unwrap(), 5);
}
