//! The file store across processes, through the C API where it matters:
//! concurrent adds, a get that waits for a later set, timeouts that name
//! the keys, a writer killed with -9 mid-write, a FIFO at a key's path,
//! and many waiters sharing one inotify instance.

#[path = "../common/mod.rs"]
mod common;

use common::{child_command, inotify_fds, my_role, start_store_waiters, wait_until};
use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use storage_sharing::ffi::errors::ss_last_error_message;
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ffi::store::*;
use storage_sharing::store::file_key::file_name;
use storage_sharing::store::{FileStore, Store};
use storage_sharing::ErrorKind;

const ADDS_PER_CHILD: i64 = 200;
const BIG: usize = 8 << 20;

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ss-store-file-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn last_error() -> String {
    // SAFETY: the library returns this thread's NUL-terminated last error.
    unsafe { CStr::from_ptr(ss_last_error_message()) }.to_string_lossy().into_owned()
}

fn open(dir: &std::path::Path) -> *mut SsStore {
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: valid string and out-pointer.
    assert_eq!(unsafe { ss_store_file_open(path.as_ptr(), &mut s) }, ss_status::SS_OK, "{}", last_error());
    s
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    let store = FileStore::open(&args[0]).unwrap();
    match role.as_str() {
        "adder" => {
            let mut seen = Vec::new();
            for _ in 0..ADDS_PER_CHILD {
                seen.push(store.add(b"counter", 1).unwrap().to_string());
            }
            println!("SEEN {}", seen.join(" "));
        }
        "getter" => {
            let v = store.get(b"late/key", Some(Duration::from_secs(30))).unwrap();
            println!("GOT {}", String::from_utf8(v).unwrap());
        }
        "writer" => {
            // Rewrites one big value forever, each version one repeated byte.
            for i in 0u64.. {
                store.set(b"big", &vec![(i % 251) as u8 + 1; BIG]).unwrap();
            }
        }
        "elector" => {
            // Each round, every process tries to claim the round's key with
            // its own name and then to hand it on from the winner's name.
            let me = args[1].as_str();
            let mut won = Vec::new();
            for round in 0..ROUNDS {
                let key = format!("leader/{round}");
                let answer = store.compare_set(key.as_bytes(), b"", me.as_bytes()).unwrap();
                if answer == me.as_bytes() {
                    won.push(round.to_string());
                }
                let moved =
                    store.compare_set(key.as_bytes(), &answer, format!("{}+", String::from_utf8_lossy(&answer)).as_bytes()).unwrap();
                assert!(moved.starts_with(&answer), "round {round}: {moved:?} does not extend {answer:?}");
            }
            println!("WON {}", won.join(" "));
        }
        "non_regular_keys" => non_regular_keys(&store, &args[0]),
        "many_waiters" => many_waiters(store),
        other => panic!("unknown role {other}"),
    }
}

/// A FIFO and a device at keys' paths: every reading call fails at once
/// with `Corrupt` naming the key (a FIFO used to block `get` for good).
fn non_regular_keys(store: &FileStore, dir: &str) {
    let fifo = CString::new(format!("{dir}/{}", file_name(b"pipe"))).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    std::os::unix::fs::symlink("/dev/zero", PathBuf::from(dir).join(file_name(b"zero"))).unwrap();
    for key in ["pipe", "zero"] {
        let e = store.get(key.as_bytes(), Some(Duration::from_millis(300))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.message().contains(&format!("{key:?}")) && e.message().contains("not a regular file"), "{e}");
        assert_eq!(store.add(key.as_bytes(), 1).unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(store.compare_set(key.as_bytes(), b"", b"x").unwrap_err().kind(), ErrorKind::Corrupt);
        println!("{key}: {e}");
    }
    println!("non-regular ok");
}

const WAITERS: usize = 160;

/// More waiters than the default per-user inotify limit (128) share one
/// instance, and no instance stays once the waits are over.
fn many_waiters(store: FileStore) {
    let store = std::sync::Arc::new(store);
    let threads = start_store_waiters(&store, "m", WAITERS, Duration::from_secs(60));
    let held = inotify_fds();
    assert!(held <= 1, "{WAITERS} waiters on one store hold {held} inotify instances");
    for i in 0..WAITERS {
        store.set(format!("m/{i}").as_bytes(), i.to_string().as_bytes()).unwrap();
    }
    for (i, t) in threads.into_iter().enumerate() {
        assert_eq!(t.join().unwrap().unwrap(), i.to_string().as_bytes());
    }
    // Waits one after another, each woken by a set from another thread.
    for round in 0..20 {
        let s2 = store.clone();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            s2.set(format!("seq/{round}").as_bytes(), b"v").unwrap();
        });
        assert_eq!(store.get(format!("seq/{round}").as_bytes(), Some(Duration::from_secs(30))).unwrap(), b"v");
        setter.join().unwrap();
    }
    assert!(wait_until(Duration::from_secs(10), || inotify_fds() == 0), "{} inotify instances stay after every wait ended", inotify_fds());
    println!("many waiters ok");
}

