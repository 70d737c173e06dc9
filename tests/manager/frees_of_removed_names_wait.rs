//! The free of a segment this process removed (it closed the last
//! reference) waits for the next message to that manager and goes in the
//! same write; the free of a segment that still exists goes at once. The
//! manager is a socket served by a thread of this test that records every
//! message in the order it arrives and answers registrations with OK (so,
//! like libshm's manager, it declines the registration log).

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;
use storage_sharing::manager::protocol::{AllocInfo, ALLOC_INFO_SIZE};
use storage_sharing::manager::reglog::ATTACH_NAME;
use storage_sharing::manager::{client_for, ManagedMapAllocator};
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use storage_sharing::shm::new_process_wide_shm_handle;

/// A recording manager at a fresh socket: each message as ("R"|"F", name).
fn recording_manager(tag: &str) -> (String, PathBuf, Receiver<(String, String)>) {
    let dir = std::env::temp_dir().join(format!("ss-mgr-defer-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("m.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else { return };
        let mut rec = [0u8; ALLOC_INFO_SIZE];
        while conn.read_exact(&mut rec).is_ok() {
            let msg = AllocInfo::decode(&rec).unwrap();
            if !msg.free && conn.write_all(b"OK").is_err() {
                return;
            }
            // The registration log's offer (answered `OK` as libshm does).
            if msg.filename == ATTACH_NAME {
                continue;
            }
            let kind = if msg.free { "F" } else { "R" };
            if tx.send((kind.to_string(), msg.filename)).is_err() {
                return;
            }
        }
    });
    (sock.to_str().unwrap().to_string(), dir, rx)
}

fn next(rx: &Receiver<(String, String)>) -> (String, String) {
    rx.recv_timeout(Duration::from_secs(10)).expect("the manager got no message")
}

fn is(msg: (String, String), kind: &str, name: &str) {
    assert_eq!(msg, (kind.to_string(), name.to_string()));
}

#[test]
fn free_of_a_removed_name_goes_with_the_next_message() {
    let (sock, dir, rx) = recording_manager("next");
    let a = new_process_wide_shm_handle();
    let m = ManagedMapAllocator::open(&sock, &a, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    is(next(&rx), "R", &a);
    drop(m);
    assert!(!std::path::Path::new(&format!("/dev/shm{a}")).exists());
    // Not sent yet: nothing more arrives on its own.
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "the free of a removed name was sent at once");
    let b = new_process_wide_shm_handle();
    let m = ManagedMapAllocator::open(&sock, &b, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    is(next(&rx), "F", &a);
    is(next(&rx), "R", &b);
    drop(m);
    // sync sends what waits.
    client_for(&sock).unwrap().sync().unwrap();
    is(next(&rx), "F", &b);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn free_of_a_name_still_held_goes_at_once() {
    let (sock, dir, rx) = recording_manager("held");
    let a = new_process_wide_shm_handle();
    let creator = ManagedMapAllocator::open(&sock, &a, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    let opener = ManagedMapAllocator::open(&sock, &a, SHAREDMEM | NOCREATE, 4096).unwrap();
    is(next(&rx), "R", &a);
    is(next(&rx), "R", &a);
    // The creator's reference keeps the name: the manager must learn of
    // this free now, as it counts references from frees.
    drop(opener);
    is(next(&rx), "F", &a);
    assert!(std::path::Path::new(&format!("/dev/shm{a}")).exists());
    drop(creator);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn deferred_frees_are_sent_once_enough_wait() {
    use storage_sharing::manager::client::MAX_DEFERRED_FREES;
    let (sock, dir, rx) = recording_manager("many");
    let names: Vec<String> = (0..=MAX_DEFERRED_FREES).map(|_| new_process_wide_shm_handle()).collect();
    let maps: Vec<ManagedMapAllocator> =
        names.iter().map(|n| ManagedMapAllocator::open(&sock, n, SHAREDMEM | EXCLUSIVE, 4096).unwrap()).collect();
    for n in &names {
        is(next(&rx), "R", n);
    }
    // Every close removes its name; MAX_DEFERRED_FREES frees wait, and
    // the one past the bound sends them all.
    let mut maps = maps.into_iter();
    for m in maps.by_ref().take(MAX_DEFERRED_FREES) {
        drop(m);
    }
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "frees were sent before the bound");
    drop(maps);
    let frees: Vec<String> = names
        .iter()
        .map(|_| next(&rx))
        .map(|(kind, name)| {
            assert_eq!(kind, "F");
            name
        })
        .collect();
    assert_eq!(frees, names);
    let _ = std::fs::remove_dir_all(dir);
}
