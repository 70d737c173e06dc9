//! The device-independent protocol, for real: host "device memory" in shm,
//! consumers in other processes (this test binary re-executed), kill -9,
//! PyTorch-style non-atomic peers. Every test checks /dev/shm is clean.

use super::counters::{CounterFile, SLOTS_PER_FILE};
use super::host_backend::HostBackend;
use super::ipc::{CudaIpc, MAX_EVENTS_IN_USE, RESEND_MESSAGE};
use super::limbo::WARN_AFTER_BLOCKS_IN_LIMBO;
use super::{release_ipc_counter, IpcHandle};
use crate::error::ErrorKind;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

const ROLE_ENV: &str = "SS_CUDA_TEST_ROLE";
const ARGS_ENV: &str = "SS_CUDA_TEST_ARGS";

type Log = Arc<Mutex<Vec<u64>>>;

fn tag(test: &str) -> String {
    format!("{test}{}", std::process::id())
}

fn shm_names(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

fn exists(name: &str) -> bool {
    std::path::Path::new(&format!("/dev/shm{name}")).exists()
}

/// Drops the state and checks nothing of the test is left in /dev/shm.
fn finish(ipc: CudaIpc<HostBackend>, tag: &str, counter_names: &[String]) {
    drop(ipc);
    assert_eq!(shm_names(&HostBackend::prefix(tag)), Vec::<String>::new(), "host segments left");
    for n in counter_names {
        assert!(!exists(n), "counter file {n} left in /dev/shm");
    }
}

fn fill(ptr: u64, len: usize, byte: u8) {
    // SAFETY: tests pass live mappings of at least `len` bytes.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, byte, len) }
}

fn all_equal(ptr: u64, len: usize, byte: u8) -> bool {
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.iter().all(|b| *b == byte)
}

/// A child process running [`child_process`] in `role`, spoken to by lines.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(role: &str, args: &[&str]) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "cuda::tests::child_process", "--ignored", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .env(ARGS_ENV, args.join("\n"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Peer { child, stdin, stdout }
    }

    /// The next protocol line ("@@ ..."), skipping the test harness's output.
    fn reply(&mut self) -> String {
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "peer exited without replying");
            // The harness prints "test name ... " before our first line.
            if let Some(at) = line.find("@@ ") {
                return line[at + 3..].trim_end().to_string();
            }
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.reply()
    }

    fn exit(mut self) {
        writeln!(self.stdin, "exit").unwrap();
        self.wait_ok();
    }

    fn wait_ok(mut self) {
        drop(self.stdin);
        assert!(self.child.wait().unwrap().success(), "peer failed");
    }
}

/// Entry point of the child processes (ignored when run directly).
#[test]
#[ignore = "helper: run by other tests as a child process"]
fn child_process() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    let args: Vec<String> = std::env::var(ARGS_ENV).unwrap().lines().map(String::from).collect();
    match role.as_str() {
        "consumer" => consumer(&args[0]),
        "producer" => producer(&args[0]),
        "pytorch_style" | "atomic" => {
            let slots = args[1].split(',').map(|s| s.parse::<u64>().unwrap());
            for slot in slots {
                if role == "atomic" {
                    release_ipc_counter(&args[0], slot).unwrap();
                } else {
                    pytorch_style_release(&args[0], slot as usize);
                }
            }
            println!("@@ done");
        }
        r => panic!("unknown role {r}"),
    }
}

/// What PyTorch's `_release_ipc_counter_cuda` does: open the file, a plain
/// (non-atomic) read-modify-write of the slot, close.
fn pytorch_style_release(name: &str, slot: usize) {
    let file = CounterFile::open(name).unwrap();
    let p = file.slot(slot).as_ptr();
    // SAFETY: an in-bounds aligned slot of the live mapping; deliberately
    // not atomic, like PyTorch.
    unsafe { std::ptr::write_volatile(p, std::ptr::read_volatile(p) - 1) };
}

