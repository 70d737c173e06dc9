//! The GPU weights pool (host backend) under the uses that hung or tore it:
//! a read nested in a read of the same process while an update waits, a
//! burst of 200 opens, silent connections next to real consumers (and a
//! holder killed with -9 among them), a consumer that writes the shared
//! words it was given and goes, another user flooding the socket, and a
//! producer out of descriptors with consumers knocking.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, wait_until, Parent, Peer};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::cuda::pool::wire::{Hello, HELLO_BYTES};
use storage_sharing::cuda::pool::{Pool, PoolDevice, PoolHandle, PoolKind, PoolOptions, TensorSpec, Weights};
use storage_sharing::fdpass::{abstract_socket, recv_fds};
use storage_sharing::ErrorKind;

const ENTRY: &str = "child_entry";
const T: Option<Duration> = Some(Duration::from_secs(30));

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// An exported host pool of `tensors` u64 tensors of 16 words each, all in
/// one storage, with long names (so the manifest outgrows a socket buffer
/// when there are many).
fn pool_of(tensors: usize, max_consumers: usize) -> (Pool, PoolHandle) {
    let bytes = tensors * 16 * 8;
    let pool = Pool::new(PoolOptions { device: PoolDevice::Host, kind: PoolKind::Vmm, segment_size: bytes, max_consumers }).unwrap();
    let p = pool.alloc(bytes).unwrap();
    for i in 0..tensors {
        let spec = TensorSpec {
            storage_ptr: p,
            storage_nbytes: bytes,
            dtype: Dtype::UInt64,
            sizes: vec![16],
            strides: vec![1],
            storage_offset: (i * 16) as i64,
        };
        pool.add_tensor(&format!("model.layers.{i}.self_attn.q_proj.weight.with_a_long_name_{i:08}"), &spec).unwrap();
    }
    let h = pool.export().unwrap();
    (pool, h)
}

#[test]
fn child_entry() {
    child_main(|role, mut parent| match role {
        "holder" => {
            let h = PoolHandle::from_bytes(&unhex(&parent.arg)).unwrap();
            let w = Weights::open(&h, T).unwrap();
            let v = w.acquire(0, T).unwrap();
            parent.send(&format!("holding {v}"));
            parent.wait_for_close();
        }
        "starved_producer" => starved_producer(&mut parent),
        other => panic!("unknown role {other}"),
    });
}

#[test]
fn a_read_nested_in_a_read_of_this_process_enters_at_once_while_an_update_waits() {
    let (pool, h) = pool_of(4, 4);
    let pool = Arc::new(pool);
    let w = Arc::new(Weights::open(&h, T).unwrap());
    assert_eq!(w.acquire(0, T).unwrap(), 1);
    let producer = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let guard = pool.begin_update(T).unwrap();
            guard.publish(0).unwrap()
        })
    };
    assert!(wait_until(Duration::from_secs(10), || w.update_pending()), "the producer never began its update");
    // The same thread, nested: it must not queue behind the producer, who
    // waits for the outer hold.
    let nested = w.acquire(0, Some(Duration::from_secs(5)));
    assert_eq!(nested.as_ref().ok(), Some(&1), "nested acquire: {nested:?}");
    // Other threads of the process while the main thread holds (workers
    // that a reader started): they join the hold too.
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let w = w.clone();
            std::thread::spawn(move || {
                let v = w.acquire(0, Some(Duration::from_secs(5)));
                if v.is_ok() {
                    w.release(0).unwrap();
                }
                v.map_err(|e| e.to_string())
            })
        })
        .collect();
    for t in workers {
        assert_eq!(t.join().unwrap(), Ok(1), "a worker thread of a holding process");
    }
    assert!(!producer.is_finished(), "the producer wrote while this process held a version");
    w.release(0).unwrap();
    w.release(0).unwrap();
    assert_eq!(producer.join().unwrap(), 2);
    assert_eq!(w.acquire(0, T).unwrap(), 2);
    w.release(0).unwrap();
}

#[test]
fn a_burst_of_two_hundred_opens_all_succeed() {
    let (_pool, h) = pool_of(64, 256);
    let start = Arc::new(Barrier::new(200));
    let began = Instant::now();
    let opens: Vec<_> = (0..200)
        .map(|_| {
            let (h, start) = (h.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                Weights::open(&h, T).map(|w| w.tensors().len()).map_err(|e| e.to_string())
            })
        })
        .collect();
    let failed: Vec<String> = opens.into_iter().filter_map(|t| t.join().unwrap().err()).collect();
    eprintln!("200 opens at once: {} failed, all done in {:?}", failed.len(), began.elapsed());
    assert!(failed.is_empty(), "{} of 200 opens failed, first: {:?}", failed.len(), failed.first());
}

