//! A process killed with SIGKILL while it creates an
//! fd-backed segment (share_memory, new_shm_fd_storage, storage share_fd,
//! storage new_using_fd) leaves nothing in /dev/shm. A child makes 64 MiB
//! segments in a loop through the C API; the parent kills it at varied
//! moments, many times, and counts the names the child left behind.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::Duration;
use storage_sharing::ffi::map::{ss_map_free, SsMap};
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ffi::storage::*;
use storage_sharing::ffi::storage_utils::{ss_map_new_copy, ss_map_new_shm_fd};

const SIZE: usize = 64 << 20;
const KILLS: usize = 40;

#[test]
#[ignore = "entry point of the child process, run by the test below"]
fn child_role() {
    let Some((role, _)) = my_role() else { return };
    assert_eq!(role, "share-loop");
    let src = pattern(SIZE, 3);
    println!("ready");
    std::io::stdout().flush().unwrap();
    loop {
        // SAFETY: valid buffers and out-pointers; every handle is freed.
        unsafe {
            let mut m: *mut SsMap = std::ptr::null_mut();
            assert_eq!(ss_map_new_copy(src.as_ptr() as *const c_void, SIZE, &mut m), ss_status::SS_OK);
            ss_map_free(m);
            assert_eq!(ss_map_new_shm_fd(SIZE, &mut m), ss_status::SS_OK);
            ss_map_free(m);
            let mut s: *mut SsStorage = std::ptr::null_mut();
            assert_eq!(ss_storage_new(SIZE, &mut s), ss_status::SS_OK);
            let (mut fd, mut n) = (-1, 0usize);
            assert_eq!(ss_storage_share_fd(s, &mut fd, &mut n), ss_status::SS_OK);
            ss_storage_free(s);
            assert_eq!(ss_storage_new_using_fd(SIZE, &mut s), ss_status::SS_OK);
            ss_storage_free(s);
        }
    }
}

fn left_by(pid: u32) -> Vec<String> {
    let prefix = format!("torch_{pid}_");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn kill9_while_creating_fd_segments_leaks_nothing() {
    let mut leaked = Vec::new();
    for i in 0..KILLS {
        let mut child = child_command("share-loop", &[]).stdout(Stdio::piped()).spawn().unwrap();
        // The test harness prints its own lines first; the pipe stays open
        // until the kill so the child never writes into a closed pipe.
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.trim_end().ends_with("ready") {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the child exited before it was ready");
        }
        // Spread the kills over one round of the loop (a few 64 MiB copies).
        std::thread::sleep(Duration::from_micros((i as u64 * 7919) % 60_000));
        child.kill().unwrap();
        child.wait().unwrap();
        let left = left_by(child.id());
        for name in &left {
            let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
        }
        leaked.extend(left);
    }
    assert!(leaked.is_empty(), "{} of {KILLS} kills left segments: {leaked:?}", leaked.len());
}
