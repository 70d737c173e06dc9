//! One TCPStore handle shared by many threads, processes and a forked
//! child: every caller gets the reply to its own request, and the handle's
//! requests take effect in the order they were made. Each thread sets its
//! own key then reads it back (it must see what it just wrote), a writer
//! process sets data before flag and a reader must never see the flag
//! ahead of the data, and a child forked while the parent's threads use
//! the handle uses it too. All through the C API, as a C program would.

#[path = "../common/mod.rs"]
mod common;

use common::{child_command, my_role};
use std::ffi::CString;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::ffi::errors::ss_last_error_message;
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ffi::store::*;

/// Hang guard for every wait (never reached when things work).
const TIMEOUT_MS: i64 = 30_000;

/// A store handle shared by threads, as a C program shares a
/// `const ss_store *`.
struct Handle(*mut SsStore);
// SAFETY: the C API says a `const ss_store *` may be used from several
// threads at once; that is what these tests check.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: a handle from ss_store_tcp_open, freed once.
        unsafe { ss_store_free(self.0) };
    }
}

fn last_error() -> String {
    // SAFETY: the library's thread-local message, a valid C string.
    unsafe { std::ffi::CStr::from_ptr(ss_last_error_message()) }.to_string_lossy().into_owned()
}

fn check_ok(status: ss_status, what: &str) -> Result<(), String> {
    if status == ss_status::SS_OK {
        Ok(())
    } else {
        Err(format!("{what}: {status:?}: {}", last_error()))
    }
}

impl Handle {
    fn open(port: u16, is_master: bool) -> Handle {
        let host = CString::new("127.0.0.1").unwrap();
        let mut s = std::ptr::null_mut();
        // SAFETY: valid arguments.
        let st = unsafe { ss_store_tcp_open(host.as_ptr(), c_int::from(port), is_master, 0, TIMEOUT_MS, &mut s) };
        check_ok(st, "ss_store_tcp_open").unwrap();
        Handle(s)
    }

