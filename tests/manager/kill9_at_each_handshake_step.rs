//! kill -9 at each point of the sharing handshake: afterwards no segment
//! of the test is left in /dev/shm (within a bounded wait), no manager
//! lingers, and a live holder's segment is never removed.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, pattern, shm_exists, use_built_manager, wait_until, Parent, Peer};
use std::time::Duration;
use storage_sharing::manager::default_client;
use storage_sharing::shm::flags::{EXCLUSIVE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};
use storage_sharing::storage::Storage;
use storage_sharing::ErrorKind;

const ENTRY: &str = "child_entry";
// A hang guard: a reference in flight with no client left is kept for the
// manager's grace period (10 s) before it is given up.
const CLEANUP: Duration = Duration::from_secs(30);

#[test]
fn child_entry() {
    child_main(|role, mut parent| match role {
        "producer_steps" => producer_steps(&mut parent),
        "producer" => producer(&mut parent),
        "consumer" => consumer(&mut parent),
        "keeper" => keeper(&mut parent),
        "drainer" => drainer(&mut parent),
        "closer" => closer(&mut parent),
        other => panic!("unknown role {other}"),
    });
}

/// The managed allocator's steps one at a time, reporting each; the
/// parent kills it at the step named in the argument.
fn producer_steps(parent: &mut Parent) {
    let stop = parent.arg.clone();
    let client = default_client().unwrap();
    parent.send(&format!("connected {}", client.path()));
    if stop == "connected" {
        return parent.wait_for_close();
    }
    let name = new_process_wide_shm_handle();
    client.register(&name).unwrap();
    parent.send(&format!("registered {name}"));
    if stop == "registered" {
        return parent.wait_for_close();
    }
    let map = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    parent.send("mapped");
    if stop == "mapped" {
        return parent.wait_for_close();
    }
    map.incref().unwrap();
    parent.send("incref");
    parent.wait_for_close();
}

/// Creates a managed segment and drops it (the last holder: its free
/// waits for the next message to the manager), then, unless the argument
/// is "after_free", creates a second one, whose registration carries
/// that free. Reports the names and waits to be killed.
fn closer(parent: &mut Parent) {
    let first = Storage::new_using_filename(4096).unwrap();
    let first_name = first.filename_handle().unwrap().filename;
    drop(first);
    if parent.arg == "after_free" {
        parent.send(&format!("freed {first_name}"));
        return parent.wait_for_close();
    }
    let second = Storage::new_using_filename(4096).unwrap();
    let h = second.filename_handle().unwrap();
    parent.send(&format!("mapped {first_name} {} {}", h.filename, h.manager_handle));
    parent.wait_for_close();
    drop(second);
}