fn consumer(tag: &str) {
    let ipc = CudaIpc::new(HostBackend::new(tag));
    let mut held = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let (cmd, rest) = line.split_once(' ').unwrap_or((&line, ""));
        let reply = match cmd {
            "open" => match ipc.open(&IpcHandle::from_text(rest).unwrap(), 0) {
                Ok(r) => {
                    held.push(Some(r));
                    format!("ok {}", held.len() - 1)
                }
                Err(e) => format!("err {:?} {}", e.kind(), e.message()),
            },
            "check" | "fill" => {
                let (i, byte) = rest.split_once(' ').unwrap();
                let r = held[i.parse::<usize>().unwrap()].as_ref().unwrap();
                let byte: u8 = byte.parse().unwrap();
                if cmd == "fill" {
                    fill(r.data(), r.size() as usize, byte);
                    "ok".to_string()
                } else if all_equal(r.data(), r.size() as usize, byte) {
                    "ok".to_string()
                } else {
                    "err mismatch".to_string()
                }
            }
            "free" => match ipc.received_free(held[rest.parse::<usize>().unwrap()].take().unwrap()) {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("err {:?} {}", e.kind(), e.message()),
            },
            "mappings" => format!("{}", ipc.open_mappings()),
            "exit" => break,
            c => panic!("unknown command {c}"),
        };
        println!("@@ {reply}");
    }
}

fn producer(tag: &str) {
    let ipc = CudaIpc::new(HostBackend::new(tag));
    let ptr = ipc.backend().alloc(4096);
    fill(ptr, 4096, 0x5a);
    let (h1, s1) = ipc.share(ptr, 1024, 0, 0, None).unwrap();
    let (h2, s2) = ipc.share(ptr + 1024, 1024, 0, 0, None).unwrap();
    println!("@@ {}", h1.to_text());
    println!("@@ {}", h2.to_text());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    // Exit without freeing: the "driver" (dropping the backend) frees the
    // memory, the teardown removes the counter file.
    drop((s1, s2));
}

#[test]
fn consumers_in_other_processes_release_and_limbo_drains() {
    let tag = tag("xproc");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let log: Log = Arc::default();
    // Four blocks, each shared once, with a pattern written before sending.
    let mut sends = Vec::new();
    for i in 0..4u8 {
        let ptr = ipc.backend().alloc(8192);
        fill(ptr, 8192, 0x10 + i);
        let (h, s) = ipc.share(ptr + 4096, 4096, 0, 0, Some(ipc.backend().deleter(&log))).unwrap();
        assert_eq!(h.offset_bytes, 4096);
        assert_eq!((h.mem_handle[0], h.mem_handle[1], h.mem_handle.len()), (2, b'c', 66));
        assert!(h.event_sync_required);
        sends.push((ptr, h, s.unwrap()));
    }
    let counters = ipc.counter_file_names();
    assert_eq!(counters.len(), 1);
    let mut a = Peer::spawn("consumer", &[&tag]);
    let mut b = Peer::spawn("consumer", &[&tag]);
    for (i, (_, h, _)) in sends.iter().enumerate() {
        let peer = if i % 2 == 0 { &mut a } else { &mut b };
        let idx = i / 2;
        assert_eq!(peer.cmd(&format!("open {}", h.to_text())), format!("ok {idx}"));
        assert_eq!(peer.cmd(&format!("check {idx} {}", 0x10 + i)), "ok");
        assert_eq!(peer.cmd(&format!("fill {idx} {}", 0xa0 + i)), "ok");
    }
    // The consumers' writes are in the producer's memory; the part not
    // shared is untouched.
    for (i, (ptr, _, _)) in sends.iter().enumerate() {
        assert!(all_equal(ptr + 4096, 4096, 0xa0 + i as u8));
        assert!(all_equal(*ptr, 4096, 0x10 + i as u8));
    }
    // The producer lets go of blocks 0 and 1 while consumers still hold them.
    let mut sends = sends.into_iter();
    for (_, _, s) in sends.by_ref().take(2) {
        assert!(ipc.sent_free(s), "still referenced: into limbo");
    }
    assert_eq!(ipc.limbo_size(), 2);
    assert_eq!(ipc.collect(), 0);
    assert!(log.lock().unwrap().is_empty());
    // Consumers release everything.
    for peer in [&mut a, &mut b] {
        for idx in 0..2 {
            assert_eq!(peer.cmd(&format!("free {idx}")), "ok");
        }
        assert_eq!(peer.cmd("mappings"), "0");
    }
    assert_eq!(ipc.collect(), 2, "both limbo blocks reached 0");
    assert_eq!(ipc.limbo_size(), 0);
    for (_, _, s) in sends {
        assert!(!ipc.sent_free(s), "released already: freed at once");
    }
    assert_eq!(log.lock().unwrap().len(), 4, "every deleter ran once");
    assert_eq!(ipc.backend().live_allocations(), 0);
    assert_eq!(ipc.events_in_use(), 0);
    assert_eq!(ipc.backend().events_destroyed.load(std::sync::atomic::Ordering::SeqCst), 4);
    assert_eq!(ipc.counter_file_names(), counters, "sent_free keeps the current file for the next send");
    assert_eq!(ipc.collect(), 0);
    assert!(ipc.counter_file_names().is_empty(), "a full collection drops it: limbo empty, no slot used");
    a.exit();
    b.exit();
    finish(ipc, &tag, &counters);
}

