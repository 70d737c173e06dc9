//! Resource limits: at RLIMIT_NOFILE 256, thousands of shares and receives
//! through the fd and name paths, then running into the limit: typed
//! errors (TooManyFiles), nothing half made in /dev/shm, and everything
//! works again once descriptors are free. Mappings: vm.max_map_count is a
//! global sysctl (no namespace lowers it), so a mapping budget is
//! simulated with RLIMIT_AS. File-store waits at RLIMIT_NOFILE 32 and with
//! every inotify instance of the user taken fall back to polling. Each
//! case runs in a child so the limits do not touch the other tests.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use storage_sharing::shm::flags::{EXCLUSIVE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};
use storage_sharing::storage::{recv_fds, send_fds, Storage};
use storage_sharing::store::{FileStore, Store};
use storage_sharing::ErrorKind;

fn set_limit(resource: libc::__rlimit_resource_t, soft: u64) {
    // SAFETY: plain data in, our own limits changed.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(resource, &mut r), 0);
        r.rlim_cur = soft;
        assert_eq!(libc::setrlimit(resource, &r), 0);
    }
}

fn mine() -> Vec<String> {
    let prefix = format!("torch_{}_", std::process::id());
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count() - 1
}

#[test]
#[ignore = "entry point of the child process"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    match role.as_str() {
        "nofile" => nofile(),
        "address_space" => address_space(),
        "store_nofile" => store_nofile(&args[0]),
        "store_no_inotify" => store_no_inotify(&args[0]),
        other => panic!("unknown role {other}"),
    }
}

fn nofile() {
    set_limit(libc::RLIMIT_NOFILE, 256);
    use_built_manager();
    let (a, b) = UnixStream::pair().unwrap();
    let before = open_fds();
    // Thousands of round trips through each path stay within the limit.
    for i in 0..3000usize {
        let s = Storage::from_bytes(&[i as u8; 512]).unwrap();
        let (fd, n) = s.share_fd().unwrap();
        send_fds(a.as_raw_fd(), b"x", &[fd]).unwrap();
        let (_, fds) = recv_fds(b.as_raw_fd(), &mut [0u8; 1], 1).unwrap();
        let r = Storage::new_shared_fd(fds[0].as_raw_fd(), n).unwrap();
        assert_eq!(r.to_vec()[0], i as u8);
    }
    for i in 0..3000usize {
        let s = Storage::from_bytes(&[i as u8; 512]).unwrap();
        let h = s.share_filename().unwrap();
        let r = Storage::new_shared_filename(&h.manager_handle, &h.filename, h.nbytes).unwrap();
        assert_eq!(r.to_vec()[0], i as u8);
    }
    // The manager client's socket stays open: at most one more descriptor.
    assert!(open_fds() <= before + 1, "descriptors leaked: {before} before, {} after", open_fds());
    // By name, thousands held at once cost no descriptor.
    let held: Vec<Storage> = (0..2000)
        .map(|_| {
            let s = Storage::new_using_filename(64).unwrap();
            s.share_filename().unwrap();
            s
        })
        .collect();
    assert!(open_fds() <= before + 1);
    drop(held);
    // By fd each held storage keeps one: the 256th fails with a typed error.
    let mut fd_held = Vec::new();
    let e = loop {
        match Storage::new_using_fd(64) {
            Ok(s) => fd_held.push(s),
            Err(e) => break e,
        }
        assert!(fd_held.len() < 300, "the limit was never reached");
    };
    println!("fd storages held at the limit: {} ({e})", fd_held.len());
    assert_eq!(e.kind(), ErrorKind::TooManyFiles, "{e}");
    // One descriptor back, to list /dev/shm: fd storages are unlinked at
    // creation, so nothing of ours may be there.
    drop(fd_held.pop());
    assert!(mine().is_empty(), "segments left by failed creations: {:?}", mine());
    // Receiving at the limit: the descriptor cannot be installed.
    let (fd, _) = fd_held[0].share_fd().unwrap();
    let _filler = std::fs::File::open("/dev/null").unwrap();
    send_fds(a.as_raw_fd(), b"x", &[fd]).unwrap();
    match recv_fds(b.as_raw_fd(), &mut [0u8; 1], 1) {
        Ok((_, fds)) => panic!("received {} descriptors past the limit", fds.len()),
        Err(e) => {
            println!("recv at the limit: {e}");
            assert_eq!(e.kind(), ErrorKind::TooManyFiles, "{e}");
            // The count is true although /proc/self/fd cannot be listed now.
            assert!(e.message().contains("(256 open, soft limit 256)"), "{e}");
        }
    }
    drop(fd_held);
    // Everything works again.
    let s = Storage::new_using_fd(64).unwrap();
    s.share_fd().unwrap();
    println!("nofile ok");
}

fn address_space() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let vm_kb: u64 = status.lines().find(|l| l.starts_with("VmSize:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    // 64 MiB above what the process uses now: the mapping budget.
    set_limit(libc::RLIMIT_AS, vm_kb * 1024 + (64 << 20));
    let mut held = Vec::new();
    let e = loop {
        match RefcountedMapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 1 << 20) {
            Ok(m) => held.push(m),
            Err(e) => break e,
        }
        assert!(held.len() < 1000, "the budget was never reached");
    };
    println!("1 MiB segments mapped within the budget: {} ({e})", held.len());
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert_eq!(mine().len(), held.len(), "a failed mapping left its segment: {:?}", mine());
    drop(held);
    assert!(mine().is_empty());
    println!("address_space ok");
}