fn segments_of(pid: i32) -> Vec<String> {
    let prefix = format!("torch_{pid}_");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn assert_cleaned(pid: i32, manager: &str) {
    assert!(wait_until(CLEANUP, || segments_of(pid).is_empty()), "segments left: {:?}", segments_of(pid));
    assert!(wait_until(CLEANUP, || !std::path::Path::new(manager).exists()), "manager {manager} still running");
}

#[test]
fn producer_killed_at_each_step() {
    for stop in ["connected", "registered", "mapped", "incref"] {
        let mut peer = Peer::spawn(ENTRY, "producer_steps", stop);
        let pid = peer.pid();
        let manager = peer.recv().split(' ').nth(1).unwrap().to_string();
        let mut name = String::new();
        if stop != "connected" {
            loop {
                let line = peer.recv();
                if let Some(n) = line.strip_prefix("registered ") {
                    name = n.to_string();
                }
                if line.starts_with(stop) {
                    break;
                }
            }
        }
        if stop == "mapped" || stop == "incref" {
            assert!(shm_exists(&name));
        }
        peer.kill9();
        assert_cleaned(pid, &manager);
    }
}

#[test]
fn killed_with_a_deferred_free_leaves_nothing() {
    use_built_manager();
    for when in ["after_free", "after_next_create"] {
        let mut peer = Peer::spawn(ENTRY, "closer", when);
        let pid = peer.pid();
        let line = peer.recv();
        let parts: Vec<&str> = line.split(' ').collect();
        assert!(!shm_exists(parts[1]), "{when}: the dropped segment is still there");
        if when == "after_next_create" {
            assert!(shm_exists(parts[2]), "{when}: the live segment is missing");
        }
        peer.kill9();
        // The manager's path is not reported in the first case: every
        // segment of the child, and the child's manager, must go.
        assert!(wait_until(CLEANUP, || segments_of(pid).is_empty()), "{when}: segments left: {:?}", segments_of(pid));
        if let Some(manager) = parts.get(3) {
            assert!(wait_until(CLEANUP, || !std::path::Path::new(manager).exists()), "manager {manager} still running");
        }
    }
}

/// Shares a storage by name (incref in flight), sends its handle, then
/// waits for orders: "drop" closes its storage, "exit" ends.
fn producer(parent: &mut Parent) {
    let s = Storage::from_bytes(&pattern(8192, 4)).unwrap();
    let h = s.share_filename().unwrap();
    s.shared_incref().unwrap();
    parent.send(&format!("{} {} {}", h.manager_handle, h.filename, h.nbytes));
    let mut s = Some(s);
    while parent.recv() == "drop" {
        s = None;
        parent.send("dropped");
    }
    drop(s);
}

/// Opens the handle in its argument when told to, then waits.
fn consumer(parent: &mut Parent) {
    let parts: Vec<String> = parent.arg.split(' ').map(str::to_string).collect();
    parent.send("ready");
    assert_eq!(parent.recv(), "open");
    match Storage::new_shared_filename(&parts[0], &parts[1], parts[2].parse().unwrap()) {
        Ok(s) => {
            s.shared_decref().unwrap();
            let ok = s.to_vec() == pattern(8192, 4);
            parent.send(if ok { "opened" } else { "bad" });
            parent.wait_for_close();
        }
        Err(e) => parent.send(&format!("error {:?}", e.kind())),
    }
}

fn handle_of(line: &str) -> (String, String, usize) {
    let p: Vec<&str> = line.split(' ').collect();
    (p[0].to_string(), p[1].to_string(), p[2].parse().unwrap())
}

/// A producer that shared a storage by name (incref in flight) and a
/// consumer given its handle, ready to open it; and the manager's socket
/// path and the segment name from that handle.
struct Pair {
    prod: Peer,
    cons: Peer,
    manager: String,
    name: String,
}

fn producer_and_consumer() -> Pair {
    let mut prod = Peer::spawn(ENTRY, "producer", "");
    let line = prod.recv();
    let (manager, name, _) = handle_of(&line);
    let mut cons = Peer::spawn(ENTRY, "consumer", &line);
    assert_eq!(cons.recv(), "ready");
    Pair { prod, cons, manager, name }
}

/// Tells the consumer to open the handle and waits until it has.
fn open_in(cons: &mut Peer) {
    cons.send("open");
    assert_eq!(cons.recv(), "opened");
}

#[test]
fn producer_killed_with_incref_in_flight_before_consumer_opens() {
    let Pair { prod, mut cons, manager, name } = producer_and_consumer();
    let pid = prod.pid();
    prod.kill9();
    // The reference taken for the receiver is still in the header: the
    // segment is in flight, not abandoned, and must still open.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(shm_exists(&name), "a segment in flight to a receiver was removed");
    open_in(&mut cons);
    drop(cons);
    assert_cleaned(pid, &manager);
}

#[test]
fn producer_killed_after_consumer_mapped_keeps_segment_until_consumer_closes() {
    let Pair { prod, mut cons, manager, name } = producer_and_consumer();
    open_in(&mut cons);
    let pid = prod.pid();
    prod.kill9();
    // The consumer is alive and maps it: it must stay through several of
    // the manager's 2-second re-checks.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(shm_exists(&name), "a live consumer's segment was removed");
    drop(cons); // closes the connection: the consumer returns and exits
    assert_cleaned(pid, &manager);
    assert!(!shm_exists(&name));
}

#[test]
fn consumer_killed_after_mapping_producer_keeps_it_then_it_goes() {
    let Pair { mut prod, mut cons, manager, name } = producer_and_consumer();
    open_in(&mut cons);
    cons.kill9();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(shm_exists(&name), "the live producer's segment was removed");
    // The producer drops its storage; the count stays above 0 (the dead
    // consumer's reference), the manager removes it anyway.
    prod.send("drop");
    assert_eq!(prod.recv(), "dropped");
    assert!(wait_until(CLEANUP, || !shm_exists(&name)), "{name} left after the producer dropped it");
    let pid = prod.pid();
    prod.send("exit");
    prod.finish();
    assert_cleaned(pid, &manager);
}

#[test]
fn consumer_killed_with_incref_in_flight_then_producer_exits() {
    let Pair { mut prod, cons, manager, name } = producer_and_consumer();
    cons.kill9();
    prod.send("drop");
    assert_eq!(prod.recv(), "dropped");
    // The in-flight +1 may belong to a slow live receiver: kept while the
    // producer's manager has clients, removed when it goes idle.
    assert!(shm_exists(&name));
    let pid = prod.pid();
    prod.send("exit");
    prod.finish();
    assert_cleaned(pid, &manager);
}

#[test]
fn both_killed() {
    let Pair { prod, mut cons, manager, .. } = producer_and_consumer();
    open_in(&mut cons);
    let pid = prod.pid();
    cons.kill9();
    prod.kill9();
    assert_cleaned(pid, &manager);
}

#[test]
fn consumer_in_this_process_survives_producer_kill() {
    use_built_manager();
    let mut prod = Peer::spawn(ENTRY, "producer", "");
    let (manager, name, n) = handle_of(&prod.recv());
    let s = Storage::new_shared_filename(&manager, &name, n).unwrap();
    s.shared_decref().unwrap();
    let pid = prod.pid();
    prod.kill9();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(shm_exists(&name));
    assert_eq!(s.to_vec(), pattern(8192, 4));
    drop(s);
    // This process stays connected to the manager, which therefore runs on.
    assert!(wait_until(CLEANUP, || segments_of(pid).is_empty()), "segments left: {:?}", segments_of(pid));
    let e = Storage::new_shared_filename(&manager, &name, n).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::NotFound | ErrorKind::PeerGone), "{e}");
}

