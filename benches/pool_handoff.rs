//! GPU weights pool on the host backend: how long a waiter takes to notice
//! the other side, measured from the moment the other side acts.
//!  - publish -> acquire: a consumer blocked in `acquire` while an update
//!    is open, until it holds the new version;
//!  - release -> begin_update: a producer blocked in `begin_update` while a
//!    consumer holds the version, until the update is open;
//!  - beside them, in the same run, a bare futex wake between two threads
//!    (one shared word, the waiter asleep): the floor for waking a sleeper.
//!
//! The producer and the consumer are two threads of this process, each
//! with its own mapping of the control block, as two processes would be.
//! Run: `cargo bench --bench pool_handoff` (SS_BENCH_QUICK=1 for fewer rounds).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::cuda::pool::{Pool, PoolDevice, PoolKind, PoolOptions, TensorSpec, Weights};
use storage_sharing::syscalls::{futex_wait, futex_wake};

const T: Option<Duration> = Some(Duration::from_secs(30));
/// How long the acting side waits before it acts, so the waiter is asleep:
/// a different time each round, between 100 µs and 4 ms, so that the act
/// falls anywhere in a polling waiter's sleep (a fixed time can line up
/// with a backoff schedule and flatter it).
struct Settle(u64);

impl Settle {
    fn new() -> Settle {
        Settle(0x9e37_79b9_7f4a_7c15)
    }
    fn sleep(&mut self) {
        // xorshift64: the same sequence on every run.
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        std::thread::sleep(Duration::from_micros(100 + self.0 % 3900));
    }
}

fn rounds() -> usize {
    if std::env::var_os("SS_BENCH_QUICK").is_some() {
        100
    } else {
        500
    }
}

/// What the two sides of one measurement share: a barrier to meet at, and
/// the moment the acting side acted.
#[derive(Clone)]
struct Meeting {
    epoch: Instant,
    acted_ns: Arc<AtomicU64>,
    barrier: Arc<Barrier>,
}

impl Meeting {
    fn new() -> Meeting {
        Meeting { epoch: Instant::now(), acted_ns: Arc::new(AtomicU64::new(0)), barrier: Arc::new(Barrier::new(2)) }
    }
    fn meet(&self) {
        self.barrier.wait();
    }
    /// Called right before acting.
    fn act(&self) {
        self.acted_ns.store(self.epoch.elapsed().as_nanos() as u64, SeqCst);
    }
    /// Called by the waiter as soon as it returns.
    fn micros_since_act(&self) -> f64 {
        (self.epoch.elapsed().as_nanos() as u64 - self.acted_ns.load(SeqCst)) as f64 / 1e3
    }
}

fn pool_with_one_tensor() -> (Arc<Pool>, Weights) {
    let opts = PoolOptions { device: PoolDevice::Host, kind: PoolKind::Vmm, segment_size: 64 << 10, max_consumers: 4 };
    let pool = Pool::new(opts).expect("a host pool");
    let p = pool.alloc(4096).expect("a block");
    let spec =
        TensorSpec { storage_ptr: p, storage_nbytes: 4096, dtype: Dtype::UInt8, sizes: vec![4096], strides: vec![1], storage_offset: 0 };
    pool.add_tensor("w", &spec).expect("add_tensor");
    let handle = pool.export().expect("export");
    let weights = Weights::open(&handle, T).expect("open");
    (Arc::new(pool), weights)
}

/// A consumer blocked in acquire, the producer publishing.
fn publish_to_acquire(n: usize) -> Vec<f64> {
    let (pool, weights) = pool_with_one_tensor();
    let m = Meeting::new();
    let consumer = {
        let m = m.clone();
        std::thread::spawn(move || {
            let mut lat = Vec::with_capacity(n);
            for _ in 0..n {
                m.meet(); // the update is open
                weights.acquire(0, T).expect("acquire");
                lat.push(m.micros_since_act());
                weights.release(0).expect("release");
                m.meet(); // released: the next update may open
            }
            lat
        })
    };
    let mut settle = Settle::new();
    for _ in 0..n {
        pool.start_update(T).expect("begin_update");
        m.meet();
        settle.sleep();
        m.act();
        pool.publish_update(0).expect("publish");
        m.meet();
    }
    consumer.join().expect("consumer thread")
}

/// A producer blocked in begin_update, the consumer releasing.
fn release_to_begin_update(n: usize) -> Vec<f64> {
    let (pool, weights) = pool_with_one_tensor();
    let m = Meeting::new();
    let consumer = {
        let m = m.clone();
        std::thread::spawn(move || {
            let mut settle = Settle::new();
            for _ in 0..n {
                weights.acquire(0, T).expect("acquire");
                m.meet(); // held: the producer goes into begin_update
                settle.sleep();
                m.act();
                weights.release(0).expect("release");
                m.meet(); // published: acquire again
            }
        })
    };
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        m.meet();
        pool.start_update(T).expect("begin_update");
        lat.push(m.micros_since_act());
        pool.publish_update(0).expect("publish");
        m.meet();
    }
    consumer.join().expect("consumer thread");
    lat
}

/// The floor: one thread asleep on a futex word, the other changing it and
/// waking it.
fn bare_futex_wake(n: usize) -> Vec<f64> {
    let word = Arc::new(AtomicU32::new(0));
    let m = Meeting::new();
    let sleeper = {
        let (word, m) = (word.clone(), m.clone());
        std::thread::spawn(move || {
            let mut lat = Vec::with_capacity(n);
            for i in 0..n as u32 {
                m.meet();
                while word.load(SeqCst) == i {
                    futex_wait(&word, i, None);
                }
                lat.push(m.micros_since_act());
            }
            lat
        })
    };
    let mut settle = Settle::new();
    for _ in 0..n {
        m.meet();
        settle.sleep();
        m.act();
        word.fetch_add(1, SeqCst);
        futex_wake(&word);
    }
    sleeper.join().expect("sleeper thread")
}

fn row(what: &str, mut lat: Vec<f64>) {
    lat.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    println!("| {what} | {} | {:.1} | {:.1} | {:.1} | {:.1} |", lat.len(), at(0.5), at(0.9), at(0.99), lat[lat.len() - 1]);
}

fn main() {
    let n = rounds();
    println!("Waiter wake-up after the other side acts, microseconds ({n} rounds, the actor waits 0.1 to 4 ms first)\n");
    println!("| handoff | rounds | median | p90 | p99 | max |");
    println!("|---|---|---|---|---|---|");
    row("publish -> acquire returns", publish_to_acquire(n));
    row("release -> begin_update returns", release_to_begin_update(n));
    row("floor: bare futex wake, two threads", bare_futex_wake(n));
}
