//! The GPU weights pool across real processes on the host backend: two and
//! four consumers of one pool, readers in many processes and threads while
//! the producer updates (never a torn version), kill -9 of a consumer
//! holding a version and of the producer (idle and mid-update), a consumer
//! dying mid-import, a consumer out of descriptors, parties that forked
//! a child (the child neither hides their death nor disturbs them), and
//! nothing left in /dev/shm, even by a producer killed before any consumer
//! came.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, wait_until, Parent, Peer};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::cuda::pool::{Pool, PoolDevice, PoolHandle, PoolKind, PoolOptions, TensorSpec, Weights};
use storage_sharing::ErrorKind;

const ENTRY: &str = "child_entry";
const T: Option<Duration> = Some(Duration::from_secs(30));
/// Words of the test tensor (256 KiB).
const WORDS: usize = 32 << 10;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn kind_of(s: &str) -> PoolKind {
    if s == "legacy" {
        PoolKind::Legacy
    } else {
        PoolKind::Vmm
    }
}

/// A host pool holding tensor "x" (WORDS u64, all 1) and a view of it,
/// exported; returns the pool, the words' address and the handle.
fn producer_pool(kind: PoolKind, segments: usize) -> (Pool, u64, PoolHandle) {
    let bytes = WORDS * 8;
    let pool = Pool::new(PoolOptions { device: PoolDevice::Host, kind, segment_size: bytes, max_consumers: 8 }).unwrap();
    let p = pool.alloc(bytes).unwrap();
    for _ in 1..segments {
        pool.alloc(bytes).unwrap();
    }
    let spec = TensorSpec {
        storage_ptr: p,
        storage_nbytes: bytes,
        dtype: Dtype::UInt64,
        sizes: vec![WORDS as i64],
        strides: vec![1],
        storage_offset: 0,
    };
    pool.add_tensor("x", &spec).unwrap();
    pool.add_tensor("x.head", &TensorSpec { sizes: vec![16], ..spec.clone() }).unwrap();
    fill(p, 1);
    let h = pool.export().unwrap();
    (pool, p, h)
}

fn fill(p: u64, v: u64) {
    // SAFETY: WORDS words of pool memory, written only under an open update.
    let words = unsafe { std::slice::from_raw_parts_mut(p as *mut u64, WORDS) };
    for w in words {
        // Word by word, volatile: a reader that overlapped would see a mix.
        unsafe { std::ptr::write_volatile(w, v) };
    }
}

/// Whether every word at `p` is `v`.
fn all_are(p: u64, v: u64) -> bool {
    // SAFETY: WORDS words mapped from the producer.
    (0..WORDS).all(|i| unsafe { std::ptr::read_volatile((p as *const u64).add(i)) } == v)
}