#[test]
fn collect_frees_exactly_the_blocks_at_zero() {
    let tag = tag("collect");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let log: Log = Arc::default();
    let mut ptrs = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..10 {
        let p = ipc.backend().alloc(256);
        let (h, s) = ipc.share(p, 256, 0, 0, Some(ipc.backend().deleter(&log))).unwrap();
        assert!(ipc.sent_free(s.unwrap()));
        ptrs.push(p);
        handles.push(h);
    }
    let name = handles[0].ref_counter_handle.clone();
    assert!(handles.iter().all(|h| h.ref_counter_handle == name));
    assert_eq!(ipc.limbo_size(), 10);
    // A consumer in another process releases slots 0, 3 and 7.
    let mut peer = Peer::spawn("atomic", &[&name, "0,3,7"]);
    assert_eq!(peer.reply(), "done");
    peer.wait_ok();
    assert_eq!(ipc.collect(), 3);
    let mut freed = log.lock().unwrap().clone();
    freed.sort();
    let mut want = vec![ptrs[0], ptrs[3], ptrs[7]];
    want.sort();
    assert_eq!(freed, want);
    let report = ipc.limbo_report();
    assert_eq!(report.iter().map(|b| b.slot).collect::<Vec<_>>(), vec![1, 2, 4, 5, 6, 8, 9]);
    assert!(report.iter().all(|b| b.counter_value == 1 && b.counter_name == name));
    for slot in [1, 2, 4, 5, 6, 8, 9] {
        release_ipc_counter(&name, slot).unwrap();
    }
    assert_eq!(ipc.collect(), 7);
    assert_eq!(ipc.limbo_size(), 0);
    assert_eq!(log.lock().unwrap().len(), 10);
    finish(ipc, &tag, &[name]);
}

#[test]
fn file_rotates_after_10000_sends_and_events_fall_back_to_sync() {
    use std::sync::atomic::Ordering::SeqCst;
    let tag = tag("rotate");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let ptr = ipc.backend().alloc(64);
    let n = SLOTS_PER_FILE + 5;
    let mut sends = Vec::with_capacity(n);
    for _ in 0..n {
        let (h, s) = ipc.share(ptr, 64, 0, 0, None).unwrap();
        sends.push((h, s.unwrap()));
    }
    let first = sends[0].0.ref_counter_handle.clone();
    let second = sends[SLOTS_PER_FILE].0.ref_counter_handle.clone();
    assert_ne!(first, second);
    assert_eq!(sends[SLOTS_PER_FILE - 1].0.ref_counter_handle, first);
    assert_eq!(sends[SLOTS_PER_FILE - 1].0.ref_counter_offset, SLOTS_PER_FILE as u64 - 1);
    assert_eq!(sends[SLOTS_PER_FILE].0.ref_counter_offset, 0);
    assert_eq!(ipc.counter_file_names().len(), 2);
    // The first 1000 sends carry an event; later ones synchronised the stream.
    assert!(sends[MAX_EVENTS_IN_USE - 1].0.event_sync_required);
    let late = &sends[MAX_EVENTS_IN_USE].0;
    assert!(!late.event_sync_required && late.event_handle == [0; 64]);
    assert_eq!(ipc.events_in_use(), MAX_EVENTS_IN_USE);
    assert_eq!(ipc.backend().stream_syncs.load(SeqCst), n - MAX_EVENTS_IN_USE);
    // Everything released and freed: the exhausted file retires at once,
    // the current one at the next collection with limbo empty.
    for (h, s) in sends {
        release_ipc_counter(&h.ref_counter_handle, h.ref_counter_offset).unwrap();
        assert!(!ipc.sent_free(s));
    }
    assert!(!exists(&first), "exhausted and unused: retired at once");
    assert!(exists(&second), "the current file stays for the next send");
    ipc.collect();
    assert!(!exists(&second));
    assert_eq!(ipc.events_in_use(), 0);
    assert_eq!(ipc.backend().events_destroyed.load(SeqCst), MAX_EVENTS_IN_USE);
    ipc.backend().free(ptr);
    finish(ipc, &tag, &[first, second]);
}

