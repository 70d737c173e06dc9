//! Security promises: segments are created 0600 and O_EXCL, names are
//! unguessable, no symlink planted at a name is followed at creation, the
//! manager's folder is 0700 and a process of another uid cannot reach it,
//! and a hostile process of the same user that scribbles over a segment
//! header or a CUDA-IPC counter file gets typed errors out of us, never a
//! crash, and never makes us free memory still mapped.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/nobody.rs"]
mod nobody;

use common::*;
use nobody::{retry_while_busy, run_as_nobody, NobodyDir};
use std::collections::HashSet;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::sync::atomic::Ordering;
use storage_sharing::cuda::counters::{release_slot, CounterFile};
use storage_sharing::manager::spawn::spawn_manager_at;
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, SHARED, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, MapAllocator, RefcountedMapAllocator};
use storage_sharing::ErrorKind;

fn mode_of(name: &str) -> u32 {
    std::fs::metadata(format!("/dev/shm{name}")).unwrap().permissions().mode() & 0o777
}

#[test]
fn segments_are_0600_and_exclusive() {
    let name = new_process_wide_shm_handle();
    let a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 100).unwrap();
    assert_eq!(mode_of(&name), 0o600);
    let e = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 100).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert_eq!(a.refcount().unwrap(), 1, "a refused create must not touch the count");
    let c = CounterFile::create().unwrap();
    assert_eq!(mode_of(c.name()), 0o600);
    // A umask of 0 does not widen it.
    // SAFETY: umask only changes this process's file-creation mask.
    let old = unsafe { libc::umask(0) };
    let m = MapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE | storage_sharing::shm::flags::UNLINK, 10);
    let b = RefcountedMapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, 10).unwrap();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    drop(m);
    assert_eq!(mode_of(b.filename()), 0o600);
}

#[test]
fn names_are_unguessable() {
    // The random part of 2000 names: all distinct, and spread over the
    // 32 bits (a counter or the clock would cluster).
    let mut seen = HashSet::new();
    let mut ones = 0u32;
    for _ in 0..2000 {
        let n = new_process_wide_shm_handle();
        let r: u32 = n.split('_').nth(2).unwrap().parse().unwrap();
        assert!(seen.insert(r), "random part repeated: {n}");
        ones += r.count_ones();
    }
    let mean = ones as f64 / 2000.0;
    assert!((14.0..18.0).contains(&mean), "mean set bits {mean}, expected about 16");
}