/// A connection that takes its hello and then reads nothing more.
fn silent_connection(h: &PoolHandle) -> OwnedFd {
    abstract_socket::connect(&h.socket_name).unwrap()
}

#[test]
fn silent_connections_stall_no_open_no_update_and_no_drop() {
    // 20,000 tensors: a manifest of about 2 MB, more than a socket takes
    // unread, so a serial server would block on each silent connection.
    let (pool, h) = pool_of(20_000, 16);
    let silent: Vec<OwnedFd> = (0..6).map(|_| silent_connection(&h)).collect();
    assert!(wait_until(Duration::from_secs(10), || pool.consumers() == 6), "the server took {} of 6", pool.consumers());
    let w = Weights::open(&h, Some(Duration::from_secs(15))).expect("a real consumer behind six silent ones");
    assert_eq!(w.tensors().len(), 20_000);
    // A holder killed with -9: its hold goes with it at once, whatever
    // the silent connections do.
    let mut holder = Peer::spawn(ENTRY, "holder", &hex(&h.to_bytes()));
    assert_eq!(holder.recv(), "holding 1");
    let e = pool.begin_update(Some(Duration::from_millis(200))).err().expect("the holder holds");
    assert!(e.message().contains(&format!("pid {}", holder.pid())), "names the holder: {e}");
    let killed = Instant::now();
    holder.kill9();
    let guard = pool.begin_update(Some(Duration::from_secs(5))).expect("the killed holder's hold went with it");
    eprintln!("an update waited {:?} for a holder killed with -9, next to 6 silent connections", killed.elapsed());
    assert_eq!(guard.publish(0).unwrap(), 2);
    // Each silent connection has a budget to take the pool; then its slot
    // is free again.
    assert!(
        wait_until(Duration::from_secs(20), || pool.consumers() == 1),
        "silent connections kept their slots: {} consumers",
        pool.consumers()
    );
    // Dropping the pool waits on none of them (two new silent ones here).
    let more: Vec<OwnedFd> = (0..2).map(|_| silent_connection(&h)).collect();
    assert!(wait_until(Duration::from_secs(10), || pool.consumers() == 3));
    let (done, dropped) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        drop(pool);
        let _ = done.send(());
    });
    assert!(dropped.recv_timeout(Duration::from_secs(5)).is_ok(), "dropping the pool waited on silent connections");
    eprintln!("pool dropped in {:?} with 2 silent connections", started.elapsed());
    drop((silent, more, w));
}

#[test]
fn what_a_consumer_writes_in_its_shared_words_ends_when_it_goes() {
    let (pool, h) = pool_of(4, 4);
    // A consumer that speaks the protocol itself and misbehaves.
    let conn = abstract_socket::connect(&h.socket_name).unwrap();
    let mut p = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 10_000) }, 1);
    let mut buf = [0u8; HELLO_BYTES + 64];
    let (n, fds) = recv_fds(conn.as_raw_fd(), &mut buf, 8).unwrap();
    let hello = Hello::decode(&buf[..n]).unwrap();
    assert_eq!(fds.len(), 3, "control block, hold page, one segment");
    let page = 4096;
    // It cannot write the control block: not mapped writable, not by write(2).
    // SAFETY: asking for a writable mapping that must be refused.
    let rw = unsafe { libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fds[0].as_raw_fd(), 0) };
    assert_eq!(rw, libc::MAP_FAILED, "a consumer mapped the control block writable");
    let zeros = [0u8; 16];
    // SAFETY: pwrite from a valid buffer.
    assert_eq!(unsafe { libc::pwrite(fds[0].as_raw_fd(), zeros.as_ptr().cast(), 16, 0) }, -1, "write(2) reached the control block");
    // It can write its own hold page: a hold it never releases.
    // SAFETY: a mapping of the page it was given.
    let hold =
        unsafe { libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fds[1].as_raw_fd(), 0) };
    assert_ne!(hold, libc::MAP_FAILED);
    // SAFETY: the first word of that page.
    unsafe { std::ptr::write_volatile(hold as *mut u64, 1) };
    let e = pool.begin_update(Some(Duration::from_millis(200))).err().expect("a hold delays the update while its consumer lives");
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.message().contains(&format!("pid {}", std::process::id())), "names the holder, not '?': {e}");
    // A well-behaved consumer meanwhile reads as usual.
    let w = Weights::open(&h, T).unwrap();
    assert_eq!(w.acquire(0, T).unwrap(), 1);
    w.release(0).unwrap();
    // It goes, leaving its hold written: nothing of it stays.
    drop(conn);
    drop(fds);
    let guard = pool.begin_update(Some(Duration::from_secs(10))).expect("a gone consumer's hold still counted");
    assert_eq!(guard.publish(0).unwrap(), 2);
    assert_eq!(w.acquire(0, T).unwrap(), 2, "consumers go on");
    w.release(0).unwrap();
    // A new consumer opens as usual (the block it maps is intact).
    assert!(Weights::open(&h, T).is_ok());
    // SAFETY: unmapping the page mapped above.
    unsafe { libc::munmap(hold, page) };
    assert!(hello.slot < 4);
}

