//! A full /dev/shm gives a clear `NoSpace` at creation, never a SIGBUS at
//! the first write (PyTorch's defect). The child runs in a private mount
//! namespace with a 1 MiB tmpfs over /dev/shm and asks for 4 MiB.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use std::process::Command;
use storage_sharing::shm::flags::{EXCLUSIVE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, share_memory, MapAllocator, RefcountedMapAllocator};
use storage_sharing::ErrorKind;

const ASK: usize = 4 << 20;

#[test]
#[ignore = "entry point of the child process, run inside a private mount namespace"]
fn child_role() {
    let Some((role, _)) = my_role() else { return };
    assert_eq!(role, "small-tmpfs");
    let e = MapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, ASK).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    println!("map: {e}");
    let e = RefcountedMapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, ASK).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let e = RefcountedMapAllocator::create_with(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, &vec![7u8; ASK]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let e = share_memory(&vec![7u8; ASK]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    println!("share_memory: {e}");
    // Every storage and CUDA-IPC function that creates a segment.
    use_built_manager();
    let e = storage_sharing::storage::Storage::new_using_fd(ASK).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "new_using_fd: {e}");
    let e = storage_sharing::storage::Storage::from_bytes(&vec![7u8; ASK]).unwrap().share_fd().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "share_fd: {e}");
    let e = storage_sharing::storage::Storage::new_using_filename(ASK).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "new_using_filename: {e}");
    let e = storage_sharing::storage::Storage::from_bytes(&vec![7u8; ASK]).unwrap().share_filename().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "share_filename: {e}");
    // Counter files are 80 KiB: fill the tmpfs first, then ask for one.
    let filler = MapAllocator::open(
        &new_process_wide_shm_handle(),
        SHAREDMEM | EXCLUSIVE | storage_sharing::shm::flags::UNLINK,
        (1 << 20) - (32 << 10),
    )
    .unwrap();
    let e = storage_sharing::cuda::counters::CounterFile::create().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "CounterFile::create: {e}");
    // Small segments (reserved by populating the mapping, not by
    // posix_fallocate): one larger than the 32 KiB left, then one page
    // once nothing is left.
    let e = MapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 48 << 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "48 KiB segment: {e}");
    assert!(e.to_string().contains("no space"), "{e}");
    println!("small map: {e}");
    let rest =
        MapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE | storage_sharing::shm::flags::UNLINK, 32 << 10).unwrap();
    let e = RefcountedMapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "4 KiB refcounted segment: {e}");
    let e = storage_sharing::storage::Storage::new_using_filename(4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "4 KiB new_using_filename: {e}");
    drop(rest);
    drop(filler);
    // Nothing is left behind, and what fits still works.
    let left: Vec<_> = std::fs::read_dir("/dev/shm").unwrap().collect();
    assert!(left.is_empty(), "segments left after failed creates: {left:?}");
    let small = share_memory(&vec![7u8; 256 << 10]).unwrap();
    assert_eq!(small.len(), 256 << 10);
}

#[test]
fn full_dev_shm_is_no_space_not_sigbus() {
    let probe = Command::new("unshare").args(["-m", "--propagation", "private", "true"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        println!("full_dev_shm_is_no_space_not_sigbus: skipped: mount namespaces are not allowed here (unshare -m failed)");
        return;
    }
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$0\" --ignored --exact child_role --nocapture")
        .arg(me)
        .env(ROLE_VAR, "small-tmpfs");
    let out = run_ok(cmd);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("no space"), "{text}");
}