#[test]
fn killed_consumer_pins_its_block_and_the_api_reports_it() {
    let tag = tag("kill9");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let log: Log = Arc::default();
    let ptr = ipc.backend().alloc(4096);
    let (h, s) = ipc.share(ptr, 4096, 0, 0, Some(ipc.backend().deleter(&log))).unwrap();
    let mut peer = Peer::spawn("consumer", &[&tag]);
    assert_eq!(peer.cmd(&format!("open {}", h.to_text())), "ok 0");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(peer.child.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let status = peer.child.wait().unwrap();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
    assert!(ipc.sent_free(s.unwrap()), "the dead consumer never released: limbo");
    assert_eq!(ipc.collect(), 0);
    let report = ipc.limbo_report();
    assert_eq!(report.len(), 1);
    assert_eq!((report[0].ptr, report[0].slot, report[0].counter_value), (ptr, 0, 1));
    assert_eq!(report[0].counter_name, h.ref_counter_handle);
    assert!(log.lock().unwrap().is_empty(), "pinned memory is never given back");
    let t = ipc.teardown();
    assert_eq!((t.still_referenced, t.counter_files_removed), (1, 1));
    assert!(!exists(&h.ref_counter_handle));
    ipc.backend().free(ptr);
    finish(ipc, &tag, &[h.ref_counter_handle]);
}

#[test]
fn consumer_of_a_gone_producer_gets_peer_gone() {
    let tag = tag("gone");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let mut producer = Peer::spawn("producer", &[&tag]);
    let h1 = IpcHandle::from_text(&producer.reply()).unwrap();
    let h2 = IpcHandle::from_text(&producer.reply()).unwrap();
    let r1 = ipc.open(&h1, 0).unwrap();
    assert!(all_equal(r1.data(), 1024, 0x5a), "the producer's pattern");
    writeln!(producer.stdin, "exit").unwrap();
    producer.wait_ok();
    let e = ipc.received_free(r1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    assert!(e.message().contains(&h1.ref_counter_handle), "{e}");
    assert_eq!(ipc.open_mappings(), 0, "the mapping was closed all the same");
    let e = ipc.open(&h2, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    finish(ipc, &tag, &[h1.ref_counter_handle]);
}

#[test]
fn pytorch_style_non_atomic_peers_add_up() {
    let tag = tag("nonatomic");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let ptr = ipc.backend().alloc(4096);
    let n = 2000;
    let mut handles = Vec::new();
    for i in 0..n {
        let (h, s) = ipc.share(ptr + (i % 64) * 64, 64, 0, 0, None).unwrap();
        assert!(ipc.sent_free(s.unwrap()));
        handles.push(h);
    }
    assert_eq!(ipc.limbo_size(), n as usize);
    assert!(ipc.limbo_warned(), "above {WARN_AFTER_BLOCKS_IN_LIMBO} blocks in limbo we warn");
    let name = handles[0].ref_counter_handle.clone();
    // Eight peers at once on one file: four decrement like PyTorch (plain
    // read-modify-write), four atomically; each owns every 8th slot.
    let peers: Vec<Peer> = (0..8)
        .map(|k| {
            let slots: Vec<String> = (k..n).step_by(8).map(|s| s.to_string()).collect();
            Peer::spawn(if k < 4 { "pytorch_style" } else { "atomic" }, &[&name, &slots.join(",")])
        })
        .collect();
    for mut p in peers {
        assert_eq!(p.reply(), "done");
        p.wait_ok();
    }
    assert!(ipc.limbo_report().iter().all(|b| b.counter_value == 0));
    assert_eq!(ipc.collect(), n as usize);
    assert_eq!(ipc.limbo_size(), 0);
    ipc.backend().free(ptr);
    finish(ipc, &tag, &[name]);
}

#[test]
fn received_memory_cannot_be_sent_on_and_is_mapped_once() {
    let tag = tag("resend");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let log: Log = Arc::default();
    let ptr = ipc.backend().alloc(2048);
    let (h1, s1) = ipc.share(ptr, 1024, 0, 0, None).unwrap();
    let (h2, s2) = ipc.share(ptr + 1024, 1024, 0, 0, Some(ipc.backend().deleter(&log))).unwrap();
    assert_eq!(h1.mem_handle, h2.mem_handle, "one allocation, one memory handle");
    let r1 = ipc.open(&h1, 0).unwrap();
    let r2 = ipc.open(&h2, 0).unwrap();
    assert_eq!(ipc.open_mappings(), 1);
    assert_eq!(r2.data(), r1.data() + 1024);
    let e = ipc.share(r2.data() + 8, 8, 0, 0, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert_eq!(e.message(), RESEND_MESSAGE);
    ipc.received_free(r1).unwrap();
    assert_eq!(ipc.open_mappings(), 1, "r2 still uses the mapping");
    ipc.received_free(r2).unwrap();
    assert_eq!(ipc.open_mappings(), 0);
    assert!(!ipc.sent_free(s1.unwrap()));
    assert!(!ipc.sent_free(s2.unwrap()));
    assert_eq!(*log.lock().unwrap(), vec![ptr + 1024], "the deleter gets the shared pointer");
    finish(ipc, &tag, &[h1.ref_counter_handle]);
}

fn kind<T>(r: crate::Result<T>) -> ErrorKind {
    r.map(|_| ()).unwrap_err().kind()
}

#[test]
fn bad_pointers_and_tuples_are_refused() {
    let tag = tag("bad");
    let ipc = CudaIpc::new(HostBackend::new(&tag));
    let ptr = ipc.backend().alloc(1024);
    assert_eq!(kind(ipc.share(0x1000, 8, 0, 0, None)), ErrorKind::InvalidArgument);
    assert_eq!(kind(ipc.share(ptr + 10, 1024, 0, 0, None)), ErrorKind::SizeMismatch);
    assert_eq!(kind(ipc.share(0, 8, 0, 0, None)), ErrorKind::InvalidArgument);
    assert_eq!(kind(ipc.share(ptr, 8, 1, 0, None)), ErrorKind::InvalidArgument);
    assert!(ipc.counter_file_names().is_empty(), "failed shares take no slot");
    let (null, none) = ipc.share(0, 0, 0, 0, None).unwrap();
    assert!(null.is_null() && none.is_none());
    let r = ipc.open(&null, 0).unwrap();
    assert_eq!((r.data(), r.size()), (0, 0));
    ipc.received_free(r).unwrap();

    let (h, s) = ipc.share(ptr, 512, 0, 0, None).unwrap();
    let too_big = IpcHandle { size_bytes: 1024, offset_bytes: 1, ..h.clone() };
    assert_eq!(kind(ipc.open(&too_big, 0)), ErrorKind::SizeMismatch);
    assert_eq!(ipc.open_mappings(), 0, "a refused open leaves no mapping");
    let bad_slot = IpcHandle { ref_counter_offset: 10_000, ..h.clone() };
    assert_eq!(kind(ipc.open(&bad_slot, 0)), ErrorKind::InvalidArgument);
    let bad_handle = IpcHandle { mem_handle: vec![2, b'z', 0, 0], ..h.clone() };
    assert_eq!(kind(ipc.open(&bad_handle, 0)), ErrorKind::InvalidArgument);
    let no_file = IpcHandle { ref_counter_handle: format!("/torch_no_such_{}", std::process::id()), ..h.clone() };
    assert_eq!(kind(ipc.open(&no_file, 0)), ErrorKind::PeerGone);
    release_ipc_counter(&h.ref_counter_handle, h.ref_counter_offset).unwrap();
    let e = ipc.open(&h, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::BadRefcount, "{e}");
    assert!(e.message().contains("already released"), "{e}");
    assert!(!ipc.sent_free(s.unwrap()));
    ipc.backend().free(ptr);
    finish(ipc, &tag, &[h.ref_counter_handle]);
}
