//! The manager daemon against bad and busy clients: malformed, short,
//! oversized and garbage messages, a silent client, many clients at once.
//! It keeps serving and loses no registration.

#[path = "../common/mod.rs"]
mod common;

use common::{manager_bin, shm_exists, wait_until};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;
use storage_sharing::manager::protocol::AllocInfo;
use storage_sharing::manager::spawn::spawn_manager_at;
use storage_sharing::manager::Client;
use storage_sharing::shm::new_process_wide_shm_handle;
use storage_sharing::ErrorKind;

const LIMIT: Duration = Duration::from_secs(15);

fn start() -> String {
    spawn_manager_at(&manager_bin()).unwrap()
}

fn connect(path: &str) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Registers over a raw stream and expects "OK".
fn register(s: &mut UnixStream, name: &str) {
    s.write_all(&AllocInfo::new(std::process::id() as i32, false, name).unwrap().encode()).unwrap();
    let mut ok = [0u8; 2];
    s.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"OK");
}

/// A segment nobody maps, as a killed client leaves it.
fn create_unmapped(name: &str, size: i64) {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscalls on a name we own.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, size), 0);
        libc::close(fd);
    }
}

fn unlink(name: &str) {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscall.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

/// True when the manager closed our connection.
fn closed_by_manager(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 8];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn prints_socket_in_private_dir_and_exits_when_idle() {
    let path = start();
    assert!(path.ends_with("/manager.sock"), "{path}");
    let dir = Path::new(&path).parent().unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert!(dir.file_name().unwrap().to_str().unwrap().starts_with("torch-shm-dir-"));
    let mut s = connect(&path);
    register(&mut s, &new_process_wide_shm_handle());
    drop(s);
    assert!(wait_until(LIMIT, || !dir.exists()), "manager did not exit and clean up");
}

#[test]
fn refuses_arguments_with_an_error_line() {
    let out = std::process::Command::new(manager_bin()).arg("--bogus").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ERROR: "));
}

#[test]
fn garbage_and_malformed_messages_drop_only_that_client() {
    let path = start();
    let mut keeper = connect(&path);
    register(&mut keeper, &new_process_wide_shm_handle());
    let bad: Vec<Vec<u8>> = vec![
        vec![0xff; 68], // no NUL in the name field
        vec![0; 68],    // empty name
        {
            let mut m = AllocInfo::new(1, false, "/a").unwrap().encode().to_vec();
            m[6] = b'/';
            m[7] = b'b'; // "//b": not a shm name
            m
        },
        AllocInfo::new(1, false, "no_slash").unwrap().encode().to_vec(),
        {
            let mut m = AllocInfo::new(1, false, "/x").unwrap().encode().to_vec();
            m[6] = 0xc3; // invalid UTF-8
            m
        },
        vec![b'A'; 100_000], // oversized stream of junk
    ];
    for msg in bad {
        let mut s = connect(&path);
        let _ = s.write_all(&msg);
        assert!(closed_by_manager(&mut s));
    }
    // The manager still serves, on the old connection and on new ones.
    register(&mut keeper, &new_process_wide_shm_handle());
    let mut fresh = connect(&path);
    register(&mut fresh, &new_process_wide_shm_handle());
}

#[test]
fn short_and_silent_clients_block_nobody() {
    let path = start();
    let silent = connect(&path);
    let mut short = connect(&path);
    short.write_all(&[1, 2, 3, 4, 0, b'/', b'x']).unwrap(); // 7 of 68 bytes
    let client = Client::connect(&path).unwrap();
    for _ in 0..100 {
        client.register(&new_process_wide_shm_handle()).unwrap();
    }
    // The rest of the short message arrives later: it is a registration.
    let name = new_process_wide_shm_handle();
    let full = AllocInfo::new(4, false, &name).unwrap().encode();
    short.write_all(&full[7..]).unwrap();
    let mut ok = [0u8; 2];
    short.read_exact(&mut ok).unwrap();
    // The 7 bytes were "/x" from pid 0x04030201: that is what was registered.
    assert_eq!(&ok, b"OK");
    drop(silent);
}

#[test]
fn split_and_batched_messages_are_all_answered() {
    let path = start();
    let mut s = connect(&path);
    let mut batch = Vec::new();
    for _ in 0..50 {
        batch.extend_from_slice(&AllocInfo::new(1, false, &new_process_wide_shm_handle()).unwrap().encode());
    }
    for chunk in batch.chunks(29) {
        s.write_all(chunk).unwrap();
    }
    let mut oks = vec![0u8; 100];
    s.read_exact(&mut oks).unwrap();
    assert!(oks.chunks(2).all(|c| c == b"OK"));
    // A free gets no reply; an unknown free is ignored.
    s.write_all(&AllocInfo::new(1, true, "/torch_never_registered").unwrap().encode()).unwrap();
    register(&mut s, &new_process_wide_shm_handle());
}

#[test]
fn many_clients_at_once_lose_no_registration() {
    let path = start();
    const CLIENTS: usize = 48;
    const EACH: usize = 20;
    let names: Vec<Vec<String>> = (0..CLIENTS).map(|_| (0..EACH).map(|_| new_process_wide_shm_handle()).collect()).collect();
    let threads: Vec<_> = names
        .iter()
        .cloned()
        .map(|mine| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut s = connect(&path);
                for n in &mine {
                    register(&mut s, n);
                    create_unmapped(n, 4096);
                }
                // Gone without freeing: like a killed client.
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Every registration was kept: every segment is removed.
    let all: Vec<&String> = names.iter().flatten().collect();
    let ok = wait_until(LIMIT, || all.iter().all(|n| !shm_exists(n)));
    let left: Vec<&&String> = all.iter().filter(|n| shm_exists(n)).collect();
    for n in &left {
        unlink(n);
    }
    assert!(ok, "{} of {} segments left", left.len(), all.len());
}

#[test]
fn client_gone_without_free_leaves_a_mapped_segment_alone() {
    let path = start();
    let name = new_process_wide_shm_handle();
    let mut s = connect(&path);
    register(&mut s, &name);
    create_unmapped(&name, 8192);
    // This process maps it (raw, so that unmapping does not unlink it):
    // the manager must keep it after the client goes...
    let c = CString::new(name.clone()).unwrap();
    // SAFETY: plain syscalls on our own segment.
    let (fd, p) = unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
        assert!(fd >= 0);
        let p = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_SHARED, fd, 0);
        assert_ne!(p, libc::MAP_FAILED);
        libc::close(fd);
        (fd, p)
    };
    let _ = fd;
    drop(s);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(shm_exists(&name), "a mapped segment was removed");
    // ...and remove it once the last mapping is gone.
    // SAFETY: unmapping what we mapped above.
    unsafe { libc::munmap(p, 8192) };
    let gone = wait_until(LIMIT, || !shm_exists(&name));
    unlink(&name);
    assert!(gone, "{name} left after its last user unmapped it");
    assert!(wait_until(LIMIT, || !Path::new(&path).exists()));
}

