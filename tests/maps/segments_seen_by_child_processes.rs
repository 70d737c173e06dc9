//! Segments shared with real child processes: data and reference counts as
//! seen from both sides.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use std::os::fd::RawFd;
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, OPEN_SHARED_FD, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, share_memory, MapAllocator, RefcountedMapAllocator};

const LEN: usize = 3 * 4096 + 100;

#[test]
#[ignore = "entry point of the child processes, run by the other tests"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    match role.as_str() {
        "plain" => {
            let m = MapAllocator::open(&args[0], SHAREDMEM | NOCREATE, LEN).unwrap();
            // SAFETY: LEN bytes mapped.
            let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
            assert_eq!(bytes, &pattern(LEN, 1)[..]);
            bytes.copy_from_slice(&pattern(LEN, 2));
            // Plain SHAREDMEM close would remove the name (ATen); the parent
            // still needs it, so leave without closing.
            std::mem::forget(m);
        }
        "refcounted" => {
            let m = RefcountedMapAllocator::open(&args[0], SHAREDMEM | NOCREATE, LEN).unwrap();
            assert_eq!(m.refcount().unwrap(), 2);
            // SAFETY: LEN bytes of data mapped.
            let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
            assert_eq!(bytes, &pattern(LEN, 3)[..]);
            bytes.copy_from_slice(&pattern(LEN, 4));
            m.incref().unwrap();
            assert_eq!(m.refcount().unwrap(), 3);
        }
        "hammer" => {
            let m = RefcountedMapAllocator::open(&args[0], SHAREDMEM | NOCREATE, LEN).unwrap();
            for _ in 0..20_000 {
                m.incref().unwrap();
                m.decref().unwrap();
            }
        }
        "fd" => {
            let fd: RawFd = args[0].parse().unwrap();
            let m = MapAllocator::open_fd("", fd, OPEN_SHARED_FD, LEN).unwrap();
            // SAFETY: LEN bytes mapped.
            let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
            assert_eq!(bytes, &pattern(LEN, 5)[..]);
            bytes[..4].copy_from_slice(b"seen");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn plain_segment_bytes_both_ways() {
    let name = new_process_wide_shm_handle();
    let mut m = MapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, LEN).unwrap();
    // SAFETY: LEN bytes mapped.
    let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
    bytes.copy_from_slice(&pattern(LEN, 1));
    run_ok(child_command("plain", &[&name]));
    assert_eq!(bytes, &pattern(LEN, 2)[..]);
    m.close().unwrap();
    assert!(!shm_exists(&name));
}

#[test]
fn refcount_seen_and_changed_by_a_child() {
    let name = new_process_wide_shm_handle();
    let mut m = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, LEN).unwrap();
    // SAFETY: LEN bytes of data mapped.
    let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
    bytes.copy_from_slice(&pattern(LEN, 3));
    run_ok(child_command("refcounted", &[&name]));
    assert_eq!(bytes, &pattern(LEN, 4)[..]);
    // The child's open went away with its close; its incref stays.
    assert_eq!(m.refcount().unwrap(), 2);
    assert!(!m.decref().unwrap());
    m.close().unwrap();
    assert!(!shm_exists(&name), "the last close removes the name");
}

#[test]
fn concurrent_increfs_from_many_processes_add_up() {
    let name = new_process_wide_shm_handle();
    let mut m = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, LEN).unwrap();
    let children: Vec<_> = (0..4).map(|_| child_command("hammer", &[&name]).stdout(std::process::Stdio::null()).spawn().unwrap()).collect();
    for _ in 0..20_000 {
        m.incref().unwrap();
        m.decref().unwrap();
    }
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(m.refcount().unwrap(), 1);
    m.close().unwrap();
    assert!(!shm_exists(&name));
}

#[test]
fn fd_storage_shared_with_a_child() {
    let src = pattern(LEN, 5);
    let m = share_memory(&src).unwrap();
    // SAFETY: dup of our kept fd; the copy is inheritable (no CLOEXEC).
    let fd = unsafe { libc::dup(m.fd()) };
    assert!(fd >= 0);
    run_ok(child_command("fd", &[&fd.to_string()]));
    // SAFETY: our duplicate, no longer needed.
    unsafe { libc::close(fd) };
    // SAFETY: LEN bytes mapped.
    assert_eq!(unsafe { std::slice::from_raw_parts(m.data(), 4) }, b"seen");
}
