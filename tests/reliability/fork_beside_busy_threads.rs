//! A child forked while other threads of the parent are
//! inside the library (opening and closing maps, sharing by name through
//! the manager) can use the library and exit; it never hangs on a lock a
//! vanished thread held. The main thread forks many times; each child
//! opens and closes a map and shares a storage by name, then exits, and
//! must do so within a time-out. The busy threads and the children also
//! allocate symmetric-memory blocks and arena blocks, whose process-wide
//! tables are fork-safe locks too.

#[path = "../common/mod.rs"]
mod common;

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::ffi::arena::*;
use storage_sharing::ffi::map::*;
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ffi::storage::*;
use storage_sharing::ffi::symm::*;
use storage_sharing::shm::new_process_wide_shm_handle;

const FORKS: usize = 200;
const CHILD_LIMIT: Duration = Duration::from_secs(10);

/// One round of what the busy threads and the children do; false on an
/// error status.
fn use_the_library() -> bool {
    let name = CString::new(new_process_wide_shm_handle()).unwrap();
    // SAFETY: valid arguments; every handle is freed.
    unsafe {
        let mut m: *mut SsMap = std::ptr::null_mut();
        if ss_map_open(name.as_ptr(), SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 4096, &mut m) != ss_status::SS_OK {
            return false;
        }
        let found = ss_map_lookup(ss_map_data(m));
        ss_map_free(m);
        if found.is_null() {
            return false;
        }
        let mut s: *mut SsStorage = std::ptr::null_mut();
        if ss_storage_new_using_filename(4096, &mut s) != ss_status::SS_OK {
            return false;
        }
        ss_storage_free(s);

        let mut p: *mut libc::c_void = std::ptr::null_mut();
        if ss_symm_alloc(SS_DEVICE_CPU, 0, 4096, std::ptr::null(), &mut p) != ss_status::SS_OK {
            return false;
        }
        if ss_symm_free(p) != ss_status::SS_OK {
            return false;
        }

        // A small arena: the default reserves 64 MiB per segment.
        let mut options = std::mem::zeroed::<ss_arena_options>();
        if ss_arena_options_default(&mut options) != ss_status::SS_OK {
            return false;
        }
        options.segment_size = 256 * 1024;
        options.max_holds = 16;
        options.large_threshold = 64 * 1024;
        let mut a: *mut SsArena = std::ptr::null_mut();
        if ss_arena_open(&options, &mut a) != ss_status::SS_OK {
            return false;
        }
        let mut block: *mut libc::c_void = std::ptr::null_mut();
        let mut handle = std::mem::zeroed::<ss_arena_handle>();
        let ok = ss_arena_alloc(a, 4096, 64, &mut block) == ss_status::SS_OK
            && ss_arena_share(a, block, &mut handle) == ss_status::SS_OK
            && ss_arena_unshare(a, &handle) == ss_status::SS_OK
            && ss_arena_dealloc(a, block) == ss_status::SS_OK;
        ss_arena_close(a);
        if !ok {
            return false;
        }
    }
    true
}

/// Waits for `pid` up to `limit`; kills it if it is still running then.
/// Some(exit status) if it ended by itself.
fn wait_or_kill(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let end = Instant::now() + limit;
    let mut status = 0;
    loop {
        // SAFETY: our own child; status is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(status);
        }
        if Instant::now() > end {
            // SAFETY: our own child, still unreaped.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn children_forked_beside_busy_threads_use_the_library_and_exit() {
    common::use_built_manager();
    assert!(use_the_library(), "the library works before any fork");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicUsize::new(0));
    let busy: Vec<_> = (0..4)
        .map(|_| {
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    assert!(use_the_library());
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let (mut hung, mut failed) = (0, 0);
    for _ in 0..FORKS {
        // SAFETY: the child only calls the library and then _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = use_the_library();
            // SAFETY: leaves the child at once, without running the
            // parent's exit handlers or the test harness.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        match wait_or_kill(pid, CHILD_LIMIT) {
            None => hung += 1,
            Some(status) if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) => failed += 1,
            Some(_) => {}
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
    println!("{FORKS} forks beside {} rounds of busy threads: {hung} hung, {failed} failed", rounds.load(Ordering::Relaxed));
    assert_eq!((hung, failed), (0, 0), "of {FORKS} children, {hung} hung and {failed} failed");
}