    fn port(&self) -> u16 {
        let mut port = 0;
        // SAFETY: a live handle and an out-pointer.
        check_ok(unsafe { ss_store_tcp_port(self.0, &mut port) }, "ss_store_tcp_port").unwrap();
        port as u16
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let k = CString::new(key).unwrap();
        // SAFETY: a live handle, a C string and readable bytes.
        check_ok(unsafe { ss_store_set(self.0, k.as_ptr(), value.as_ptr().cast(), value.len()) }, key)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, String> {
        let k = CString::new(key).unwrap();
        let mut buf = vec![0u8; 64];
        let mut len = 0usize;
        // SAFETY: a live handle, a C string, a writable buffer.
        let st = unsafe { ss_store_get(self.0, k.as_ptr(), TIMEOUT_MS, buf.as_mut_ptr().cast(), buf.len(), &mut len) };
        check_ok(st, key)?;
        buf.truncate(len);
        Ok(buf)
    }

    fn get_int(&self, key: &str) -> Result<i64, String> {
        let v = self.get(key)?;
        String::from_utf8_lossy(&v).parse().map_err(|_| format!("{key} holds {v:?}, not a number"))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, String> {
        let k = CString::new(key).unwrap();
        let mut v = 0;
        // SAFETY: a live handle, a C string, an out-pointer.
        check_ok(unsafe { ss_store_add(self.0, k.as_ptr(), delta, &mut v) }, key)?;
        Ok(v)
    }

    fn check(&self, key: &str) -> Result<bool, String> {
        let k = CString::new(key).unwrap();
        let ptrs = [k.as_ptr()];
        let mut all = false;
        // SAFETY: a live handle, one C string, an out-pointer.
        check_ok(unsafe { ss_store_check(self.0, ptrs.as_ptr(), 1, &mut all) }, key)?;
        Ok(all)
    }
}

/// What one thread does on its own keys `<tag>/...`: `rounds` times, set a
/// key then read it back, check that a new key it just set is set, and add
/// 1 to its counter; every answer must be the one its own request asked
/// for. Stops at the first wrong answer.
fn own_keys_round_trip(s: &Handle, tag: &str, rounds: usize) -> Result<(), String> {
    let key = format!("{tag}/v");
    let counter = format!("{tag}/n");
    for n in 0..rounds {
        let want = n.to_string();
        s.set(&key, want.as_bytes())?;
        let got = s.get(&key)?;
        if got != want.as_bytes() {
            return Err(format!("{key}: set {want}, then get returned {:?}", String::from_utf8_lossy(&got)));
        }
        let fresh = format!("{tag}/set/{n}");
        s.set(&fresh, b"x")?;
        if !s.check(&fresh)? {
            return Err(format!("{fresh}: set, then check said it is not set"));
        }
        let count = s.add(&counter, 1)?;
        if count != n as i64 + 1 {
            return Err(format!("{counter}: add number {} returned {count}", n + 1));
        }
    }
    Ok(())
}

/// Runs `own_keys_round_trip` in `threads` threads on one handle.
fn hammer(s: &Arc<Handle>, tag: &str, threads: usize, rounds: usize) -> Result<(), String> {
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let s = s.clone();
            let tag = format!("{tag}/{t}");
            std::thread::spawn(move || own_keys_round_trip(&s, &tag, rounds))
        })
        .collect();
    let mut first = Ok(());
    for w in workers {
        let r = w.join().unwrap_or_else(|_| Err("a thread panicked".to_string()));
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// In a forked child: runs `work`, then leaves with `_exit` (0 when it
/// worked), never unwinding into the copy of the test harness.
fn child_exit(work: impl FnOnce() -> Result<(), String>) -> ! {
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_ok_and(|r| r.is_ok());
    // SAFETY: leaves the child without running the parent's exit code.
    unsafe { libc::_exit(if ok { 0 } else { 1 }) }
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else {
        return;
    };
    let port: u16 = args[0].parse().unwrap();
    let s = Arc::new(Handle::open(port, false));
    match role.as_str() {
        "load" => {
            let (threads, rounds) = (args[2].parse().unwrap(), args[3].parse().unwrap());
            hammer(&s, &format!("load/{}", args[1]), threads, rounds).unwrap();
            println!("LOAD_OK");
        }
        "writer" => {
            let (threads, rounds): (usize, i64) = (args[1].parse().unwrap(), args[2].parse().unwrap());
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let s = s.clone();
                    std::thread::spawn(move || {
                        for i in 1..=rounds {
                            s.set(&format!("data/{t}"), i.to_string().as_bytes()).unwrap();
                            s.set(&format!("flag/{t}"), i.to_string().as_bytes()).unwrap();
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join().unwrap();
            }
            println!("WRITER_OK");
        }
        other => panic!("unknown role {other}"),
    }
}

/// Four threads on one client handle, each setting its own key and
/// reading it back: every get returns the value set just before it.
#[test]
fn threads_sharing_one_handle_read_their_own_writes() {
    let server = Handle::open(0, true);
    let client = Arc::new(Handle::open(server.port(), false));
    hammer(&client, "threads", 4, 1000).unwrap();
    // The master's own handle (client and server in one) does the same.
    let server = Arc::new(server);
    hammer(&server, "master", 4, 300).unwrap();
}

/// Several client processes, each with several threads on one handle,
/// against our server: every thread reads its own writes.
#[test]
fn client_processes_with_threads_under_load_read_their_own_writes() {
    let server = Handle::open(0, true);
    let port = server.port().to_string();
    let kids: Vec<_> = (0..6)
        .map(|p| {
            let mut cmd = child_command("load", &[&port, &p.to_string(), "4", "300"]);
            cmd.stdout(std::process::Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for k in kids {
        let out = k.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains("LOAD_OK"), "a load process failed: {}\n{text}", out.status);
    }
    for p in 0..6 {
        for t in 0..4 {
            assert_eq!(server.get_int(&format!("load/{p}/{t}/n")).unwrap(), 300);
        }
    }
}

/// A writer process whose threads each set data then flag, in that order,
/// through one handle; a reader in another process that sees flag = i
/// must see data >= i.
#[test]
fn data_set_before_flag_is_never_seen_after_it_by_another_process() {
    for _ in 0..3 {
        flag_after_data_once();
    }
}

fn flag_after_data_once() {
    let server = Handle::open(0, true);
    let port = server.port().to_string();
    let (threads, rounds) = (4usize, 5000i64);
    let mut cmd = child_command("writer", &[&port, &threads.to_string(), &rounds.to_string()]);
    cmd.stdout(std::process::Stdio::piped());
    let writer = cmd.spawn().unwrap();
    let reader = Arc::new(Handle::open(server.port(), false));
    let readers: Vec<_> = (0..threads)
        .map(|t| {
            let r = reader.clone();
            std::thread::spawn(move || -> Result<usize, String> {
                let (flag, data) = (format!("flag/{t}"), format!("data/{t}"));
                let mut reads = 0;
                loop {
                    let f = r.get_int(&flag)?;
                    let d = r.get_int(&data)?;
                    reads += 1;
                    if d < f {
                        return Err(format!("{flag} = {f} but {data} = {d}: the writer set {data} = {f} first"));
                    }
                    if f == rounds {
                        return Ok(reads);
                    }
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap().unwrap();
    }
    let out = writer.wait_with_output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("WRITER_OK"));
}

/// Waits for `pid` up to `limit`; kills it with -9 after that. Its exit
/// status, or None when it had to be killed.
fn reap(pid: libc::pid_t, limit: Duration) -> Option<c_int> {
    let end = Instant::now() + limit;
    loop {
        let mut status = 0;
        // SAFETY: our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) });
        }
        if Instant::now() > end {
            // SAFETY: our own child, not yet reaped.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A child forked while four parent threads hammer the handle uses the
/// same handle from two threads of its own; parent and child each get
/// their own replies. Several rounds, so forks land mid-request.
#[test]
fn a_child_forked_while_threads_use_the_handle_gets_its_own_replies() {
    let server = Handle::open(0, true);
    let shared = Arc::new(Handle::open(server.port(), false));
    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..4)
        .map(|t| {
            let (s, stop) = (shared.clone(), stop.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut round = 0;
                while !stop.load(Ordering::Relaxed) {
                    own_keys_round_trip(&s, &format!("parent/{t}/{round}"), 20)?;
                    round += 1;
                }
                Ok(())
            })
        })
        .collect();
    let mut failures = Vec::new();
    for round in 0..4 {
        std::thread::sleep(Duration::from_millis(30));
        // SAFETY: the child runs only the library and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            child_exit(|| hammer(&shared, &format!("child/{round}"), 2, 200));
        }
        match reap(pid, Duration::from_secs(60)) {
            Some(0) => {}
            Some(code) => failures.push(format!("round {round}: child exited {code}")),
            None => failures.push(format!("round {round}: child hung")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for b in busy {
        b.join().unwrap().unwrap();
    }
    assert!(failures.is_empty(), "{failures:?}");
    // The child's writes reached the server.
    for round in 0..4 {
        assert_eq!(server.get_int(&format!("child/{round}/1/n")).unwrap(), 200);
    }
    // A master handle forked too: the child uses it as a client, and its
    // exit leaves the parent's server running.
    let master = Arc::new(server);
    // SAFETY: as above.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        child_exit(move || {
            let r = hammer(&master, "child-of-master", 2, 100);
            drop(master);
            r
        });
    }
    assert_eq!(reap(pid, Duration::from_secs(60)), Some(0));
    hammer(&master, "after-fork", 2, 50).unwrap();
}