/// Lines in /proc/self/maps of pool memfds.
fn pool_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("ss-pool")).count()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Legacy segment names of producer `pid` still in /dev/shm.
fn names_of(pid: u32) -> Vec<String> {
    let prefix = format!("ss_pool_{pid}_");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn child_entry() {
    child_main(|role, mut parent| match role {
        "consumer" => consumer(&mut parent),
        "producer" => producer(&mut parent),
        "fd_starved" => fd_starved(&mut parent),
        "forking_producer" => {
            // Forks a child that outlives it (a DataLoader worker, say).
            let (_pool, _p, h) = producer_pool(PoolKind::Vmm, 1);
            parent.send(&format!("handle {}", hex(&h.to_bytes())));
            assert_eq!(parent.recv(), "fork");
            parent.send(&format!("forked {}", sleeping_child()));
            parent.wait_for_close();
        }
        "half_import" => {
            // Connects and stops before reading the pool: killed there.
            let h = PoolHandle::from_bytes(&unhex(&parent.arg)).unwrap();
            let _conn = storage_sharing::fdpass::abstract_socket::connect(&h.socket_name).unwrap();
            parent.send("connected");
            parent.wait_for_close();
        }
        other => panic!("unknown role {other}"),
    });
}

/// Opens the pool of the handle in its argument and obeys the parent.
fn consumer(parent: &mut Parent) {
    let h = PoolHandle::from_bytes(&unhex(&parent.arg)).unwrap();
    let w = Arc::new(Weights::open(&h, T).unwrap());
    let x = w.tensors()[0].storage_ptr;
    parent.send(&format!("open {}", w.tensors().len()));
    loop {
        match parent.recv().as_str() {
            "hold" => {
                let v = w.acquire(0, T).unwrap();
                let ok = all_are(x, v);
                parent.send(&format!("v {v} {}", if ok { "whole" } else { "torn" }));
            }
            "release" => {
                w.release(0).unwrap();
                parent.send("ok");
            }
            "readloop" => {
                let (stop, reads, torn) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
                // "reading" goes once every thread is in its loop: on a loaded
                // machine a thread could otherwise start after the updates.
                let started = Arc::new(std::sync::Barrier::new(5));
                let threads: Vec<_> = (0..4)
                    .map(|_| {
                        let (w, stop, reads, torn, started) = (w.clone(), stop.clone(), reads.clone(), torn.clone(), started.clone());
                        std::thread::spawn(move || {
                            started.wait();
                            while !stop.load(Ordering::Relaxed) {
                                let v = w.acquire(0, T).unwrap();
                                if !all_are(x, v) {
                                    torn.fetch_add(1, Ordering::SeqCst);
                                }
                                reads.fetch_add(1, Ordering::Relaxed);
                                w.release(0).unwrap();
                            }
                        })
                    })
                    .collect();
                started.wait();
                parent.send("reading");
                assert_eq!(parent.recv(), "stop");
                stop.store(true, Ordering::Relaxed);
                for t in threads {
                    t.join().unwrap();
                }
                parent.send(&format!("reads {} torn {}", reads.load(Ordering::SeqCst), torn.load(Ordering::SeqCst)));
            }
            "fork" => parent.send(&format!("forked {}", sleeping_child())),
            "gone?" => {
                let r = w.acquire(0, T);
                let kind = r.as_ref().err().map(|e| e.kind());
                let words = if all_are(x, 1) { "v1" } else { "written" };
                parent.send(&format!("{} {words}", if kind == Some(ErrorKind::PeerGone) { "gone" } else { "not-gone" }));
            }
            _ => return,
        }
    }
}

/// A producer in a child (so the parent can kill it): exports, then obeys.
fn producer(parent: &mut Parent) {
    let (pool, p, h) = producer_pool(kind_of(&parent.arg), 1);
    parent.send(&format!("handle {}", hex(&h.to_bytes())));
    if parent.recv() == "begin" {
        let guard = pool.begin_update(T).unwrap();
        fill(p, 99);
        parent.send("writing");
        parent.wait_for_close();
        drop(guard);
    }
}

/// Opens a pool of several segments with only two descriptors to spare:
/// TooManyFiles, nothing mapped, nothing leaked; then opens it for real.
fn fd_starved(parent: &mut Parent) {
    let h = PoolHandle::from_bytes(&unhex(&parent.arg)).unwrap();
    let (fds, maps) = (open_fds(), pool_mappings());
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain getrlimit/setrlimit on our own process.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) };
    let low = libc::rlimit { rlim_cur: fds as u64 + 2, rlim_max: old.rlim_max };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let e = Weights::open(&h, T).err().expect("open must fail with two descriptors to spare");
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
    let clean = open_fds() == fds && pool_mappings() == maps;
    parent.send(&format!("{:?} clean={clean} {}", e.kind(), e.message().replace('\n', " ")));
    let w = Weights::open(&h, T).unwrap();
    parent.send(&format!("opened {}", w.tensors().len()));
    parent.wait_for_close();
}