#[test]
fn nofile_256_with_thousands_of_shares() {
    let out = run_ok(child_command("nofile", &[]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(text.contains("nofile ok"), "{text}");
}

#[test]
fn mapping_budget_gives_no_space_and_leaves_nothing() {
    let out = run_ok(child_command("address_space", &[]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(text.contains("address_space ok"), "{text}");
}

const STORE_WAITERS: usize = 40;

/// 40 threads wait on distinct keys at RLIMIT_NOFILE 32; the parent sets
/// them. Then, at the limit, a get names the real descriptor count.
fn store_nofile(dir: &str) {
    set_limit(libc::RLIMIT_NOFILE, 32);
    let store = Arc::new(FileStore::open(dir).unwrap());
    let threads = start_store_waiters(&store, "w", STORE_WAITERS, Duration::from_secs(30));
    println!("READY");
    std::io::stdout().flush().unwrap();
    let mut failed = Vec::new();
    for (i, t) in threads.into_iter().enumerate() {
        match t.join().unwrap() {
            Ok(v) => assert_eq!(v, i.to_string().as_bytes()),
            Err(e) => failed.push(format!("w/{i}: {e}")),
        }
    }
    assert!(failed.is_empty(), "{} of {STORE_WAITERS} waits failed: {failed:#?}", failed.len());
    // The store's watch closes once the waits are over; then every
    // descriptor is taken, and the error says so with the true count.
    assert!(wait_until(Duration::from_secs(10), || inotify_fds() == 0), "the store's inotify watch stayed open");
    let mut filler = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        filler.push(f);
        assert!(filler.len() < 64, "the limit was never reached");
    }
    let e = store.get(b"w/0", Some(Duration::from_millis(50))).unwrap_err();
    println!("get at the limit: {e}");
    assert_eq!(e.kind(), ErrorKind::TooManyFiles, "{e}");
    assert!(e.message().contains("\"w/0\"") && e.message().contains("(32 open, soft limit 32)"), "{e}");
    drop(filler);
    assert_eq!(store.get(b"w/0", Some(Duration::from_secs(5))).unwrap(), b"0");
    println!("store nofile ok");
}

#[test]
fn file_store_waits_at_nofile_32_poll_instead_of_failing() {
    let dir = std::env::temp_dir().join(format!("ss-rlimits-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = child_command("store_nofile", &[dir.to_str().unwrap()]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    while !text.contains("READY") {
        assert!(stdout.read_line(&mut text).unwrap() > 0, "child ended before its waiters were ready: {text}");
    }
    let store = FileStore::open(&dir).unwrap();
    for i in 0..STORE_WAITERS {
        store.set(format!("w/{i}").as_bytes(), i.to_string().as_bytes()).unwrap();
    }
    stdout.read_to_string(&mut text).unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    println!("{text}");
    assert!(status.success() && text.contains("store nofile ok"), "{status}\n{text}\n{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Takes every inotify instance the user may have, then waits: they poll.
fn store_no_inotify(dir: &str) {
    // SAFETY: rlimit is plain data; raising the soft limit to the hard one.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    // Descriptors kept back so the store can still open files once the
    // instances run out.
    let reserve: Vec<std::fs::File> = (0..16).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
    let mut instances = Vec::new();
    let errno = loop {
        // SAFETY: flags only; a non-negative result is a descriptor we own.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        if fd < 0 {
            break std::io::Error::last_os_error().raw_os_error().unwrap();
        }
        // SAFETY: a fresh descriptor owned by no one else.
        instances.push(unsafe { OwnedFd::from_raw_fd(fd) });
        assert!(instances.len() < 1 << 20, "inotify instances never ran out");
    };
    assert_eq!(errno, libc::EMFILE);
    drop(reserve);
    // SAFETY: as above.
    let again = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    if again >= 0 {
        // SAFETY: as above.
        drop(unsafe { OwnedFd::from_raw_fd(again) });
        println!("store no inotify ok (skipped: the descriptor limit ran out before the user's inotify instances)");
        return;
    }
    let store = Arc::new(FileStore::open(dir).unwrap());
    let s2 = store.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        for k in ["late/0", "late/1", "late/2"] {
            s2.set(k.as_bytes(), k.as_bytes()).unwrap();
        }
    });
    assert_eq!(store.get(b"late/0", Some(Duration::from_secs(30))).unwrap(), b"late/0");
    store.wait(&[b"late/1".as_slice(), b"late/2"], Some(Duration::from_secs(30))).unwrap();
    setter.join().unwrap();
    let e = store.get(b"never", Some(Duration::from_millis(50))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    println!("store no inotify ok ({} instances held by the test)", instances.len());
}

#[test]
fn file_store_waits_with_inotify_exhausted_poll() {
    let dir = std::env::temp_dir().join(format!("ss-rlimits-inotify-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = run_ok(child_command("store_no_inotify", &[dir.to_str().unwrap()]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(text.contains("store no inotify ok"), "{text}");
    std::fs::remove_dir_all(dir).unwrap();
}
