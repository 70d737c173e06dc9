//! Symmetric memory on the CPU backend, two processes:
//!  - put/wait round trip and barrier, beside a raw cache-line ping-pong
//!    between two processes (one shared atomic word, spin only) measured in
//!    the same run: the physical floor for a signal there and back;
//!  - rendezvous time for 2 and 4 ranks through the file store and through
//!    a TCPStore on loopback (rank 0 serves it).
//!
//! Every rank is a forked child; results come back through a shared page.
//! Run: `cargo bench --bench symm` (SS_BENCH_QUICK=1 for fewer rounds).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::tcp::TcpStore;
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::{self, group, DeviceType};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(60));

/// A shared anonymous mapping of `n` u64 slots, visible to forked children.
struct Shared {
    base: *mut AtomicU64,
    n: usize,
}

impl Shared {
    fn new(n: usize) -> Shared {
        // SAFETY: a fresh shared anonymous mapping, zero-filled.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), n * 8, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        Shared { base: p.cast(), n }
    }
    fn at(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.n);
        // SAFETY: inside the mapping, 8-aligned, lives as long as self.
        unsafe { &*self.base.add(i) }
    }
    fn f64_at(&self, i: usize) -> f64 {
        f64::from_bits(self.at(i).load(Ordering::SeqCst))
    }
    fn set_f64(&self, i: usize, v: f64) {
        self.at(i).store(v.to_bits(), Ordering::SeqCst)
    }
}

