//! TCPStore servers under load: ours against PyTorch's libuv server, side by
//! side in one run. N client connections (threads, raw sockets, PyTorch's
//! request bytes) each loop SET k, WAIT [k], GET k, ADD counter 1 (PyTorch's
//! client sends SET, then WAIT + GET for a get, and ADD) for a fixed time.
//! Every request counts as one operation. The server runs in its own
//! process, so its CPU time (utime + stime from /proc/<pid>/stat) divided by
//! the operations completed is a figure that holds on a loaded machine.
//!
//! A second table is the single-client round trip: a set+get with our client
//! and with PyTorch's (Python) client against each server, beside a bare TCP
//! request/reply of the same bytes (the floor).
//!
//! Run: `SS_TEST_PYTHON=/path/to/python cargo bench --bench store_server`.
//! SS_BENCH_RUNS (default 3) runs per cell, SS_BENCH_SECS (default 2) seconds
//! each, SS_BENCH_CLIENTS (default "16,256"), SS_BENCH_OURS_BIN (another
//! build of this bench to serve as "ours", for before/after comparisons).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use storage_sharing::store::tcp::protocol::{Request, VALIDATION_MAGIC};
use storage_sharing::store::tcp::server::TcpServer;
use storage_sharing::store::{Store, TcpStore};

#[path = "common/echo_floor.rs"]
mod echo_floor;
use echo_floor::{echo_server, REPLY_BYTES, REQ_BYTES};

const SERVE_ENV: &str = "SS_BENCH_STORE_SERVE";
const VALUE: &[u8] = &[b'x'; 32];
const T: Option<Duration> = Some(Duration::from_secs(60));