#[test]
fn client_errors_are_specific() {
    let path = start();
    let c = Client::connect_with_timeout(&path, Duration::from_millis(300)).unwrap();
    let e = c.register(&format!("/{}", "n".repeat(60))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NameTooLong);
    assert!(e.message().contains("MapAllocatorContext_filename too long"), "{e}");
    // Fake managers: one that never answers, one that answers garbage,
    // one that hangs up. Registrations are pipelined, so the failure shows
    // at sync() or at the next call, and then sticks to the connection.
    let dir = std::env::temp_dir().join(format!("ss-fake-mgr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("m.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let sock = sock.to_str().unwrap().to_string();
    // Each fake answers the registration that offers the registration log
    // at connect with `OK`, as libshm's manager does: the client keeps
    // using the socket.
    let client = || {
        let c = Client::connect_with_timeout(&sock, Duration::from_millis(300)).unwrap();
        let mut conn = listener.accept().unwrap().0;
        conn.write_all(b"OK").unwrap();
        (c, conn)
    };

    let (silent, _conn) = client();
    silent.register("/torch_1_2_3").unwrap();
    let e = silent.sync().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("timed out") && e.message().contains(&sock), "{e}");
    assert_eq!(silent.register("/torch_1_2_3").unwrap_err().kind(), ErrorKind::Timeout);
    assert!(silent.is_broken());

    let (patient, _conn) = client();
    for _ in 0..storage_sharing::manager::client::MAX_OWED_REPLIES {
        patient.register("/torch_1_2_3").unwrap();
    }
    assert_eq!(patient.register("/torch_1_2_3").unwrap_err().kind(), ErrorKind::Timeout);

    let (garbled, mut conn) = client();
    garbled.register("/torch_1_2_3").unwrap();
    conn.write_all(b"NO").unwrap();
    let e = garbled.sync().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.message().contains("didn't respond with an OK"), "{e}");

    let (hung_up, conn) = client();
    hung_up.register("/torch_1_2_3").unwrap();
    drop(conn);
    let e = hung_up.sync().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");

    // A split "OK" is still one reply.
    let (split, mut conn) = client();
    split.register("/torch_1_2_3").unwrap();
    split.register("/torch_1_2_4").unwrap();
    conn.write_all(b"OKO").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    split.register("/torch_1_2_5").unwrap();
    conn.write_all(b"KOK").unwrap();
    split.sync().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_cleans_up_what_nobody_uses() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(manager_bin()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let path = line.trim().to_string();
    let (unused, used) = (new_process_wide_shm_handle(), new_process_wide_shm_handle());
    let mut s = connect(&path);
    register(&mut s, &unused);
    register(&mut s, &used);
    create_unmapped(&unused, 4096);
    create_unmapped(&used, 4096);
    let c = CString::new(used.clone()).unwrap();
    // SAFETY: plain syscall; the descriptor keeps `used` in use.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0) };
    assert!(fd >= 0);
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let st = child.wait().unwrap();
    assert!(st.success(), "{st}");
    assert!(!shm_exists(&unused));
    assert!(shm_exists(&used), "a segment in use was removed");
    assert!(!Path::new(&path).parent().unwrap().exists());
    // SAFETY: closing what we opened.
    unsafe { libc::close(fd) };
    unlink(&used);
}

#[test]
fn daemon_does_not_keep_the_spawners_descriptors() {
    // A socketpair without close-on-exec, open while the daemon starts:
    // the daemon must not hold our end's peer open.
    let mut sv = [0i32; 2];
    // SAFETY: socketpair fills sv.
    assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, sv.as_mut_ptr()) }, 0);
    let path = start();
    let mut s = connect(&path);
    register(&mut s, &new_process_wide_shm_handle());
    // SAFETY: closing our copy of the peer end; reading the other end.
    unsafe { libc::close(sv[1]) };
    let mut b = [0u8; 1];
    // A child that a sibling test is spawning holds a copy until it execs
    // (or, a daemon, until it closes what it inherited), so look for a
    // while: the daemon lives on, and a copy it kept would never go.
    let peer_closed = wait_until(Duration::from_secs(10), || {
        // SAFETY: reading into a 1-byte buffer.
        unsafe { libc::recv(sv[0], b.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) == 0 }
    });
    assert!(peer_closed, "the peer end is still open somewhere (the daemon?)");
    // SAFETY: closing what we opened.
    unsafe { libc::close(sv[0]) };
}

