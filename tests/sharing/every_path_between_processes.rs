//! Every way a storage travels between processes, with a real second
//! process: bytes and reference counts checked on both sides.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, pattern, shm_exists, use_built_manager, wait_until, Parent, Peer};
use std::os::fd::AsRawFd;
use std::time::Duration;
use storage_sharing::storage::{recv_fds, send_fds, Storage};
use storage_sharing::ErrorKind;

const ENTRY: &str = "child_entry";

#[test]
fn child_entry() {
    child_main(|role, mut parent| match role {
        "open_fd" => open_fd_child(&mut parent),
        "make_fd" => make_fd_child(&mut parent),
        "open_name" => open_name_child(&mut parent),
        "make_name" => make_name_child(&mut parent),
        "fd_limit" => fd_limit_child(&mut parent),
        other => panic!("unknown role {other}"),
    });
}

/// Receives (nbytes, fd), maps it, checks the pattern, writes 0xEE at 0.
fn open_fd_child(parent: &mut Parent) {
    let mut buf = [0u8; 32];
    let (n, fds) = recv_fds(parent.stream.as_raw_fd(), &mut buf, 1).unwrap();
    let nbytes: usize = std::str::from_utf8(&buf[..n]).unwrap().trim().parse().unwrap();
    let s = Storage::new_shared_fd(fds[0].as_raw_fd(), nbytes).unwrap();
    drop(fds);
    assert!(s.is_shared() && !s.resizable());
    let ok = s.to_vec()[1..] == pattern(nbytes, 3)[1..];
    s.write_at(0, &[0xEE]).unwrap();
    parent.send(if ok { "ok" } else { "bad" });
    parent.recv();
}

#[test]
fn share_fd_parent_to_child() {
    for len in [1usize, 4096, (3 << 20) + 5] {
        let s = Storage::from_bytes(&pattern(len, 3)).unwrap();
        assert!(!s.is_shared());
        let (fd, n) = s.share_fd().unwrap();
        assert_eq!(n, len);
        assert!(s.is_shared());
        assert_eq!(s.share_fd().unwrap().0, fd, "sharing again keeps the segment");
        assert_eq!(s.get_shared_fd().unwrap(), fd);
        assert_eq!(s.resize(10).unwrap_err().kind(), ErrorKind::Unsupported);
        let mut peer = Peer::spawn(ENTRY, "open_fd", "");
        send_fds(peer.stream.as_raw_fd(), format!("{n}\n").as_bytes(), &[fd]).unwrap();
        assert_eq!(peer.recv(), "ok");
        assert_eq!(s.to_vec()[0], 0xEE, "the child's write is visible here");
        peer.send("bye");
        peer.finish();
    }
}

/// Makes an fd storage, fills it, sends it, exits: the bytes outlive it.
fn make_fd_child(parent: &mut Parent) {
    let s = Storage::new_using_fd(10_000).unwrap();
    s.write_at(0, &pattern(10_000, 9)).unwrap();
    let (fd, n) = s.share_fd().unwrap();
    send_fds(parent.stream.as_raw_fd(), format!("{n}").as_bytes(), &[fd]).unwrap();
    parent.recv();
}

#[test]
fn share_fd_child_to_parent_outlives_sender() {
    let mut peer = Peer::spawn(ENTRY, "make_fd", "");
    let mut buf = [0u8; 32];
    let (n, fds) = recv_fds(peer.stream.as_raw_fd(), &mut buf, 4).unwrap();
    let nbytes: usize = std::str::from_utf8(&buf[..n]).unwrap().parse().unwrap();
    let s = Storage::new_shared_fd(fds[0].as_raw_fd(), nbytes).unwrap();
    peer.send("bye");
    peer.finish();
    drop(fds);
    assert_eq!(s.to_vec(), pattern(10_000, 9));
    assert_eq!(Storage::new_shared_fd(-1, 10).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

/// Opens (manager, name, nbytes) from the parent as torch.multiprocessing
/// does, reports the count, writes 0xEE, closes on request.
fn open_name_child(parent: &mut Parent) {
    let line = parent.recv();
    let parts: Vec<&str> = line.split(' ').collect();
    let nbytes: usize = parts[2].parse().unwrap();
    let s = Storage::new_shared_filename(parts[0], parts[1], nbytes).unwrap();
    s.shared_decref().unwrap();
    let ok = s.to_vec()[1..] == pattern(nbytes, 5)[1..];
    s.write_at(0, &[0xEE]).unwrap();
    parent.send(&format!("{} {}", if ok { "ok" } else { "bad" }, s.shared_refcount().unwrap()));
    parent.recv();
    drop(s);
    parent.send("closed");
    parent.recv();
}

#[test]
fn share_filename_parent_to_child() {
    use_built_manager();
    let s = Storage::from_bytes(&pattern(70_000, 5)).unwrap();
    let h = s.share_filename().unwrap();
    assert_eq!(h.nbytes, 70_000);
    assert!(h.filename.starts_with("/torch_") && shm_exists(&h.filename));
    assert_eq!(s.share_filename().unwrap(), h, "sharing again keeps the segment");
    assert_eq!(s.shared_refcount().unwrap(), 1);
    s.shared_incref().unwrap();
    let mut peer = Peer::spawn(ENTRY, "open_name", "");
    peer.send(&format!("{} {} {}", h.manager_handle, h.filename, h.nbytes));
    // The child's +1 and its decref of our in-flight +1: 2 holders.
    assert_eq!(peer.recv(), "ok 2");
    assert_eq!(s.to_vec()[0], 0xEE);
    peer.send("close");
    assert_eq!(peer.recv(), "closed");
    assert_eq!(s.shared_refcount().unwrap(), 1);
    peer.send("bye");
    peer.finish();
    drop(s);
    assert!(!shm_exists(&h.filename), "last close removes the name");
}

/// Creates a managed storage with its own manager and sends its handle.
fn make_name_child(parent: &mut Parent) {
    let s = Storage::new_using_filename(5000).unwrap();
    s.write_at(0, &pattern(5000, 1)).unwrap();
    let h = s.share_filename().unwrap();
    s.shared_incref().unwrap();
    parent.send(&format!("{} {} {}", h.manager_handle, h.filename, h.nbytes));
    parent.recv();
}

#[test]
fn share_filename_child_to_parent_outlives_sender() {
    use_built_manager();
    let mut peer = Peer::spawn(ENTRY, "make_name", "");
    let line = peer.recv();
    let parts: Vec<&str> = line.split(' ').collect();
    let s = Storage::new_shared_filename(parts[0], parts[1], parts[2].parse().unwrap()).unwrap();
    s.shared_decref().unwrap();
    assert_eq!(s.shared_refcount().unwrap(), 2);
    peer.send("bye");
    peer.finish();
    assert_eq!(s.shared_refcount().unwrap(), 1, "the child closed its reference on exit");
    assert_eq!(s.to_vec(), pattern(5000, 1));
    let name = parts[1].to_string();
    assert!(shm_exists(&name));
    drop(s);
    assert!(!shm_exists(&name));
}

/// Lowers its descriptor limit to what it has open, then receives.
fn fd_limit_child(parent: &mut Parent) {
    let mut hold = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hold.push(f),
            Err(_) => break,
        }
        if hold.len() > 100_000 {
            break;
        }
        if hold.len() == 1 {
            let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
            let lim = libc::rlimit { rlim_cur: open + 2, rlim_max: open + 2 };
            // SAFETY: plain syscall on our own limits.
            assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
        }
    }
    parent.send("full");
    let mut buf = [0u8; 8];
    let e = recv_fds(parent.stream.as_raw_fd(), &mut buf, 4).unwrap_err();
    parent.send(&format!("{:?} {}", e.kind(), e.message().contains("open-file limit")));
    parent.recv();
}