#[test]
fn another_users_flood_of_connections_costs_this_users_opens_nothing() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: playing uid 65534 needs root (CI runs as root)");
        return;
    }
    let (pool, h) = pool_of(16, 128);
    // The stranger: a forked child that becomes uid 65534 and connects
    // and hangs up as fast as it can until killed. It makes only raw
    // system calls (the parent has threads).
    let (addr, len) = abstract_socket::address(&h.socket_name).unwrap();
    // SAFETY: the child makes only async-signal-safe calls, then _exit.
    let flooder = unsafe { libc::fork() };
    assert!(flooder >= 0);
    if flooder == 0 {
        // SAFETY: as above.
        unsafe {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(3);
            }
            loop {
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK, 0);
                libc::connect(s, (&addr as *const libc::sockaddr_un).cast(), len);
                libc::close(s);
            }
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let (mut failed, mut first, mut opened, mut took) = (0, None, Vec::new(), Vec::new());
    for _ in 0..100 {
        let began = Instant::now();
        let open = Weights::open(&h, T);
        took.push(began.elapsed());
        match open {
            Ok(w) => opened.push(w),
            Err(e) => {
                failed += 1;
                first.get_or_insert(e.to_string());
            }
        }
    }
    // SAFETY: killing and reaping our own child.
    unsafe {
        libc::kill(flooder, libc::SIGKILL);
        libc::waitpid(flooder, std::ptr::null_mut(), 0);
    }
    took.sort();
    eprintln!("100 opens under uid 65534's flood: {failed} failed, median {:?}, max {:?}", took[50], took[99]);
    assert_eq!(failed, 0, "opens failed under another user's flood; first: {first:?}");
    drop((opened, pool));
}

/// A producer whose process has no descriptor to spare while consumers
/// knock: the server must neither spin nor log each failed accept.
fn starved_producer(parent: &mut Parent) {
    let lines = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = lines.clone();
    storage_sharing::log::set_sink(Some(Arc::new(move |_, text: &str| {
        if text.contains("pool server:") {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    })));
    let (pool, h) = pool_of(4, 64);
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain getrlimit/setrlimit on our own process.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) };
    let low = libc::rlimit { rlim_cur: fds as u64 + 8, rlim_max: old.rlim_max };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    // No descriptor to spare: every free number under the limit is taken.
    let mut fillers = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        fillers.push(f);
    }
    parent.send(&format!("handle {}", hex(&h.to_bytes())));
    assert_eq!(parent.recv(), "knocked");
    let cpu_before = cpu_ms();
    std::thread::sleep(Duration::from_secs(1));
    let cpu = cpu_ms() - cpu_before;
    let logged = lines.load(std::sync::atomic::Ordering::SeqCst);
    drop(fillers);
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
    // With descriptors again, the waiting consumers get in.
    let admitted = wait_until(Duration::from_secs(10), || pool.consumers() >= 20);
    parent.send(&format!("logged {logged} cpu_ms {cpu} admitted {admitted}"));
    parent.wait_for_close();
}

/// CPU time this process used, in milliseconds.
fn cpu_ms() -> u64 {
    // SAFETY: rusage is plain data; all-zero is valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let ms = |t: libc::timeval| t.tv_sec as u64 * 1000 + t.tv_usec as u64 / 1000;
    ms(u.ru_utime) + ms(u.ru_stime)
}

#[test]
fn out_of_descriptors_the_server_backs_off_and_logs_once() {
    let mut producer = Peer::spawn(ENTRY, "starved_producer", "");
    let line = producer.recv();
    let h = PoolHandle::from_bytes(&unhex(line.strip_prefix("handle ").unwrap())).unwrap();
    // Twenty consumers knock; their connections wait in the backlog.
    let knocking: Vec<OwnedFd> = (0..20).map(|_| abstract_socket::connect(&h.socket_name).unwrap()).collect();
    producer.send("knocked");
    let report = producer.recv();
    eprintln!("starved producer: {report}");
    let words: Vec<&str> = report.split_whitespace().collect();
    let logged: usize = words[1].parse().unwrap();
    assert!(logged <= 1, "the failed accept was logged {logged} times in a second: {report}");
    assert_eq!(words[5], "true", "consumers were not admitted once descriptors were free: {report}");
    drop(knocking);
    producer.kill9();
}