/// The manager's pid, from the connected socket's peer credentials.
fn peer_pid(s: &UnixStream) -> i32 {
    use std::os::fd::AsRawFd;
    storage_sharing::fdpass::peer::credentials(s.as_raw_fd()).expect("SO_PEERCRED of a connected socket").0
}

/// Found by the chaos soak (`ss_soak --only arena`): a client that sent
/// several registrations and was killed before the manager read them left
/// all but the first in /dev/shm. The reply to the first failed (the
/// socket was closed), and the manager dropped the session without
/// recording the registrations behind it. The manager is stopped while the
/// client writes and closes, so it finds all of them waiting at once.
#[test]
fn registrations_of_a_client_gone_before_the_replies_are_all_abandoned() {
    let path = start();
    let s = connect(&path);
    let manager = peer_pid(&s);
    let names: Vec<String> = (0..3).map(|_| new_process_wide_shm_handle()).collect();
    let mut batch = Vec::new();
    for n in &names {
        create_unmapped(n, 4096);
        batch.extend_from_slice(&AllocInfo::new(std::process::id() as i32, false, n).unwrap().encode());
    }
    // SAFETY: signals to the daemon this test started.
    assert_eq!(unsafe { libc::kill(manager, libc::SIGSTOP) }, 0);
    (&s).write_all(&batch).unwrap();
    drop(s);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(manager, libc::SIGCONT) }, 0);
    let gone = wait_until(LIMIT, || names.iter().all(|n| !shm_exists(n)));
    let left: Vec<&String> = names.iter().filter(|n| shm_exists(n)).collect();
    for n in &names {
        unlink(n);
    }
    assert!(gone, "registered names of a client gone before its replies left in /dev/shm: {left:?}");
}

/// Sets the modification time of `path` to `secs` seconds ago.
fn backdate(path: &Path, secs: i64) {
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: plain data.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let then = libc::timespec { tv_sec: now.tv_sec - secs, tv_nsec: 0 };
    let times = [then, then];
    // SAFETY: a NUL-terminated path and two timespecs.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) }, 0);
}

/// Found by the chaos soak (561 folders after as many manager kills): a
/// daemon killed with -9 leaves its socket folder in the temporary
/// directory for good. The next daemon to start removes such folders
/// (nothing listens on their socket); a live daemon's stays.
#[test]
fn a_killed_managers_socket_folder_is_swept_by_the_next_daemon() {
    let killed = start();
    let s = connect(&killed);
    let pid = peer_pid(&s);
    drop(s);
    // SAFETY: a signal to the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // SAFETY: probing the pid only.
    assert!(wait_until(LIMIT, || unsafe { libc::kill(pid, 0) } != 0), "the daemon survived SIGKILL");
    let killed_dir = Path::new(&killed).parent().unwrap().to_path_buf();
    assert!(killed_dir.exists(), "a killed daemon cannot remove its folder");
    // A live daemon, kept busy by a connection, whose socket is as old.
    let live = start();
    let _keep = connect(&live);
    for sock in [&killed, &live] {
        backdate(Path::new(sock), 120);
    }
    let next = start();
    let swept = wait_until(LIMIT, || !killed_dir.exists());
    assert!(Path::new(&live).exists(), "the folder of a live daemon was swept");
    assert!(Path::new(&next).exists());
    assert!(swept, "{} left after a new daemon started", killed_dir.display());
}
