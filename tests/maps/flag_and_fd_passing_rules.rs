//! Regression tests of the map and fd-passing rules, through the C API as
//! a C user calls it: contradictory flags never delete a user's file, a
//! failed create removes only what it made, an unreadable source is an
//! invalid argument, and a cut datagram is reported.

#[path = "../common/mod.rs"]
mod common;

use common::shm_exists;
use std::ffi::{c_void, CStr, CString};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use storage_sharing::ffi::errors::ss_last_error_message;
use storage_sharing::ffi::fd_passing::{ss_fds_recv, ss_fds_send};
use storage_sharing::ffi::map::*;
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ffi::storage_utils::ss_map_new_copy;
use storage_sharing::shm::flags::{EXCLUSIVE, FROMFD, KEEPFD, SHARED, SHAREDMEM, UNLINK};
use storage_sharing::shm::{new_process_wide_shm_handle, MapAllocator, RefcountedMapAllocator};
use storage_sharing::ErrorKind;

fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated thread-local text.
    unsafe { CStr::from_ptr(ss_last_error_message()) }.to_string_lossy().into_owned()
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ss-defects-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

#[test]
fn shared_with_sharedmem_is_refused_and_never_deletes_the_file() {
    let dir = scratch("flags");
    let file = dir.join("precious");
    std::fs::write(&file, b"user data").unwrap();
    let path = c(file.to_str().unwrap());
    let mut m: *mut SsMap = std::ptr::null_mut();
    for open in [ss_map_open as unsafe extern "C" fn(_, _, _, _) -> _, ss_map_open_refcounted] {
        // SAFETY: valid name and out-pointer.
        let st = unsafe { open(path.as_ptr(), SS_MAPPED_SHARED | SS_MAPPED_SHAREDMEM, 4, &mut m) };
        assert_eq!(st, ss_status::SS_ERR_INVALID_ARGUMENT, "{}", last_error());
        assert!(last_error().contains("SHARED") && last_error().contains("SHAREDMEM"), "{}", last_error());
        assert!(m.is_null());
        assert_eq!(std::fs::read(&file).unwrap(), b"user data");
    }
    let p = file.to_str().unwrap();
    assert_eq!(MapAllocator::open(p, SHARED | SHAREDMEM, 4).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(RefcountedMapAllocator::open(p, SHARED | SHAREDMEM, 4).unwrap_err().kind(), ErrorKind::InvalidArgument);

    // UNLINK may remove a regular file only if this very open created it.
    for flags in [SHARED | UNLINK, UNLINK, SHARED | KEEPFD | UNLINK] {
        let e = MapAllocator::open(p, flags, 4).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "flags {flags}: {e}");
        assert!(e.message().contains("did not create"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"user data", "flags {flags}");
    }
    let fd = std::fs::File::options().read(true).write(true).open(&file).unwrap();
    let e = MapAllocator::open_fd(p, fd.as_raw_fd(), SHARED | FROMFD | UNLINK, 4).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(file.exists());
    // A file this open made is removed as asked.
    let fresh = dir.join("fresh");
    let m = MapAllocator::open(fresh.to_str().unwrap(), SHARED | EXCLUSIVE | UNLINK, 4096).unwrap();
    assert!(!fresh.exists());
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// More bytes than the tmpfs behind /dev/shm can ever hold.
fn more_than_dev_shm_holds() -> usize {
    // SAFETY: statvfs fills plain data for a constant path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c"/dev/shm".as_ptr(), &mut st) }, 0);
    let total = st.f_blocks as usize * st.f_frsize as usize;
    (total.max(1 << 30) * 2).max(1 << 40)
}

#[test]
fn failed_create_without_exclusive_removes_only_what_it_made() {
    let size = more_than_dev_shm_holds();
    for flags in [SS_MAPPED_SHAREDMEM, SS_MAPPED_SHAREDMEM | SS_MAPPED_KEEPFD | SS_MAPPED_UNLINK] {
        let name = new_process_wide_shm_handle();
        let cname = c(&name);
        let mut m: *mut SsMap = std::ptr::null_mut();
        // SAFETY: valid name and out-pointer.
        let st = unsafe { ss_map_open(cname.as_ptr(), flags, size, &mut m) };
        assert_eq!(st, ss_status::SS_ERR_NO_SPACE, "{}", last_error());
        assert!(!shm_exists(&name), "flags {flags}: the failed create left {name} behind");
    }
    let name = new_process_wide_shm_handle();
    let e = RefcountedMapAllocator::open(&name, SHAREDMEM, size).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(!shm_exists(&name));

    // An object someone else made stays, at its old size.
    let name = new_process_wide_shm_handle();
    let theirs = MapAllocator::open(&name, SHAREDMEM | EXCLUSIVE | KEEPFD, 4096).unwrap();
    let e = MapAllocator::open(&name, SHAREDMEM, size).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(shm_exists(&name));
    assert_eq!(std::fs::metadata(format!("/dev/shm{name}")).unwrap().len(), 4096);
    drop(theirs);
    assert!(!shm_exists(&name));
}

#[test]
fn unreadable_source_is_an_invalid_argument() {
    let len = 1 << 20;
    // SAFETY: a fresh private mapping with no access rights.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    let mut m: *mut SsMap = std::ptr::null_mut();
    // SAFETY: the source is mapped (but unreadable); the out-pointer is valid.
    let st = unsafe { ss_map_new_copy(p as *const c_void, len, &mut m) };
    assert_eq!(st, ss_status::SS_ERR_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("source buffer is not readable"), "{}", last_error());
    assert!(m.is_null());
    // SAFETY: our mapping.
    unsafe { libc::munmap(p, len) };
}

/// Descriptors of this process open on `target`. Counted by target, not
/// in total: the other tests of this binary run on other threads and open
/// descriptors of their own meanwhile.
fn fds_open_on(target: &std::path::Path) -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).filter(|t| t == target).count()
}

