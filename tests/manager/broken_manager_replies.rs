//! A manager that answers garbage, or hangs up, noticed
//! while a segment is freed (a call with no one to tell), is reported by
//! the next call on that manager instead of being dropped. The fake
//! manager is a socket served by a thread of this test.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::Duration;
use storage_sharing::manager::protocol::ALLOC_INFO_SIZE;
use storage_sharing::manager::ManagedMapAllocator;
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};
use storage_sharing::ErrorKind;

/// A fake manager at a fresh socket: answers the registration log's offer
/// with `OK`, reads one registration per connection, then answers `reply` (nothing if empty) and, with
/// `hang_up`, closes the connection.
fn fake_manager(tag: &str, reply: &'static [u8], hang_up: bool) -> (String, PathBuf) {
    let dir = std::env::temp_dir().join(format!("ss-mgr-err-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("m.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut msg = [0u8; ALLOC_INFO_SIZE];
                // The registration log's offer, declined as libshm does.
                if conn.read_exact(&mut msg).is_err() || conn.write_all(b"OK").is_err() {
                    return;
                }
                if conn.read_exact(&mut msg).is_err() {
                    return;
                }
                let _ = conn.write_all(reply);
                if !hang_up {
                    let _ = std::io::copy(&mut conn, &mut std::io::sink());
                }
            });
        }
    });
    (sock.to_str().unwrap().to_string(), dir)
}

fn break_inside_free_is_reported_next(tag: &str, reply: &'static [u8], hang_up: bool, kind: ErrorKind) {
    let (sock, dir) = fake_manager(tag, reply, hang_up);
    let name = new_process_wide_shm_handle();
    // Another holder keeps the name, so the free is sent at once (that of
    // a name the close removed waits for the next message).
    let keeper = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    let m = ManagedMapAllocator::open(&sock, &name, SHAREDMEM | NOCREATE, 4096).unwrap();
    // Let the manager's answer (or hang-up) arrive before the free.
    std::thread::sleep(Duration::from_millis(200));
    drop(m);
    let e = ManagedMapAllocator::open(&sock, &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap_err();
    assert_eq!(e.kind(), kind, "{tag}: {e}");
    assert!(e.message().contains("broke while a segment was being freed"), "{tag}: {e}");
    // Reported once: the next call reconnects.
    let again = ManagedMapAllocator::open(&sock, &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    drop(again);
    drop(keeper);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn garbage_answer_found_in_a_free_is_reported_by_the_next_open() {
    break_inside_free_is_reported_next("garbage", b"NO", false, ErrorKind::Protocol);
}

#[test]
fn hang_up_found_in_a_free_is_reported_by_the_next_open() {
    break_inside_free_is_reported_next("hangup", b"", true, ErrorKind::PeerGone);
}
