//! Registrations and frees written to the registration log (no socket
//! message) count exactly as socket messages: a client killed with -9 right
//! after creating segments leaves nothing, also after more records than the
//! log holds at once, and a forked child registers through its own
//! connection, never through its parent's log.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, shm_exists, wait_until, Parent, Peer};
use std::io::{Read, Write};
use std::time::Duration;
use storage_sharing::manager::reglog::CAPACITY;
use storage_sharing::manager::{default_client, ManagedMapAllocator};
use storage_sharing::shm::flags::{EXCLUSIVE, SHAREDMEM};
use storage_sharing::shm::new_process_wide_shm_handle;

const ENTRY: &str = "child_entry";
/// A hang guard only.
const CLEANUP: Duration = Duration::from_secs(30);

#[test]
fn child_entry() {
    child_main(|role, mut parent| match role {
        "creator" => creator(&mut parent),
        "forker" => forker(&mut parent),
        other => panic!("unknown role {other}"),
    });
}

/// Connects, waits until the log is in use, creates and drops
/// `churn` segments, then creates `keep` and keeps them; reports the
/// manager, whether every one went through the log, and the names kept.
fn creator(parent: &mut Parent) {
    let args: Vec<usize> = parent.arg.split(' ').map(|a| a.parse().unwrap()).collect();
    let (churn, keep) = (args[0], args[1]);
    let client = default_client().unwrap();
    client.sync().unwrap();
    let mut through_log = client.uses_registration_log();
    for _ in 0..churn {
        drop(ManagedMapAllocator::open("", &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap());
        through_log &= client.uses_registration_log();
    }
    let mut kept = Vec::new();
    for _ in 0..keep {
        kept.push(ManagedMapAllocator::open("", &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap());
        through_log &= client.uses_registration_log();
    }
    let names: Vec<&str> = kept.iter().map(|m| m.filename()).collect();
    parent.send(&format!("{} {through_log} {}", client.path(), names.join(" ")));
    parent.wait_for_close();
}

fn killed_creator_leaves_nothing(churn: usize, keep: usize) {
    let mut peer = Peer::spawn(ENTRY, "creator", &format!("{churn} {keep}"));
    let line = peer.recv();
    let parts: Vec<&str> = line.split(' ').collect();
    let (manager, through_log, names) = (parts[0], parts[1], &parts[2..]);
    assert_eq!(through_log, "true", "the registrations did not all go through the log");
    assert_eq!(names.len(), keep);
    assert!(names.iter().all(|n| shm_exists(n)));
    peer.kill9();
    assert!(wait_until(CLEANUP, || names.iter().all(|n| !shm_exists(n))), "segments left: {names:?}");
    assert!(wait_until(CLEANUP, || !std::path::Path::new(manager).exists()), "manager {manager} still running");
}

#[test]
fn killed_right_after_creating_by_name_leaves_nothing() {
    killed_creator_leaves_nothing(0, 3);
}

#[test]
fn a_log_that_fills_keeps_every_record() {
    // More frees and registrations than the log holds, then more kept
    // segments than it holds.
    let n = CAPACITY as usize + 20;
    killed_creator_leaves_nothing(n, n);
}

/// Uses its log, then forks a child that creates a segment by name and
/// sends its pid and name; the parent stays alive and connected.
fn forker(parent: &mut Parent) {
    let client = default_client().unwrap();
    client.sync().unwrap();
    assert!(client.uses_registration_log());
    let mine = ManagedMapAllocator::open("", &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    let (mut rd, mut wr) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: the child only creates a segment, writes a line and waits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let seg = ManagedMapAllocator::open("", &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap();
        let line = format!("{} {}\n", std::process::id(), seg.filename());
        wr.write_all(line.as_bytes()).unwrap();
        loop {
            // SAFETY: waits for the kill.
            unsafe { libc::pause() };
        }
    }
    drop(wr);
    let mut line = String::new();
    let mut byte = [0u8];
    while rd.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
        line.push(byte[0] as char);
    }
    parent.send(&format!("{} {line}", mine.filename()));
    assert_eq!(parent.recv(), "reap");
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
    parent.send(&format!("alive {}", shm_exists(mine.filename())));
    parent.wait_for_close();
}

#[test]
fn a_forked_child_registers_through_its_own_connection() {
    let mut peer = Peer::spawn(ENTRY, "forker", "");
    let line = peer.recv();
    let parts: Vec<&str> = line.split(' ').collect();
    let (mine, child_pid, childs) = (parts[0], parts[1].parse::<i32>().unwrap(), parts[2]);
    assert!(shm_exists(childs));
    // SAFETY: killing the grandchild the peer forked.
    assert_eq!(unsafe { libc::kill(child_pid, libc::SIGKILL) }, 0);
    peer.send("reap");
    // Its parent is alive and connected: only the child's own connection
    // closing can tell the manager to remove it.
    assert!(wait_until(CLEANUP, || !shm_exists(childs)), "the killed child's segment {childs} is left");
    assert_eq!(peer.recv(), "alive true", "the parent's segment {mine} went");
    peer.kill9();
    assert!(wait_until(CLEANUP, || !shm_exists(mine)), "segment {mine} left");
}