/// Runs `f(rank)` in `ws` forked children and waits for them.
fn fork_ranks(ws: usize, f: impl Fn(usize)) {
    let mut pids = Vec::new();
    for r in 0..ws {
        // SAFETY: the bench is single-threaded here; the child runs `f`
        // and leaves with _exit, never returning into the parent's code.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(r))).is_ok();
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        pids.push(pid);
    }
    for pid in pids {
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "a rank failed");
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Raw ping-pong: rank 0 writes odd numbers, rank 1 answers with the next
/// even one, in one cache line. ns per round trip, `reps` runs of `n`.
fn raw_ping_pong(n: u64, reps: usize) -> Vec<f64> {
    let sh = Shared::new(16 + reps);
    fork_ranks(2, |rank| {
        let flag = sh.at(0);
        for rep in 0..reps as u64 {
            let base = rep * 2 * n;
            let t = Instant::now();
            for i in 0..n {
                if rank == 0 {
                    flag.store(base + 2 * i + 1, Ordering::Release);
                    while flag.load(Ordering::Acquire) != base + 2 * i + 2 {
                        std::hint::spin_loop();
                    }
                } else {
                    while flag.load(Ordering::Acquire) != base + 2 * i + 1 {
                        std::hint::spin_loop();
                    }
                    flag.store(base + 2 * i + 2, Ordering::Release);
                }
            }
            if rank == 0 {
                sh.set_f64(16 + rep as usize, t.elapsed().as_nanos() as f64 / n as f64);
            }
        }
    });
    (0..reps).map(|r| sh.f64_at(16 + r)).collect()
}

/// Sets up group `name` of `ws` ranks on a file store in `dir`.
fn join(dir: &std::path::Path, name: &str, rank: usize, ws: usize) {
    let store: StoreRef = Arc::new(FileStore::open(dir).unwrap());
    group::set_group_info(name, rank as i64, ws as i64, store).unwrap();
}

/// put/wait round trips and barriers between 2 ranks: ns per operation.
fn symm_sync(dir: &std::path::Path, n: u64, reps: usize) -> (Vec<f64>, Vec<f64>) {
    let sh = Shared::new(16 + 2 * reps);
    fork_ranks(2, |rank| {
        join(dir, "bench", rank, 2);
        let p = symm::alloc(DeviceType::Cpu, 0, 4096, Some("bench")).unwrap();
        let m = symm::rendezvous(p, None, TIMEOUT).unwrap();
        let peer = 1 - rank as i64;
        m.barrier(0, TIMEOUT, 0).unwrap();
        for rep in 0..reps {
            let t = Instant::now();
            for _ in 0..n {
                if rank == 0 {
                    m.put_signal(peer, 1, TIMEOUT, 0).unwrap();
                    m.wait_signal(peer, 1, TIMEOUT, 0).unwrap();
                } else {
                    m.wait_signal(peer, 1, TIMEOUT, 0).unwrap();
                    m.put_signal(peer, 1, TIMEOUT, 0).unwrap();
                }
            }
            let rt = t.elapsed().as_nanos() as f64 / n as f64;
            m.barrier(0, TIMEOUT, 0).unwrap();
            let t = Instant::now();
            for _ in 0..n {
                m.barrier(2, TIMEOUT, 0).unwrap();
            }
            let bar = t.elapsed().as_nanos() as f64 / n as f64;
            if rank == 0 {
                sh.set_f64(16 + rep, rt);
                sh.set_f64(16 + reps + rep, bar);
            }
        }
        symm::free(p).unwrap();
    });
    ((0..reps).map(|r| sh.f64_at(16 + r)).collect(), (0..reps).map(|r| sh.f64_at(16 + reps + r)).collect())
}

/// Where the ranks of the rendezvous benchmark meet.
#[derive(Clone, Copy)]
enum Medium<'a> {
    File(&'a std::path::Path),
    /// Rank 0 serves a TCPStore on a free port and publishes it.
    Tcp,
}

fn medium_store(medium: Medium, rank: usize, port_slot: &AtomicU64) -> StoreRef {
    match medium {
        Medium::File(dir) => Arc::new(FileStore::open(dir).unwrap()),
        Medium::Tcp if rank == 0 => {
            let s = TcpStore::open("127.0.0.1", 0, true, 0, TIMEOUT).unwrap();
            port_slot.store(u64::from(s.port()), Ordering::SeqCst);
            Arc::new(s)
        }
        Medium::Tcp => {
            while port_slot.load(Ordering::SeqCst) == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
            Arc::new(TcpStore::open("127.0.0.1", port_slot.load(Ordering::SeqCst) as u16, false, 0, TIMEOUT).unwrap())
        }
    }
}

/// Rendezvous of `rounds` fresh blocks among `ws` ranks: each rank's time
/// per rendezvous (after one warm-up), as microseconds; returns the slowest
/// rank's median and max.
fn rendezvous_times(medium: Medium, ws: usize, rounds: usize) -> (f64, f64) {
    let sh = Shared::new(ws * rounds + 1);
    fork_ranks(ws, |rank| {
        let store = medium_store(medium, rank, sh.at(ws * rounds));
        group::set_group_info("rdv", rank as i64, ws as i64, store).unwrap();
        let warm = symm::alloc(DeviceType::Cpu, 0, 1 << 20, Some("rdv")).unwrap();
        symm::rendezvous(warm, None, TIMEOUT).unwrap();
        for i in 0..rounds {
            let p = symm::alloc(DeviceType::Cpu, 0, 1 << 20, Some("rdv")).unwrap();
            let t = Instant::now();
            symm::rendezvous(p, None, TIMEOUT).unwrap();
            sh.set_f64(rank * rounds + i, t.elapsed().as_secs_f64() * 1e6);
            symm::free(p).unwrap();
        }
        // Rank 0 serves the TCPStore: it stays until everyone is done.
        symm::free(warm).unwrap();
        let done = symm::alloc(DeviceType::Cpu, 0, 64, Some("rdv")).unwrap();
        symm::rendezvous(done, None, TIMEOUT).unwrap().barrier(0, TIMEOUT, 0).unwrap();
        symm::free(done).unwrap();
    });
    let mut medians = Vec::new();
    let mut max: f64 = 0.0;
    for r in 0..ws {
        let mut v: Vec<f64> = (0..rounds).map(|i| sh.f64_at(r * rounds + i)).collect();
        max = max.max(v.iter().cloned().fold(0.0, f64::max));
        medians.push(median(&mut v));
    }
    (medians.into_iter().fold(0.0, f64::max), max)
}

fn main() {
    let quick = std::env::var_os("SS_BENCH_QUICK").is_some();
    let (n, reps, rounds) = if quick { (20_000, 3, 10) } else { (100_000, 5, 30) };
    let tmp = std::env::temp_dir().join(format!("ss-bench-symm-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    // SAFETY: sysconf reads a system value.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    println!("symmetric memory, CPU backend: 2 processes, {n} operations x {reps} runs ({cpus} CPUs online)");

    // Interleave the raw floor and ours so both see the same load.
    let mut raw = Vec::new();
    let mut rt = Vec::new();
    let mut bar = Vec::new();
    for round in 0..2 {
        raw.extend(raw_ping_pong(n, reps));
        let (a, b) = symm_sync(&tmp.join(format!("sync-{round}")), n, reps);
        rt.extend(a);
        bar.extend(b);
    }
    let (raw_best, raw_med) = (raw.iter().cloned().fold(f64::MAX, f64::min), median(&mut raw));
    println!();
    println!("{:<42} {:>8} {:>10} {:>12} {:>14}", "operation (2 ranks)", "best ns", "median ns", "best / floor", "median / floor");
    println!("{:<42} {:>8.0} {:>10.0} {:>12} {:>14}", "raw cache-line ping-pong (floor)", raw_best, raw_med, "1.00x", "1.00x");
    for (name, v) in [("put_signal + wait_signal round trip", &mut rt), ("barrier (put to peer, wait for peer)", &mut bar)] {
        let best = v.iter().cloned().fold(f64::MAX, f64::min);
        let med = median(v);
        println!("{name:<42} {best:>8.0} {med:>10.0} {:>11.2}x {:>13.2}x", best / raw_best, med / raw_med);
    }

    println!();
    println!("{:<42} {:>14} {:>14}", "rendezvous of a 1 MiB block", "median us", "max us");
    for ws in [2usize, 4] {
        let dir = tmp.join(format!("rdv-{ws}"));
        for (name, medium) in [("file store", Medium::File(&dir)), ("TCPStore (loopback)", Medium::Tcp)] {
            let (med, max) = rendezvous_times(medium, ws, rounds);
            println!("{:<42} {med:>14.0} {max:>14.0}", format!("{name}, {ws} ranks (slowest rank)"));
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
