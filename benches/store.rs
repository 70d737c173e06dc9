//! Store set+get round trip on loopback: our TCPStore client against our
//! server and against PyTorch's (libuv and classic), PyTorch's client
//! against both (a Python timing loop, where torch imports), beside a bare
//! TCP echo of the same size measured in the same run (the floor for any
//! request-and-reply); the file store's set+get, and how soon a get
//! waiting in another thread returns after a set (set included).
//!
//! Run: `cargo bench --bench store`. Python with torch: $SS_TEST_PYTHON,
//! else python3 (rows marked skipped without it). SS_BENCH_QUICK=1 runs
//! fewer rounds.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use storage_sharing::store::{FileStore, Store, TcpStore};

#[path = "common/echo_floor.rs"]
mod echo_floor;
#[path = "common/torch_store_server.rs"]
mod torch_store_server;
use echo_floor::{echo_server, REPLY_BYTES, REQ_BYTES};
use torch_store_server::{python, script, torch_ok, TorchServer};

const VALUE: &[u8] = &[b'x'; 32];
const T: Option<Duration> = Some(Duration::from_secs(60));

/// PyTorch's client timing loop against `port`: median µs per set+get.
fn torch_client(port: u16, n: usize) -> f64 {
    let out =
        Command::new(python()).args([script(), "client".into(), port.to_string(), n.to_string()]).stderr(Stdio::null()).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| l.strip_prefix("US ")).expect("python client result").trim().parse().unwrap()
}

fn median(v: Vec<f64>) -> f64 {
    pct(v, 50)
}

fn pct(mut v: Vec<f64>, p: usize) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn main() {
    let quick = std::env::var_os("SS_BENCH_QUICK").is_some();
    let (rounds, per_round) = if quick { (20, 100) } else { (60, 300) };
    let torch = torch_ok();

    let echo_port = echo_server();
    let mut echo = TcpStream::connect(("127.0.0.1", echo_port)).unwrap();
    echo.set_nodelay(true).unwrap();
    let req = vec![7u8; REQ_BYTES];
    let mut reply = vec![0u8; REPLY_BYTES];

    let ours = TcpStore::open("127.0.0.1", 0, true, 0, T).unwrap();
    let ours_client = TcpStore::open("127.0.0.1", ours.port(), false, 0, T).unwrap();
    let torch_servers: Vec<(&str, TorchServer, TcpStore)> = if torch {
        [("libuv", true), ("classic", false)]
            .into_iter()
            .map(|(name, libuv)| {
                let s = TorchServer::start(libuv);
                let c = TcpStore::open("127.0.0.1", s.port, false, 0, T).unwrap();
                (name, s, c)
            })
            .collect()
    } else {
        Vec::new()
    };
    let dir = std::env::temp_dir().join(format!("ss-bench-store-{}", std::process::id()));
    let file = FileStore::open(&dir).unwrap();

    // Interleave the variants round by round so each sees the same load.
    let names = ["bare TCP echo", "ours -> ours"];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 2 + torch_servers.len() + 1];
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..20 {
            f();
        }
        let t0 = Instant::now();
        for _ in 0..per_round {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e6 / per_round as f64
    };
    for _ in 0..rounds {
        samples[0].push(time(&mut || {
            echo.write_all(&req).unwrap();
            echo.read_exact(&mut reply).unwrap();
        }));
        samples[1].push(time(&mut || {
            ours_client.set(b"bench/k", VALUE).unwrap();
            assert_eq!(ours_client.get(b"bench/k", T).unwrap().len(), VALUE.len());
        }));
        for (i, (_, _, c)) in torch_servers.iter().enumerate() {
            samples[2 + i].push(time(&mut || {
                c.set(b"bench/k", VALUE).unwrap();
                assert_eq!(c.get(b"bench/k", T).unwrap().len(), VALUE.len());
            }));
        }
        let f = samples.len() - 1;
        samples[f].push(time(&mut || {
            file.set(b"bench/k", VALUE).unwrap();
            assert_eq!(file.get(b"bench/k", T).unwrap().len(), VALUE.len());
        }));
    }
    let echo_us = median(samples[0].clone());
    let mut rows: Vec<(String, String, f64, f64)> = vec![
        (names[0].into(), "echo thread".into(), echo_us, pct(samples[0].clone(), 90)),
        (names[1].into(), "ours (threads)".into(), median(samples[1].clone()), pct(samples[1].clone(), 90)),
    ];
    for (i, (name, _, _)) in torch_servers.iter().enumerate() {
        let v = samples[2 + i].clone();
        rows.push(("ours -> PyTorch".into(), format!("PyTorch {name}"), median(v.clone()), pct(v, 90)));
    }
    if torch {
        let n = if quick { 2000 } else { 10000 };
        let us = torch_client(ours.port(), n);
        rows.push(("PyTorch (Python loop)".into(), "ours (threads)".into(), us, f64::NAN));
        for (name, s, _) in &torch_servers {
            let us = torch_client(s.port, n);
            rows.push(("PyTorch (Python loop)".into(), format!("PyTorch {name}"), us, f64::NAN));
        }
    }
    println!(
        "\nstore set+get round trip, loopback, {}-byte value, {rounds} rounds x {per_round} (Python rows: median of 5 batches)",
        VALUE.len()
    );
    println!("{:<24} {:<18} {:>10} {:>10} {:>10}", "client", "server", "median µs", "p90 µs", "x echo");
    for (c, s, us, p90) in &rows {
        let p90 = if p90.is_nan() { "-".to_string() } else { format!("{p90:.1}") };
        println!("{c:<24} {s:<18} {us:>10.1} {p90:>10} {:>10.2}", us / echo_us);
    }
    if !torch {
        println!("PyTorch rows: skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)");
    }
    let fs = samples[samples.len() - 1].clone();
    println!("{:<24} {:<18} {:>10.1} {:>10.1} {:>10}", "file store (set+get)", "folder in /tmp", median(fs.clone()), pct(fs, 90), "-");
    // How soon a rank waiting in get sees another's set (file store: the
    // waiter sleeps on the folder's inotify watch).
    let file = std::sync::Arc::new(file);
    let n = if quick { 50 } else { 200 };
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = {
        let file = file.clone();
        std::thread::spawn(move || {
            for i in 0..n {
                file.get(format!("wake/{i}").as_bytes(), T).unwrap();
                tx.send(Instant::now()).unwrap();
            }
        })
    };
    let mut wake = Vec::new();
    for i in 0..n {
        std::thread::sleep(Duration::from_millis(2)); // the waiter is asleep by now
        let t0 = Instant::now();
        file.set(format!("wake/{i}").as_bytes(), VALUE).unwrap();
        wake.push((rx.recv().unwrap() - t0).as_secs_f64() * 1e6);
    }
    waiter.join().unwrap();
    println!(
        "{:<24} {:<18} {:>10.1} {:>10.1} {:>10}",
        "file store set -> woken get",
        "another thread",
        median(wake.clone()),
        pct(wake, 90),
        "-"
    );
    let _ = std::fs::remove_dir_all(dir);
}