#[test]
fn receiver_at_fd_limit_gets_an_error() {
    let mut peer = Peer::spawn(ENTRY, "fd_limit", "");
    assert_eq!(peer.recv(), "full");
    let s = Storage::new_using_fd(100).unwrap();
    let fd = s.get_shared_fd().unwrap();
    send_fds(peer.stream.as_raw_fd(), b"x", &[fd, fd, fd]).unwrap();
    assert_eq!(peer.recv(), "TooManyFiles true");
    peer.send("bye");
    peer.finish();
}

#[test]
fn weak_refs_follow_strong_ones() {
    let s = Storage::new(10).unwrap();
    let w = s.downgrade();
    assert!(!w.expired());
    let again = w.upgrade().unwrap();
    assert!(again.ptr_eq(&s));
    assert_eq!(s.strong_count(), 2);
    drop(s);
    assert!(!w.expired());
    drop(again);
    assert!(w.expired());
    assert!(w.upgrade().is_none());
}

#[test]
fn heap_storage_resizes_until_shared() {
    let s = Storage::from_bytes(b"abc").unwrap();
    s.resize(5).unwrap();
    assert_eq!(s.to_vec(), b"abc\0\0");
    s.resize(2).unwrap();
    assert_eq!(s.to_vec(), b"ab");
    assert_eq!(s.write_at(2, b"x").unwrap_err().kind(), ErrorKind::InvalidArgument);
    let empty = Storage::new(0).unwrap();
    assert!(empty.data().is_null());
    assert_eq!(empty.share_fd().unwrap_err().kind(), ErrorKind::InvalidArgument);
    // By name, as in ATen: a segment of the header alone, reopened with 0 bytes.
    use_built_manager();
    let h = empty.share_filename().unwrap();
    assert_eq!(h.nbytes, 0);
    let reopened = Storage::new_shared_filename(&h.manager_handle, &h.filename, 0).unwrap();
    assert_eq!((reopened.nbytes(), empty.shared_refcount().unwrap()), (0, 2));
    assert_eq!(s.shared_incref().unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(s.get_shared_fd().unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn fd_storage_moves_to_a_name_when_shared_by_name() {
    use_built_manager();
    let s = Storage::from_bytes(&pattern(1000, 2)).unwrap();
    let (fd, _) = s.share_fd().unwrap();
    assert!(fd >= 0);
    let h = s.share_filename().unwrap();
    assert_eq!(s.to_vec(), pattern(1000, 2));
    assert_eq!(s.get_shared_fd().unwrap_err().kind(), ErrorKind::NotFound);
    drop(s);
    assert!(wait_until(Duration::from_secs(1), || !shm_exists(&h.filename)));
}

#[test]
fn opening_a_missing_name_fails_cleanly() {
    use_built_manager();
    let s = Storage::new_using_filename(10).unwrap();
    let h = s.share_filename().unwrap();
    let e = Storage::new_shared_filename(&h.manager_handle, "/torch_1_2_does_not_exist", 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = Storage::new_shared_filename("/nonexistent/manager.sock", &h.filename, 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = Storage::new_shared_filename(&h.manager_handle, &format!("/{}", "x".repeat(70)), 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NameTooLong, "{e}");
    let e = Storage::new_shared_filename(&h.manager_handle, &h.filename, 1 << 20).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{e}");
}