/// Forks a child that sleeps until killed; returns its pid.
fn sleeping_child() -> i32 {
    // SAFETY: the child only makes async-signal-safe calls, then _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            libc::sleep(120);
            libc::_exit(0)
        };
    }
    pid
}

fn kill_pid(line: &str) {
    let pid: i32 = line.strip_prefix("forked ").unwrap().parse().unwrap();
    // SAFETY: a process the test made (a grandchild): killing it is the point.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// A consumer process killed with -9 after connecting and before reading
/// its hello: its slot comes back, an update goes through, and a new
/// consumer opens version `want`.
fn half_import_killed(pool: &Pool, h: &PoolHandle, want: u64) {
    let mut c = Peer::spawn(ENTRY, "half_import", &hex(&h.to_bytes()));
    assert_eq!(c.recv(), "connected");
    assert!(wait_until(Duration::from_secs(30), || pool.consumers() == 1));
    c.kill9();
    assert!(wait_until(Duration::from_secs(30), || pool.consumers() == 0));
    pool.begin_update(T).unwrap().publish(0).unwrap();
    let w = Weights::open(h, T).unwrap();
    assert_eq!(w.acquire(0, T).unwrap(), want);
    w.release(0).unwrap();
}

fn spawn_consumers(h: &PoolHandle, n: usize) -> Vec<Peer> {
    (0..n)
        .map(|_| {
            let mut c = Peer::spawn(ENTRY, "consumer", &hex(&h.to_bytes()));
            assert_eq!(c.recv(), "open 2");
            c
        })
        .collect()
}

/// The two kinds' tests look at this process's names in /dev/shm: one at a time.
static SHM_NAMES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn two_and_four(kind: PoolKind) {
    let _g = SHM_NAMES.lock().unwrap_or_else(|p| p.into_inner());
    for n in [2, 4] {
        let (pool, p, h) = producer_pool(kind, 1);
        let mut consumers = spawn_consumers(&h, n);
        assert_eq!(pool.consumers(), n);
        for c in &mut consumers {
            c.send("hold");
            assert_eq!(c.recv(), "v 1 whole");
        }
        let e = pool.begin_update(Some(Duration::from_millis(100))).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        for c in &mut consumers {
            c.send("release");
            assert_eq!(c.recv(), "ok");
        }
        let u = pool.begin_update(T).unwrap();
        fill(p, 2);
        assert_eq!(u.publish(0).unwrap(), 2);
        for c in &mut consumers {
            c.send("hold");
            assert_eq!(c.recv(), "v 2 whole");
        }
        for c in consumers {
            c.kill9();
        }
        assert!(wait_until(Duration::from_secs(30), || pool.consumers() == 0), "the server saw every consumer go");
        pool.begin_update(T).unwrap().publish(0).unwrap();
        drop(pool);
        assert!(names_of(std::process::id()).is_empty(), "{:?} left in /dev/shm", names_of(std::process::id()));
    }
}

#[test]
fn two_and_four_consumers_open_one_vmm_pool() {
    two_and_four(PoolKind::Vmm);
}

#[test]
fn two_and_four_consumers_open_one_legacy_pool() {
    two_and_four(PoolKind::Legacy);
}

#[test]
fn readers_in_many_processes_and_threads_never_see_a_torn_version() {
    let (pool, p, h) = producer_pool(PoolKind::Vmm, 1);
    let mut consumers = spawn_consumers(&h, 3);
    for c in &mut consumers {
        c.send("readloop");
        assert_eq!(c.recv(), "reading");
    }
    for v in 2..=40u64 {
        let u = pool.begin_update(T).unwrap();
        fill(p, v);
        assert_eq!(u.publish(0).unwrap(), v);
    }
    for c in &mut consumers {
        c.send("stop");
        let line = c.recv();
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((parts[0], parts[2], parts[3]), ("reads", "torn", "0"), "{line}");
        assert!(parts[1].parse::<usize>().unwrap() > 0, "{line}");
    }
    for mut c in consumers {
        c.send("exit");
        c.finish();
    }
}

#[test]
fn a_consumer_killed_holding_a_version_gives_up_its_hold() {
    let (pool, _p, h) = producer_pool(PoolKind::Vmm, 1);
    let mut consumers = spawn_consumers(&h, 1);
    let mut c = consumers.pop().unwrap();
    c.send("hold");
    assert_eq!(c.recv(), "v 1 whole");
    assert_eq!(pool.begin_update(Some(Duration::from_millis(100))).err().unwrap().kind(), ErrorKind::Timeout);
    c.kill9();
    // The server sees the hang-up and clears the slot: the update goes on.
    pool.begin_update(T).unwrap().publish(0).unwrap();
    assert!(wait_until(Duration::from_secs(30), || pool.consumers() == 0));
}

#[test]
fn a_consumer_gone_mid_import_frees_its_slot() {
    let (pool, _p, h) = producer_pool(PoolKind::Vmm, 2);
    // Connects, never reads the hello and its descriptors, and goes (as a
    // consumer killed during its import would).
    let raw = storage_sharing::fdpass::abstract_socket::connect(&h.socket_name).unwrap();
    assert!(wait_until(Duration::from_secs(30), || pool.consumers() == 1));
    drop(raw);
    assert!(wait_until(Duration::from_secs(30), || pool.consumers() == 0));
    pool.begin_update(T).unwrap().publish(0).unwrap();
    // The same with a real process killed with -9 before it read its hello.
    half_import_killed(&pool, &h, 3);
}

fn producer_killed(kind: &str, mid_update: bool) {
    let mut producer = Peer::spawn(ENTRY, "producer", kind);
    let line = producer.recv();
    let h = PoolHandle::from_bytes(&unhex(line.strip_prefix("handle ").unwrap())).unwrap();
    let producer_pid = producer.pid() as u32;
    let mut consumers = spawn_consumers(&h, 2);
    if mid_update {
        producer.send("begin");
        assert_eq!(producer.recv(), "writing");
    } else {
        consumers[0].send("hold");
        assert_eq!(consumers[0].recv(), "v 1 whole");
        consumers[0].send("release");
        assert_eq!(consumers[0].recv(), "ok");
    }
    producer.kill9();
    for c in &mut consumers {
        c.send("gone?");
        // Typed, and the mapping still readable: version 1, or (killed
        // mid-update) what the producer had written by then.
        let want = if mid_update { "gone written" } else { "gone v1" };
        assert_eq!(c.recv(), want);
    }
    // In-process too: a typed error, never a hang or garbage.
    let e = Weights::open(&h, T).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    for mut c in consumers {
        c.send("exit");
        c.finish();
    }
    assert!(names_of(producer_pid).is_empty(), "{:?} left in /dev/shm", names_of(producer_pid));
}

#[test]
fn a_producer_killed_is_peer_gone_for_its_consumers() {
    producer_killed("vmm", false);
    producer_killed("legacy", false);
}

#[test]
fn a_legacy_producer_killed_before_any_consumer_leaves_no_name() {
    let mut producer = Peer::spawn(ENTRY, "producer", "legacy");
    assert!(producer.recv().starts_with("handle "));
    let pid = producer.pid() as u32;
    assert_eq!(names_of(pid).len(), 1, "the pool's one segment is named");
    producer.kill9();
    // No consumer will see it gone: the manager unlinks the name once the
    // producer's connection drops and nobody maps it.
    let gone = wait_until(Duration::from_secs(10), || names_of(pid).is_empty());
    assert!(gone, "{:?} left in /dev/shm", names_of(pid));
}

#[test]
fn a_producer_killed_mid_update_is_peer_gone_not_a_hang() {
    producer_killed("vmm", true);
    producer_killed("legacy", true);
}

#[test]
fn a_consumer_out_of_descriptors_gets_too_many_files_and_maps_nothing() {
    let (pool, _p, h) = producer_pool(PoolKind::Vmm, 5);
    assert_eq!(pool.segments().len(), 5);
    let mut c = Peer::spawn(ENTRY, "fd_starved", &hex(&h.to_bytes()));
    let line = c.recv();
    assert!(line.starts_with("TooManyFiles clean=true"), "{line}");
    assert_eq!(c.recv(), "opened 2");
    drop(c);
    // The producer is unaffected: it still serves and updates.
    pool.begin_update(T).unwrap().publish(0).unwrap();
    // The same with a real process killed with -9 before it read its hello.
    half_import_killed(&pool, &h, 3);
}

#[test]
fn a_producer_that_forked_a_child_is_peer_gone_when_killed() {
    let mut producer = Peer::spawn(ENTRY, "forking_producer", "");
    let line = producer.recv();
    let h = PoolHandle::from_bytes(&unhex(line.strip_prefix("handle ").unwrap())).unwrap();
    let mut consumers = spawn_consumers(&h, 1);
    producer.send("fork");
    let forked = producer.recv();
    producer.kill9();
    // The child still lives, with copies of every descriptor its parent
    // had, yet the consumer sees the producer gone: once the child has run
    // its fork handler, which it does when first scheduled (on a loaded
    // machine, after the kill, so the first answers may still say
    // not-gone).
    let mut answer = String::new();
    wait_until(Duration::from_secs(10), || {
        consumers[0].send("gone?");
        answer = consumers[0].recv();
        answer != "not-gone v1"
    });
    kill_pid(&forked);
    assert_eq!(answer, "gone v1", "a forked child hid the producer's death");
    for mut c in consumers {
        c.send("exit");
        c.finish();
    }
}

#[test]
fn a_consumer_that_forked_a_child_gives_up_its_hold_when_killed() {
    let (pool, _p, h) = producer_pool(PoolKind::Vmm, 1);
    let mut c = spawn_consumers(&h, 1).pop().unwrap();
    c.send("fork");
    let forked = c.recv();
    c.send("hold");
    assert_eq!(c.recv(), "v 1 whole");
    c.kill9();
    let update = pool.begin_update(T);
    kill_pid(&forked);
    update.expect("the dead consumer's hold was kept by its forked child").publish(0).unwrap();
}

/// The forked child's copies are inert: a weights object refuses calls and
/// keeps the parent's hold; a pool dropped there leaves the parent serving.
#[test]
fn copies_in_a_forked_child_leave_the_parent_alone() {
    let (pool, _p, h) = producer_pool(PoolKind::Vmm, 1);
    let w = Weights::open(&h, T).unwrap();
    assert_eq!(w.acquire(0, T).unwrap(), 1);
    // SAFETY: the child makes no allocation-free promise here, but the
    // test process's other threads hold no lock these calls take (the
    // library's locks are fork-safe and the pool's server thread takes
    // none of what the child's calls use); it ends with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        let refused = w.acquire(0, T).err().map(|e| e.kind()) == Some(ErrorKind::InvalidArgument)
            && w.release(0).err().map(|e| e.kind()) == Some(ErrorKind::InvalidArgument)
            && pool.begin_update(T).err().map(|e| e.kind()) == Some(ErrorKind::InvalidArgument);
        drop(w);
        drop(pool);
        // SAFETY: ends the child without running the parent's exit hooks.
        unsafe { libc::_exit(if refused { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's copies did not refuse (status {status})");
    let e = pool.begin_update(Some(Duration::from_millis(100))).err().expect("the child's drop released the parent's hold");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    w.release(0).unwrap();
    // The server still answers: a new consumer opens, an update goes through.
    let again = Weights::open(&h, T).unwrap();
    assert_eq!(pool.begin_update(T).unwrap().publish(0).unwrap(), 2);
    assert_eq!(again.acquire(0, T).unwrap(), 2);
    again.release(0).unwrap();
}