fn python() -> String {
    std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn torch_script() -> String {
    format!("{}/benches/store_torch.py", env!("CARGO_MANIFEST_DIR"))
}

fn torch_ok() -> bool {
    Command::new(python()).args(["-c", "import torch.distributed"]).output().is_ok_and(|o| o.status.success())
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A server in a child process: ours (this binary again) or PyTorch's.
struct ServerProcess {
    child: Child,
    port: u16,
}

impl ServerProcess {
    fn start(ours: bool) -> ServerProcess {
        let mut cmd = if ours {
            // SS_BENCH_OURS_BIN: another build of this bench, to serve
            // (an A/B comparison of two versions of our server).
            let exe = std::env::var_os("SS_BENCH_OURS_BIN").map_or_else(|| std::env::current_exe().unwrap(), Into::into);
            let mut c = Command::new(exe);
            c.env(SERVE_ENV, "1");
            c
        } else {
            let mut c = Command::new(python());
            c.args([torch_script().as_str(), "server", "1"]);
            c
        };
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().strip_prefix("PORT ").expect("server port").parse().unwrap();
        ServerProcess { child, port }
    }

    /// The process's CPU time so far (user + system, all its threads).
    fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the command name (which is in parentheses).
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<u64> = rest.split(' ').skip(11).take(2).map(|x| x.parse().unwrap()).collect();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        Duration::from_nanos((f[0] + f[1]) * 1_000_000_000 / hz)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Runs our server until stdin closes (the child side of [`ServerProcess`]).
fn serve_ours() {
    let server = TcpServer::start("127.0.0.1", 0).unwrap();
    println!("PORT {}", server.port());
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(server);
}

struct Cell {
    ops_per_s: f64,
    cpu_us_per_op: f64,
    p50_us: f64,
    p99_us: f64,
}

fn connect(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(T).unwrap();
    // As PyTorch's client: VALIDATE, then a PING it waits for (so every
    // connection is served before the clock starts).
    s.write_all(&[Request::Validate(VALIDATION_MAGIC).to_bytes(), Request::Ping(7).to_bytes()].concat()).unwrap();
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).unwrap();
    assert_eq!(u32::from_le_bytes(echo), 7);
    s
}

/// One client's loop: returns its latency samples (ns, replied requests
/// only, taken while `measuring`).
fn client_loop(mut s: TcpStream, id: usize, ops: &AtomicU64, measuring: &AtomicBool, stop: &AtomicBool) -> Vec<u32> {
    let mut lat = Vec::with_capacity(1 << 16);
    let counter = b"/bench/counter".to_vec();
    let mut reply = vec![0u8; 8 + VALUE.len()];
    let mut i = 0u64;
    let timed = |s: &mut TcpStream, req: &[u8], reply: &mut [u8], lat: &mut Vec<u32>| {
        let t0 = Instant::now();
        s.write_all(req).unwrap();
        s.read_exact(reply).unwrap();
        if measuring.load(Ordering::Relaxed) {
            lat.push(t0.elapsed().as_nanos().min(u32::MAX as u128) as u32);
        }
    };
    while !stop.load(Ordering::Relaxed) {
        let key = format!("/bench/{id}/{}", i % 64).into_bytes();
        let set = Request::Set { key: key.clone(), value: VALUE.to_vec() }.to_bytes();
        s.write_all(&set).unwrap();
        timed(&mut s, &Request::Wait(vec![key.clone()]).to_bytes(), &mut reply[..1], &mut lat);
        timed(&mut s, &Request::Get(key).to_bytes(), &mut reply[..8 + VALUE.len()], &mut lat);
        timed(&mut s, &Request::Add { key: counter.clone(), delta: 1 }.to_bytes(), &mut reply[..8], &mut lat);
        ops.fetch_add(4, Ordering::Relaxed);
        i += 1;
    }
    lat
}

/// `clients` connections against `server` for `secs` seconds (after a warm-up).
fn load(server: &ServerProcess, clients: usize, secs: f64) -> Cell {
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let counters: Arc<Vec<AtomicU64>> = Arc::new((0..clients).map(|_| AtomicU64::new(0)).collect());
    let start = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|id| {
            let s = connect(server.port);
            let (stop, measuring, counters, start) = (stop.clone(), measuring.clone(), counters.clone(), start.clone());
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    start.wait();
                    client_loop(s, id, &counters[id], &measuring, &stop)
                })
                .unwrap()
        })
        .collect();
    start.wait();
    std::thread::sleep(Duration::from_millis(500));
    let total = || counters.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
    measuring.store(true, Ordering::Relaxed);
    let (ops0, cpu0, t0) = (total(), server.cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (ops1, cpu1, wall) = (total(), server.cpu(), t0.elapsed());
    measuring.store(false, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let mut lat: Vec<u32> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    lat.sort_unstable();
    let ops = (ops1 - ops0) as f64;
    assert!(!lat.is_empty(), "no reply in {wall:?} ({} ops)", ops1 - ops0);
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] as f64 / 1e3;
    Cell {
        ops_per_s: ops / wall.as_secs_f64(),
        cpu_us_per_op: (cpu1 - cpu0).as_secs_f64() * 1e6 / ops,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
    }
}

/// Median, min and max.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn show(v: Vec<f64>, digits: usize) -> String {
    let (m, lo, hi) = spread(v);
    format!("{m:.digits$} ({lo:.digits$}-{hi:.digits$})")
}

/// Median µs of `n` calls of `f`, in 5 batches.
fn time_us(n: usize, f: &mut dyn FnMut()) -> f64 {
    for _ in 0..200 {
        f();
    }
    let mut v = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..n / 5 {
            f();
        }
        v.push(t0.elapsed().as_secs_f64() * 1e6 / (n / 5) as f64);
    }
    spread(v).0
}

fn python_client_us(port: u16, n: usize) -> f64 {
    let out = Command::new(python())
        .args([torch_script(), "client".into(), port.to_string(), n.to_string()])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| l.strip_prefix("US ")).expect("python client result").trim().parse().unwrap()
}