/// Runs `cmd`, killing it if it has not exited within `limit`.
fn run_with_watchdog(mut cmd: std::process::Command, limit: Duration) -> std::process::Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let end = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("child still running after {limit:?}: hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn a_fifo_or_device_at_a_key_is_an_error_not_a_hang() {
    let dir = fresh_dir("fifo");
    let out = run_with_watchdog(child_command("non_regular_keys", &[dir.to_str().unwrap()]), Duration::from_secs(20));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("non-regular ok"), "{text}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn waiters_share_one_inotify_instance_and_release_it() {
    let dir = fresh_dir("inotify");
    let out = run_with_watchdog(child_command("many_waiters", &[dir.to_str().unwrap()]), Duration::from_secs(120));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("many waiters ok"), "{text}");
    std::fs::remove_dir_all(dir).unwrap();
}

const ROUNDS: usize = 100;

/// compare_set is atomic across processes: each round has exactly one
/// winner, and each hand-on swap applies once (a '+' per swap that saw
/// its expected value).
#[test]
fn compare_set_elects_exactly_one_leader_per_round_across_four_processes() {
    let dir = fresh_dir("elect");
    let d = dir.to_str().unwrap();
    let names = ["p0", "p1", "p2", "p3"];
    let children: Vec<_> =
        names.iter().map(|n| child_command("elector", &[d, n]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()).collect();
    let mut wins = vec![0usize; ROUNDS];
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text.lines().find_map(|l| l.split_once("WON").map(|x| x.1)).expect("child printed its wins");
        for r in line.split_whitespace() {
            wins[r.parse::<usize>().unwrap()] += 1;
        }
    }
    assert!(wins.iter().all(|&w| w == 1), "rounds without exactly one winner: {wins:?}");
    let store = FileStore::open(&dir).unwrap();
    for round in 0..ROUNDS {
        let v = store.get(format!("leader/{round}").as_bytes(), Some(Duration::from_secs(1))).unwrap();
        let v = String::from_utf8(v).unwrap();
        assert!(names.iter().any(|n| v.starts_with(n)) && v.ends_with('+'), "round {round}: {v}");
    }
    assert_eq!(store.num_keys().unwrap(), ROUNDS as i64);
    assert!(store.check(&[b"leader/0".as_slice(), format!("leader/{}", ROUNDS - 1).as_bytes()]).unwrap());
    assert!(store.delete_key(b"leader/0").unwrap());
    assert!(!store.check(&[b"leader/0".as_slice()]).unwrap());
    assert_eq!(store.num_keys().unwrap(), ROUNDS as i64 - 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn concurrent_adds_from_four_processes_sum_exactly() {
    let dir = fresh_dir("adds");
    let d = dir.to_str().unwrap();
    let children: Vec<_> =
        (0..4).map(|_| child_command("adder", &[d]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()).collect();
    let mut all: Vec<i64> = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text.lines().find_map(|l| l.split_once("SEEN ").map(|x| x.1)).expect("child printed its values");
        all.extend(line.split(' ').map(|v| v.parse::<i64>().unwrap()));
    }
    // Every add saw a distinct value: no add was lost or applied twice.
    all.sort();
    assert_eq!(all, (1..=4 * ADDS_PER_CHILD).collect::<Vec<_>>());
    let s = open(&dir);
    let mut v = 0;
    let key = CString::new("counter").unwrap();
    // SAFETY: live handle, valid string and out-pointer.
    assert_eq!(unsafe { ss_store_add(s, key.as_ptr(), 0, &mut v) }, ss_status::SS_OK);
    assert_eq!(v, 4 * ADDS_PER_CHILD);
    // SAFETY: handle from open, freed once.
    unsafe { ss_store_free(s) };
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn get_in_another_process_waits_for_a_later_set() {
    let dir = fresh_dir("late");
    std::fs::create_dir_all(&dir).unwrap();
    let child = child_command("getter", &[dir.to_str().unwrap()]).stdout(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let s = open(&dir);
    let (key, value) = (CString::new("late/key").unwrap(), b"arrived");
    // SAFETY: live handle, valid string, value readable for its length.
    assert_eq!(unsafe { ss_store_set(s, key.as_ptr(), value.as_ptr().cast(), value.len()) }, ss_status::SS_OK);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("GOT arrived"));
    // SAFETY: handle from open, freed once.
    unsafe { ss_store_free(s) };
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn c_api_timeouts_name_keys_and_arguments_are_checked() {
    let dir = fresh_dir("capi");
    let s = open(&dir);
    let k = |t: &str| CString::new(t).unwrap();
    let (a, b, c) = (k("a"), k("grp/0/1"), k("grp/0/2"));
    // SAFETY (whole block): live handle, valid strings, buffers of the stated lengths.
    unsafe {
        assert_eq!(ss_store_set(s, a.as_ptr(), b"abcdefghij".as_ptr().cast(), 10), ss_status::SS_OK);
        let keys: [*const c_char; 3] = [a.as_ptr(), b.as_ptr(), c.as_ptr()];
        let t0 = Instant::now();
        assert_eq!(ss_store_wait(s, keys.as_ptr(), 3, 50), ss_status::SS_ERR_TIMEOUT);
        assert!(t0.elapsed() >= Duration::from_millis(50));
        let msg = last_error();
        assert!(msg.contains("\"grp/0/1\", \"grp/0/2\"") && !msg.contains("\"a\""), "{msg}");
        assert!(msg.contains(dir.to_str().unwrap()), "{msg}");
        assert_eq!(ss_store_wait(s, keys.as_ptr(), 1, 50), ss_status::SS_OK);
        assert_eq!(ss_store_wait(s, std::ptr::null(), 0, 50), ss_status::SS_OK);
        assert_eq!(ss_store_wait(s, std::ptr::null(), 1, 50), ss_status::SS_ERR_NULL_POINTER);
        assert_eq!(ss_store_wait(s, keys.as_ptr(), 1, -1), ss_status::SS_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("timeout_ms is -1"));

        let mut len = 0usize;
        let mut small = [0u8; 4];
        assert_eq!(ss_store_get(s, a.as_ptr(), 100, small.as_mut_ptr().cast(), 4, &mut len), ss_status::SS_ERR_BUFFER_TOO_SMALL);
        assert_eq!(len, 10);
        assert_eq!(ss_store_get(s, a.as_ptr(), 100, std::ptr::null_mut(), 0, &mut len), ss_status::SS_ERR_BUFFER_TOO_SMALL);
        assert_eq!(len, 10);
        let mut buf = [0u8; 16];
        assert_eq!(ss_store_get(s, a.as_ptr(), 100, buf.as_mut_ptr().cast(), 16, &mut len), ss_status::SS_OK);
        assert_eq!(&buf[..len], b"abcdefghij");
        assert_eq!(ss_store_get(s, b.as_ptr(), 20, buf.as_mut_ptr().cast(), 16, &mut len), ss_status::SS_ERR_TIMEOUT);
        assert!(last_error().contains("\"grp/0/1\""));
        assert_eq!(ss_store_get(s, a.as_ptr(), 20, std::ptr::null_mut(), 16, &mut len), ss_status::SS_ERR_NULL_POINTER);

        let mut v = 0i64;
        assert_eq!(ss_store_add(s, a.as_ptr(), 1, &mut v), ss_status::SS_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("does not hold an integer"));
        assert_eq!(ss_store_add(std::ptr::null(), a.as_ptr(), 1, &mut v), ss_status::SS_ERR_NULL_POINTER);
        assert_eq!(ss_store_set(s, std::ptr::null(), std::ptr::null(), 0), ss_status::SS_ERR_NULL_POINTER);
        assert_eq!(ss_store_set(s, b.as_ptr(), std::ptr::null(), 1), ss_status::SS_ERR_NULL_POINTER);
        assert_eq!(ss_store_set(s, b.as_ptr(), std::ptr::null(), 0), ss_status::SS_OK);
        assert_eq!(ss_store_get(s, b.as_ptr(), 0, std::ptr::null_mut(), 0, &mut len), ss_status::SS_OK);
        assert_eq!(len, 0);

        // A second reference outlives the first.
        let mut s2 = std::ptr::null_mut();
        assert_eq!(ss_store_ref(s, &mut s2), ss_status::SS_OK);
        ss_store_free(s);
        assert_eq!(ss_store_wait(s2, keys.as_ptr(), 2, 10), ss_status::SS_OK);
        ss_store_free(s2);
        ss_store_free(std::ptr::null_mut());

        // A regular file is not a store.
        let file = k(dir.join("k.a").to_str().unwrap());
        let mut s3 = std::ptr::null_mut();
        assert_eq!(ss_store_file_open(file.as_ptr(), &mut s3), ss_status::SS_ERR_INVALID_ARGUMENT);
        assert!(s3.is_null());
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn writer_killed_mid_write_never_leaves_half_a_value() {
    let dir = fresh_dir("kill");
    std::fs::create_dir_all(&dir).unwrap();
    let store = FileStore::open(&dir).unwrap();
    for round in 0..3 {
        let mut child = child_command("writer", &[dir.to_str().unwrap()]).stdout(Stdio::null()).spawn().unwrap();
        let tmp_prefix = format!(".tmp.{}.", child.id());
        // Kill only while a temporary file of the writer exists: mid-write.
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let writing = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(&tmp_prefix) && e.metadata().is_ok_and(|m| m.len() > 0));
            if writing && (round == 0 || store.get(b"big", Some(Duration::from_millis(1))).is_ok()) {
                break;
            }
            assert!(Instant::now() < end, "writer never started writing");
            std::thread::sleep(Duration::from_micros(200));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        match store.get(b"big", Some(Duration::from_millis(1))) {
            Ok(v) => {
                assert_eq!(v.len(), BIG, "round {round}: a half value is visible");
                assert!(v.iter().all(|b| *b == v[0]), "round {round}: mixed versions in one value");
            }
            Err(e) => assert!(round == 0, "round {round}: value lost: {e}"),
        }
        // The next open sweeps the dead writer's temporary file.
        drop(FileStore::open(&dir).unwrap());
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp."))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unknown_child_role_fails() {
    // The roles above are reached only through child_command; an unknown
    // role must fail loudly instead of passing silently.
    let out = child_command("no-such-role", &["/nonexistent-ss-store"]).output().unwrap();
    assert!(!out.status.success());
}

/// Guards against a key's file grown sparse to 8 TiB by another process
/// (the same attack as on the PyTorch FileStore log) being read whole: it
/// is read within its size in chunks, and a hole (this store writes every byte
/// of a value) is `Corrupt` naming the key, file and size, through the Rust
/// API and the C API. Where the file system reports no holes, the size
/// cannot be allocated: `NoSpace`, still no abort.
#[test]
fn a_key_file_grown_sparse_to_8_tib_is_corrupt() {
    const HUGE: u64 = 8 << 40;
    let dir = fresh_dir("sparse");
    let store = FileStore::open(&dir).unwrap();
    store.set(b"big", b"small value").unwrap();
    let key_path = dir.join(file_name(b"big"));
    if let Err(e) = std::fs::OpenOptions::new().write(true).open(&key_path).unwrap().set_len(HUGE) {
        println!("SKIP: this file system cannot hold an 8 TiB sparse file: {e}");
        return;
    }
    let holes_seen = storage_sharing::store::bounded_read::first_hole(&std::fs::File::open(&key_path).unwrap(), 0, HUGE).is_some();
    let expected = if holes_seen { ErrorKind::Corrupt } else { ErrorKind::NoSpace };
    let e = store.get(b"big", Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.kind(), expected, "{}", e.message());
    for part in ["\"big\"", key_path.to_str().unwrap(), &HUGE.to_string()] {
        assert!(e.message().contains(part), "{part} missing: {}", e.message());
    }
    assert_eq!(store.add(b"big", 1).unwrap_err().kind(), expected);
    assert_eq!(store.compare_set(b"big", b"x", b"y").unwrap_err().kind(), expected);
    let s = open(&dir);
    let key = CString::new("big").unwrap();
    let mut buf = [0u8; 16];
    let mut len = 0usize;
    // SAFETY: a live handle, a NUL-terminated key and valid out pointers.
    let st = unsafe { ss_store_get(s, key.as_ptr(), 5000, buf.as_mut_ptr().cast(), buf.len(), &mut len) };
    let want = if holes_seen { ss_status::SS_ERR_CORRUPT } else { ss_status::SS_ERR_NO_SPACE };
    assert_eq!(st, want, "{}", last_error());
    // SAFETY: the handle opened above, freed once.
    unsafe { ss_store_free(s) };
    // The store still works for its other keys, and a new value heals it.
    store.set(b"other", b"1").unwrap();
    assert_eq!(store.get(b"other", None).unwrap(), b"1");
    store.set(b"big", b"again").unwrap();
    assert_eq!(store.get(b"big", None).unwrap(), b"again");
    let _ = std::fs::remove_dir_all(&dir);
}