/// Shares N storages by name; the even ones get the reference a sender
/// takes for its receiver (as PyTorch's reduction does before queueing).
/// Sends one line per storage, `manager name nbytes in_flight`, then
/// "done", and waits to be killed.
fn keeper(parent: &mut Parent) {
    let n: usize = parent.arg.parse().unwrap();
    let mut keep = Vec::new();
    for i in 0..n {
        let s = Storage::from_bytes(&pattern(4096 + i, i as u8)).unwrap();
        let h = s.share_filename().unwrap();
        let in_flight = i % 2 == 0;
        if in_flight {
            s.shared_incref().unwrap();
        }
        parent.send(&format!("{} {} {} {}", h.manager_handle, h.filename, h.nbytes, in_flight as u8));
        keep.push(s);
    }
    parent.send("done");
    parent.wait_for_close();
}

/// Opens every handle in its argument (`manager name nbytes seed;...`) as a
/// receiver does (open, then cancel the sender's reference), checks the
/// bytes, and holds them until told to close.
fn drainer(parent: &mut Parent) {
    parent.send("ready");
    assert_eq!(parent.recv(), "open");
    let mut held = Vec::new();
    for item in parent.arg.split(';') {
        let p: Vec<&str> = item.split(' ').collect();
        let n: usize = p[2].parse().unwrap();
        match Storage::new_shared_filename(p[0], p[1], n) {
            Ok(s) => {
                s.shared_decref().unwrap();
                if s.to_vec() != pattern(n, p[3].parse().unwrap()) {
                    return parent.send(&format!("bad bytes in {}", p[1]));
                }
                held.push(s);
            }
            Err(e) => return parent.send(&format!("error {}: {e}", p[1])),
        }
    }
    parent.send("opened");
    assert_eq!(parent.recv(), "close");
    drop(held);
    parent.send("closed");
    parent.wait_for_close();
}

#[test]
fn producer_killed_with_storages_in_flight_loses_none_and_leaks_none() {
    const N: usize = 8;
    let mut prod = Peer::spawn(ENTRY, "keeper", &N.to_string());
    let pid = prod.pid();
    let mut manager = String::new();
    let (mut taken, mut kept) = (Vec::new(), Vec::new());
    for i in 0..N {
        let line = prod.recv();
        let p: Vec<&str> = line.split(' ').collect();
        manager = p[0].to_string();
        if p[3] == "1" {
            taken.push(format!("{} {} {} {i}", p[0], p[1], p[2]));
        } else {
            kept.push(p[1].to_string());
        }
    }
    assert_eq!(prod.recv(), "done");
    let taken_names: Vec<String> = taken.iter().map(|t| t.split(' ').nth(1).unwrap().to_string()).collect();
    prod.kill9();
    // Only the dead producer referenced these: they go at once.
    assert!(wait_until(CLEANUP, || kept.iter().all(|n| !shm_exists(n))), "left: {:?}", segments_of(pid));
    // The receiver's references keep the rest, past the manager's idle
    // shutdown (no client is connected now), until the receiver comes.
    std::thread::sleep(Duration::from_millis(3000));
    let lost: Vec<&String> = taken_names.iter().filter(|n| !shm_exists(n)).collect();
    assert!(lost.is_empty(), "segments in flight were removed: {lost:?}");
    let mut cons = Peer::spawn(ENTRY, "drainer", &taken.join(";"));
    assert_eq!(cons.recv(), "ready");
    cons.send("open");
    assert_eq!(cons.recv(), "opened");
    assert_eq!(segments_of(pid).len(), taken.len());
    cons.send("close");
    assert_eq!(cons.recv(), "closed");
    // Its closes leave only the dead producer's references: all go, while
    // the receiver is still connected.
    assert!(wait_until(CLEANUP, || segments_of(pid).is_empty()), "left: {:?}", segments_of(pid));
    drop(cons);
    assert_cleaned(pid, &manager);
    assert_eq!(segments_of(pid).len(), 0);
}
