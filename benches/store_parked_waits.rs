//! ADD latency on a TCPStore server while other connections hold many WAIT
//! keys parked (issue 30, A6): ours beside PyTorch's libuv server, with no
//! keys parked and with 32 connections each parking one WAIT of 131,072
//! keys (PyTorch's per-request limit). A server that rescans every parked
//! key on each write slows every other client's ADD with the number parked;
//! one that indexes waiters by key does not.
//!
//! One raw client (PyTorch's request bytes) times ADD round trips one at a
//! time. Run: `SS_TEST_PYTHON=/path/to/python cargo bench --bench
//! store_parked_waits`. SS_BENCH_RUNS (default 3) runs per cell,
//! SS_BENCH_ADDS (default 2000) ADDs per run, SS_BENCH_PARKED (default
//! "32x131072": connections x keys each).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use storage_sharing::store::tcp::protocol::{Request, VALIDATION_MAGIC};
use storage_sharing::store::tcp::server::TcpServer;

#[path = "common/torch_store_server.rs"]
mod torch_store_server;
use torch_store_server::{torch_ok, TorchServer};

const T: Option<Duration> = Some(Duration::from_secs(600));

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A running server: ours in this process, or PyTorch's libuv server in a
/// Python child (benches/store_torch.py), stopped when dropped.
enum Server {
    Ours(TcpServer),
    Torch(TorchServer),
}

impl Server {
    fn start(ours: bool) -> Server {
        if ours {
            return Server::Ours(TcpServer::start("127.0.0.1", 0).unwrap());
        }
        Server::Torch(TorchServer::start(true))
    }

    fn port(&self) -> u16 {
        match self {
            Server::Ours(s) => s.port(),
            Server::Torch(t) => t.port,
        }
    }
}

fn connect(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(T).unwrap();
    s.write_all(&Request::Validate(VALIDATION_MAGIC).to_bytes()).unwrap();
    s
}

/// Sends a PING and waits for its echo: every request sent before it on
/// this connection has been handled.
fn ping(s: &mut TcpStream, nonce: u32) {
    s.write_all(&Request::Ping(nonce).to_bytes()).unwrap();
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).unwrap();
    assert_eq!(u32::from_le_bytes(echo), nonce);
}

/// `conns` connections, each with one WAIT of `keys` keys parked.
fn park(port: u16, conns: usize, keys: usize) -> Vec<TcpStream> {
    (0..conns)
        .map(|c| {
            let mut s = connect(port);
            let wait = Request::Wait((0..keys).map(|i| format!("/parked/{c}/{i}").into_bytes()).collect());
            s.write_all(&wait.to_bytes()).unwrap();
            ping(&mut s, c as u32);
            s
        })
        .collect()
}

/// Median and 99th percentile µs of `n` ADD round trips.
fn add_latency(port: u16, n: usize) -> (f64, f64) {
    let mut s = connect(port);
    let add = Request::Add { key: b"/bench/counter".to_vec(), delta: 1 }.to_bytes();
    let mut reply = [0u8; 8];
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + 100 {
        let t0 = Instant::now();
        s.write_all(&add).unwrap();
        s.read_exact(&mut reply).unwrap();
        if i >= 100 {
            lat.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (lat[lat.len() / 2], lat[(lat.len() * 99 / 100).min(lat.len() - 1)])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let runs: usize = env_or("SS_BENCH_RUNS", 3);
    let adds: usize = env_or("SS_BENCH_ADDS", 2000);
    let parked = std::env::var("SS_BENCH_PARKED").unwrap_or_else(|_| "32x131072".into());
    let (conns, keys) = parked.split_once('x').map(|(c, k)| (c.parse().unwrap(), k.parse().unwrap())).expect("SS_BENCH_PARKED: CONNSxKEYS");
    let torch = torch_ok();
    let servers: Vec<(&str, bool)> = if torch { vec![("ours", true), ("PyTorch libuv", false)] } else { vec![("ours", true)] };
    println!("\nADD round trip beside parked WAIT keys: one raw client, {adds} ADDs per run, median of {runs} runs; loopback");
    println!("{:<15} {:>14} {:>14} {:>14} {:>12}", "server", "parked keys", "ADD p50 µs", "ADD p99 µs", "park s");
    for &(name, ours) in &servers {
        for (c, k) in [(0usize, 0usize), (conns, keys)] {
            let (mut p50, mut p99, mut secs) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..runs {
                let server = Server::start(ours);
                let t0 = Instant::now();
                let held = park(server.port(), c, k);
                secs.push(t0.elapsed().as_secs_f64());
                let (a, b) = add_latency(server.port(), adds);
                p50.push(a);
                p99.push(b);
                drop(held);
                drop(server);
            }
            println!("{name:<15} {:>14} {:>14.1} {:>14.1} {:>12.1}", c * k, median(p50), median(p99), median(secs));
        }
    }
    if !torch {
        println!("PyTorch rows: skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)");
    }
}