#[test]
fn planted_symlink_is_never_followed_at_creation() {
    let dir = std::env::temp_dir().join(format!("ss-sec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let target = dir.join("victim");
    std::fs::write(&target, b"precious").unwrap();
    // SHAREDMEM: shm_open of a name where a symlink waits, in every
    // creating mode (EXCLUSIVE, and open-or-create).
    for flags in [SHAREDMEM | EXCLUSIVE, SHAREDMEM] {
        let name = new_process_wide_shm_handle();
        std::os::unix::fs::symlink(&target, format!("/dev/shm{name}")).unwrap();
        let e = RefcountedMapAllocator::open(&name, flags, 4096).unwrap_err();
        println!("SHAREDMEM flags {flags}: {e}");
        let e2 = MapAllocator::open(&name, flags, 4096).unwrap_err();
        assert!(!e2.message().is_empty());
        std::fs::remove_file(format!("/dev/shm{name}")).unwrap();
    }
    // SHARED | EXCLUSIVE: a file path with a symlink at it.
    let link = dir.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = MapAllocator::open(link.to_str().unwrap(), SHARED | EXCLUSIVE, 4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert_eq!(std::fs::read(&target).unwrap(), b"precious", "the symlink's target was changed");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "entry point of the child process"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    assert_eq!(role, "connect");
    match std::os::unix::net::UnixStream::connect(&args[0]) {
        Ok(_) => println!("connected"),
        Err(e) => println!("refused: {:?}", e.kind()),
    }
}

#[test]
fn manager_folder_is_0700_and_other_uids_cannot_connect() {
    let path = spawn_manager_at(&manager_bin()).unwrap();
    let dir = std::path::Path::new(&path).parent().unwrap().to_path_buf();
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    // Keep the daemon busy while we probe: one connected client.
    let client = std::os::unix::net::UnixStream::connect(&path).unwrap();
    // SAFETY: geteuid has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        println!("manager_folder_is_0700_and_other_uids_cannot_connect: other-uid part skipped: not root, cannot switch uid");
        return;
    }
    // This test binary, as uid/gid 65534 (nobody), tries to connect: a copy
    // of it, since the checkout may sit in a folder nobody cannot enter.
    let nobody_dir = NobodyDir::new("connect");
    let exe = nobody_dir.copy_of(&std::env::current_exe().unwrap());
    let mut cmd = child_command_of(&exe, "connect", &[&path]);
    run_as_nobody(&mut cmd);
    let out = retry_while_busy(|| cmd.output());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("refused: PermissionDenied"),
        "uid 65534 reached the manager, or could not run: {}\nstdout: {text}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    drop(client);
}

#[test]
fn manager_refuses_a_peer_of_another_uid_even_root() {
    // root passes any 0700 folder, so the manager also checks SO_PEERCRED:
    // run it as nobody and connect as root.
    // SAFETY: geteuid has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        println!("manager_refuses_a_peer_of_another_uid_even_root: skipped: not root, cannot switch uid");
        return;
    }
    // The manager runs from a copy, and keeps its socket in a folder, that
    // nobody can reach wherever the checkout and TMPDIR are.
    let nobody_dir = NobodyDir::new("peercred");
    let manager = nobody_dir.copy_of(&manager_bin());
    let tmp = nobody_dir.path.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::os::unix::fs::chown(&tmp, Some(65534), Some(65534)).unwrap();
    let mut cmd = std::process::Command::new(manager);
    cmd.env("TMPDIR", &tmp)
        .env("SS_SHM_MANAGER_LOG", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    run_as_nobody(&mut cmd);
    let mut child = retry_while_busy(|| cmd.spawn());
    let mut first_line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut first_line).unwrap();
    let socket = first_line.trim().to_string();
    if !socket.starts_with('/') {
        let out = child.wait_with_output().unwrap();
        panic!("the manager could not run as nobody: {first_line} {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("root passes the 0700 folder");
    stream.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    let mut byte = [0u8; 1];
    let n = std::io::Read::read(&mut stream, &mut byte).expect("the manager closes the connection, it does not leave it open");
    assert_eq!(n, 0, "the manager sent data to a refused peer");
    drop(stream);
    // With no client left the daemon exits on its own after its idle time.
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("refused a client of uid 0"), "manager log: {log}");
    assert!(!log.contains("client 0 connected"), "manager log: {log}");
}

#[test]
fn garbage_in_a_segment_header_gives_typed_errors_and_frees_nothing_in_use() {
    let name = new_process_wide_shm_handle();
    let a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    // SAFETY: 4096 bytes of user data are mapped.
    unsafe { a.data().write_bytes(0x5a, 4096) };
    let file = std::fs::OpenOptions::new().read(true).write(true).open(format!("/dev/shm{name}")).unwrap();
    let hostile = |count: i32| file.write_all_at(&count.to_ne_bytes(), 0).unwrap();
    for bad in [0, -1, i32::MIN] {
        hostile(bad);
        let e = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRefcount, "count {bad}: {e}");
    }
    // At i32::MAX one more would wrap negative: refused, not wrapped
    // (it was wrapped, and overflowed to a panic in debug builds).
    hostile(i32::MAX);
    let e = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::BadRefcount, "{e}");
    assert_eq!(a.incref().unwrap_err().kind(), ErrorKind::BadRefcount);
    // The hostile process says 1 while two of us hold it: the first close
    // removes the name, yet the other holder's memory stays mapped and intact.
    hostile(1);
    let mut c = MapAllocator::open(&name, SHAREDMEM | NOCREATE, 4096 + 64).unwrap();
    hostile(1);
    drop(a);
    assert!(!shm_exists(&name), "count reached 0: the name goes");
    // SAFETY: c still maps the segment; the name's removal frees no pages.
    let bytes = unsafe { std::slice::from_raw_parts(c.data().add(64), 4096) };
    assert!(bytes.iter().all(|b| *b == 0x5a));
    c.close().unwrap();
    // A size lie: the file is truncated under us; opening it is a typed error.
    let name = new_process_wide_shm_handle();
    let a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    std::fs::OpenOptions::new().write(true).open(format!("/dev/shm{name}")).unwrap().set_len(10).unwrap();
    let e = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 4096).unwrap_err();
    println!("truncated: {e}");
    assert!(matches!(e.kind(), ErrorKind::SizeMismatch | ErrorKind::InvalidArgument), "{e}");
    std::mem::forget(a); // its pages past 10 bytes are gone: touching them would SIGBUS
    let _ = std::fs::remove_file(format!("/dev/shm{name}"));
}

#[test]
fn garbage_in_a_counter_file_gives_typed_errors() {
    let f = CounterFile::create().unwrap();
    let name = f.name().to_string();
    f.slot(5).store(1, Ordering::SeqCst);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(format!("/dev/shm{name}")).unwrap();
    for bad in [0i64, -1, i64::MIN] {
        file.write_all_at(&bad.to_ne_bytes(), 64 + 8 * 5).unwrap();
        let e = release_slot(&name, 5).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRefcount, "slot {bad}: {e}");
    }
    for slot in [10_000u64, u64::MAX] {
        assert_eq!(release_slot(&name, slot).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
    // A header count of 0 makes the file look released: PeerGone, no crash.
    file.write_all_at(&0i32.to_ne_bytes(), 0).unwrap();
    assert_eq!(release_slot(&name, 5).unwrap_err().kind(), ErrorKind::PeerGone);
    file.write_all_at(&1i32.to_ne_bytes(), 0).unwrap();
    // A file too short to be a counter file: a typed error.
    std::fs::OpenOptions::new().write(true).open(format!("/dev/shm{name}")).unwrap().set_len(64).unwrap();
    let e = release_slot(&name, 5).unwrap_err();
    println!("short counter file: {e}");
    std::mem::forget(f);
    let _ = std::fs::remove_file(format!("/dev/shm{name}"));
}
