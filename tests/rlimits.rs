//! Resource limits: at RLIMIT_NOFILE 256, thousands of shares and receives
//! through the fd and name paths, then running into the limit: typed
//! errors (TooManyFiles), nothing half made in /dev/shm, and everything
//! works again once descriptors are free. Mappings: vm.max_map_count is a
//! global sysctl (no namespace lowers it), so a mapping budget is
//! simulated with RLIMIT_AS. Each case runs in a child so the limits do
//! not touch the other tests.

mod common;

use common::*;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use storage_sharing::shm::flags::{EXCLUSIVE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};
use storage_sharing::storage::{recv_fds, send_fds, Storage};
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
    std::fs::read_dir("/dev/shm").unwrap().flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|n| n.starts_with(&prefix)).collect()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count() - 1
}

#[test]
#[ignore = "entry point of the child process"]
fn child_role() {
    let Some((role, _)) = my_role() else { return };
    match role.as_str() {
        "nofile" => nofile(),
        "address_space" => address_space(),
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
    let held: Vec<Storage> = (0..2000).map(|_| {
        let s = Storage::new_using_filename(64).unwrap();
        s.share_filename().unwrap();
        s
    }).collect();
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