#[test]
fn a_cut_datagram_is_reported_and_its_descriptors_closed() {
    let mut pair = [0; 2];
    // SAFETY: socketpair fills two descriptors.
    assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0, pair.as_mut_ptr()) }, 0);
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let payload = [7u8; 100];
    let sent = [file.as_raw_fd()];
    // SAFETY: valid buffers for the stated lengths.
    assert_eq!(unsafe { ss_fds_send(pair[0], payload.as_ptr().cast(), 100, sent.as_ptr(), 1) }, ss_status::SS_OK);
    let target = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
    let before = fds_open_on(&target);
    let (mut buf, mut got, mut n, mut nfds) = ([0u8; 10], [-1; 4], 0usize, 0usize);
    // SAFETY: valid buffers for the stated lengths.
    let st = unsafe { ss_fds_recv(pair[1], buf.as_mut_ptr().cast(), buf.len(), &mut n, got.as_mut_ptr(), 4, &mut nfds) };
    assert_eq!(st, ss_status::SS_ERR_BUFFER_TOO_SMALL, "{}", last_error());
    assert!(last_error().contains("longer than the 10-byte buffer"), "{}", last_error());
    assert_eq!(fds_open_on(&target), before, "the received descriptor was left open");
    // A datagram that fits still arrives whole.
    // SAFETY: as above.
    assert_eq!(unsafe { ss_fds_send(pair[0], payload.as_ptr().cast(), 10, sent.as_ptr(), 1) }, ss_status::SS_OK);
    let st = unsafe { ss_fds_recv(pair[1], buf.as_mut_ptr().cast(), buf.len(), &mut n, got.as_mut_ptr(), 4, &mut nfds) };
    assert_eq!((st, n, nfds), (ss_status::SS_OK, 10, 1));
    // SAFETY: descriptors we own.
    unsafe {
        libc::close(got[0]);
        libc::close(pair[0]);
        libc::close(pair[1]);
    }
}
