//! The manager daemon bounds what clients hold: names per connection and
//! in all, connections per process and in all, and gives names back when
//! their client goes. A client over a bound is closed; the others go on.
//! (Without bounds, 2,000,000 names grew the daemon to 1.2 GB, and 15,000
//! idle connections slowed every registration.) The bounds are lowered
//! through the daemon's environment so the test stays small.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, manager_bin, Parent, Peer};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use storage_sharing::manager::limits::ENV;
use storage_sharing::manager::protocol::AllocInfo;

const ENTRY: &str = "child_entry";

/// A daemon started with `limits` (names per client, names, clients per
/// pid, clients); stopped with SIGTERM on drop.
struct Daemon {
    child: Child,
    path: String,
}

impl Daemon {
    fn start(limits: [usize; 4]) -> Daemon {
        let mut cmd = Command::new(manager_bin());
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (var, value) in ENV.iter().zip(limits) {
            cmd.env(var, value.to_string());
        }
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let path = line.trim().to_string();
        assert!(path.ends_with("manager.sock"), "{line}");
        Daemon { child, path }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: our own child; it cleans up on SIGTERM.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn connect(path: &str) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Registers `name`: true on "OK", false when the daemon closed the
/// connection instead.
fn register(s: &mut UnixStream, name: &str) -> bool {
    if s.write_all(&AllocInfo::new(std::process::id() as i32, false, name).unwrap().encode()).is_err() {
        return false;
    }
    let mut ok = [0u8; 2];
    match s.read_exact(&mut ok) {
        Ok(()) => {
            assert_eq!(&ok, b"OK");
            true
        }
        Err(e) => {
            assert!(matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset), "{e}");
            false
        }
    }
}

/// Names nobody creates: the daemon only counts them.
fn name(tag: &str, i: usize) -> String {
    format!("/torch_{}_{tag}_{i}", std::process::id())
}

#[test]
fn child_entry() {
    child_main(|role, mut parent: Parent| match role {
        "connect" => {
            // Connects as many times as asked, registers one name on each,
            // reports which were served, and keeps them open until told.
            let (path, n) = parent.recv().split_once(' ').map(|(p, n)| (p.to_string(), n.parse::<usize>().unwrap())).unwrap();
            let mut conns = Vec::new();
            let mut served = Vec::new();
            for i in 0..n {
                let mut s = connect(&path);
                served.push(if register(&mut s, &name("child", i)) { "ok" } else { "closed" });
                conns.push(s);
            }
            parent.send(&served.join(" "));
            // Holds them until the parent says it has looked.
            parent.recv();
            drop(conns);
        }
        other => panic!("unknown role {other}"),
    });
}

#[test]
fn names_per_client_and_in_all_are_bounded_and_given_back_on_disconnect() {
    let d = Daemon::start([50, 80, 32, 4096]);
    let mut a = connect(&d.path);
    for i in 0..50 {
        assert!(register(&mut a, &name("a", i)), "registration {i} of 50 refused");
    }
    // A name it holds already costs nothing: still served at its bound.
    assert!(register(&mut a, &name("a", 7)));
    assert!(!register(&mut a, &name("a", 50)), "a client got a 51st name past its bound of 50");

    // Two clients together reach the daemon's bound of 80.
    let mut b = connect(&d.path);
    let mut c = connect(&d.path);
    for i in 0..50 {
        assert!(register(&mut b, &name("b", i)), "b: registration {i} refused");
    }
    for i in 0..30 {
        assert!(register(&mut c, &name("c", i)), "c: registration {i} refused");
    }
    assert!(!register(&mut c, &name("c", 30)), "the daemon tracked an 81st name past its bound of 80");
    // b is still served (names it holds), and its names go with it.
    assert!(register(&mut b, &name("b", 0)));
    drop(b);
    let mut e = connect(&d.path);
    let served = (0..50).take_while(|i| register(&mut e, &name("e", *i))).count();
    assert_eq!(served, 50, "the names of gone clients were not given back");
}

#[test]
fn connections_per_process_and_in_all_are_bounded() {
    let d = Daemon::start([1000, 10_000, 4, 6]);
    let mut mine: Vec<UnixStream> = Vec::new();
    for i in 0..4 {
        let mut s = connect(&d.path);
        assert!(register(&mut s, &name("p", i)), "connection {i} of 4 refused");
        mine.push(s);
    }
    let mut fifth = connect(&d.path);
    assert!(!register(&mut fifth, &name("p", 4)), "a 5th connection from one process was served past its bound of 4");
    drop(fifth);
    // Another process may have 2 more: the daemon's bound of 6 in all.
    let mut peer = Peer::spawn(ENTRY, "connect", "");
    peer.send(&format!("{} 3", d.path));
    assert_eq!(peer.recv(), "ok ok closed");
    peer.send("done");
    peer.finish();
    // Connections given back on close: ours are served again.
    mine.pop();
    let served = common::wait_until(Duration::from_secs(10), || {
        let mut s = connect(&d.path);
        let ok = register(&mut s, &name("p", 9));
        if ok {
            mine.push(s);
        }
        ok
    });
    assert!(served, "a closed connection's place was not given back");
}