fn main() {
    if std::env::var_os(SERVE_ENV).is_some() {
        return serve_ours();
    }
    let runs: usize = env_or("SS_BENCH_RUNS", 3);
    let secs: f64 = env_or("SS_BENCH_SECS", 2.0);
    let counts: Vec<usize> = std::env::var("SS_BENCH_CLIENTS")
        .unwrap_or_else(|_| "16,256".into())
        .split(',')
        .map(|c| c.trim().parse().expect("SS_BENCH_CLIENTS: numbers"))
        .collect();
    let torch = torch_ok();
    let servers: Vec<(&str, bool)> = if torch { vec![("ours", true), ("PyTorch libuv", false)] } else { vec![("ours", true)] };

    // cells[server][count] = one Cell per run; runs interleave the servers
    // so both see the same machine load.
    let mut cells: Vec<Vec<Vec<Cell>>> = servers.iter().map(|_| counts.iter().map(|_| Vec::new()).collect()).collect();
    for _ in 0..runs {
        for (c, &n) in counts.iter().enumerate() {
            for (s, &(_, ours)) in servers.iter().enumerate() {
                let server = ServerProcess::start(ours);
                cells[s][c].push(load(&server, n, secs));
            }
        }
    }
    println!("\nTCPStore servers under load: SET, WAIT, GET, ADD per client loop, each request one op; {runs} runs x {secs} s,");
    println!("median (min-max); loopback; server CPU = its process's utime+stime / ops");
    println!("{:<15} {:>7} {:>22} {:>22} {:>22} {:>22}", "server", "clients", "ops/s", "server CPU µs/op", "p50 µs", "p99 µs");
    for (c, &n) in counts.iter().enumerate() {
        for (s, (name, _)) in servers.iter().enumerate() {
            let v = &cells[s][c];
            println!(
                "{name:<15} {n:>7} {:>22} {:>22} {:>22} {:>22}",
                show(v.iter().map(|x| x.ops_per_s).collect(), 0),
                show(v.iter().map(|x| x.cpu_us_per_op).collect(), 2),
                show(v.iter().map(|x| x.p50_us).collect(), 1),
                show(v.iter().map(|x| x.p99_us).collect(), 1),
            );
        }
    }
    if !torch {
        println!("PyTorch rows: skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)");
    }

    // Single-client round trips against the floor.
    let echo_port = echo_server();
    let mut echo = TcpStream::connect(("127.0.0.1", echo_port)).unwrap();
    echo.set_nodelay(true).unwrap();
    let (req, mut reply) = (vec![7u8; REQ_BYTES], vec![0u8; REPLY_BYTES]);
    let procs: Vec<ServerProcess> = servers.iter().map(|&(_, ours)| ServerProcess::start(ours)).collect();
    let clients: Vec<TcpStore> = procs.iter().map(|p| TcpStore::open("127.0.0.1", p.port, false, 0, T).unwrap()).collect();
    let n = 3000;
    let mut floor = Vec::new();
    let mut ours_rtt: Vec<Vec<f64>> = vec![Vec::new(); servers.len()];
    let mut py_rtt: Vec<Vec<f64>> = vec![Vec::new(); servers.len()];
    for _ in 0..runs {
        floor.push(time_us(n, &mut || {
            echo.write_all(&req).unwrap();
            echo.read_exact(&mut reply).unwrap();
        }));
        for (s, c) in clients.iter().enumerate() {
            ours_rtt[s].push(time_us(n, &mut || {
                c.set(b"bench/k", VALUE).unwrap();
                assert_eq!(c.get(b"bench/k", T).unwrap().len(), VALUE.len());
            }));
            if torch {
                py_rtt[s].push(python_client_us(procs[s].port, n));
            }
        }
    }
    let floor_m = spread(floor.clone()).0;
    println!("\none client, set+get of a 32-byte value, µs: median (min-max) of {runs} runs; x floor = median / floor median");
    println!("{:<30} {:<15} {:>22} {:>8}", "client", "server", "µs per set+get", "x floor");
    println!("{:<30} {:<15} {:>22} {:>8.2}", "bare TCP request/reply", "echo thread", show(floor, 1), 1.0);
    for (s, (name, _)) in servers.iter().enumerate() {
        let m = spread(ours_rtt[s].clone()).0;
        println!("{:<30} {name:<15} {:>22} {:>8.2}", "ours (Rust)", show(ours_rtt[s].clone(), 1), m / floor_m);
    }
    if torch {
        for (s, (name, _)) in servers.iter().enumerate() {
            let m = spread(py_rtt[s].clone()).0;
            println!("{:<30} {name:<15} {:>22} {:>8.2}", "PyTorch client (Python loop)", show(py_rtt[s].clone(), 1), m / floor_m);
        }
    }
}
