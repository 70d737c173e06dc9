//! Another local user (uid 65534) against the files our stores lock and
//! log in: a folder FileStore's `.lock`, a content store's `.ss-lock`, and
//! a PyTorch-format FileStore file in a folder both can write.
//!
//! - Lock files are created 0600: the stranger cannot even open them, so
//!   cannot hold them (they were 0644, and `flock` needs only a read open).
//! - A lock file the stranger made is refused, naming its owner.
//! - A lock held by a process of our own user makes writers wait no longer
//!   than the store's lock timeout (they waited forever).
//! - A FIFO, a dangling symbolic link or a stranger's regular file at a
//!   PyTorch FileStore path is refused at once with a clear error (a FIFO
//!   made `get` with a 2 s timeout block forever in `open`; the link made
//!   us create the file where the stranger chose).
//!
//! The stranger's steps run in a forked child that drops to uid 65534;
//! the tests need root for that and say so when skipped.

#[path = "../common/nobody.rs"]
mod nobody;

use nobody::NobodyDir;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;
use storage_sharing::content_store::layout::Format;
use storage_sharing::content_store::writer::Writer;
use storage_sharing::store::{FileStore, Store, TorchFileStore};
use storage_sharing::ErrorKind;

fn am_root() -> bool {
    // SAFETY: geteuid has no side effects.
    unsafe { libc::geteuid() == 0 }
}

fn skip_unless_root(test: &str) -> bool {
    if !am_root() {
        eprintln!("SKIPPED {test}: needs root to play another user (uid 65534)");
    }
    !am_root()
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// A folder anyone may write in (0777, not sticky: a shared folder where
/// either user may also rename or remove the other's files).
fn shared_folder(base: &NobodyDir, name: &str) -> std::path::PathBuf {
    let d = base.path.join(name);
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

/// A forked child running as uid 65534: it runs `act` (async-signal-safe
/// calls only, on memory prepared before the fork), reports its result
/// byte through a pipe, and, when that byte is 0, stays (holding what it
/// took) until dropped.
struct Stranger {
    pid: libc::pid_t,
    /// What `act` returned: 0, or an errno.
    result: u8,
}

impl Stranger {
    fn run(act: impl FnOnce() -> u8) -> Stranger {
        let mut fds = [0; 2];
        // SAFETY: a two-int array for pipe(2).
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: the child makes only async-signal-safe calls and never
        // returns into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            unsafe {
                libc::close(fds[0]);
                if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    libc::_exit(2);
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() == 1 {
                    libc::_exit(3);
                }
                let r = act();
                libc::write(fds[1], (&r as *const u8).cast(), 1);
                if r != 0 {
                    libc::_exit(0);
                }
                loop {
                    libc::pause();
                }
            }
        }
        // SAFETY: our copy of the write end.
        unsafe { libc::close(fds[1]) };
        let mut result = 255u8;
        // SAFETY: reads one byte into `result`; EOF leaves 255 (the child died).
        unsafe { libc::read(fds[0], (&mut result as *mut u8).cast(), 1) };
        // SAFETY: our read end.
        unsafe { libc::close(fds[0]) };
        Stranger { pid, result }
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        // SAFETY: our own child, killed and reaped once.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

fn errno() -> u8 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(255).min(254) as u8
}

/// The stranger opens `path` read-only and holds an exclusive flock on it.
fn hold_lock(path: &Path) -> Stranger {
    let p = c(path);
    Stranger::run(move || unsafe {
        let fd = libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK);
        if fd < 0 {
            return errno();
        }
        if libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) != 0 {
            return errno();
        }
        0
    })
}

/// The stranger creates `path` (a regular file, mode 0666) and holds an
/// exclusive flock on it.
fn plant_held_lock(path: &Path) -> Stranger {
    let p = c(path);
    Stranger::run(move || unsafe {
        let fd = libc::open(p.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o666);
        if fd < 0 || libc::fchmod(fd, 0o666) != 0 {
            return errno();
        }
        if libc::flock(fd, libc::LOCK_EX) != 0 {
            return errno();
        }
        0
    })
}

/// Runs `f` on a thread and gives up after `limit` (the old code hung):
/// a hang is a test failure, not a stuck test run.
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("{what} still blocked after {limit:?}"))
}

const HANG: Duration = Duration::from_secs(20);

#[test]
fn folder_store_lock_cannot_be_held_by_another_user_and_waits_are_bounded() {
    if skip_unless_root("folder_store_lock_cannot_be_held_by_another_user_and_waits_are_bounded") {
        return;
    }
    let base = NobodyDir::new("fslock");
    let dir = base.path.join("store");
    let store = FileStore::open(&dir).unwrap();
    let lock = dir.join(".lock");
    assert_eq!(std::fs::metadata(&lock).unwrap().mode() & 0o777, 0o600, ".lock must be private");
    {
        let stranger = hold_lock(&lock);
        assert_eq!(stranger.result, libc::EACCES as u8, "uid 65534 could open and flock our .lock (result {})", stranger.result);
    }
    store.set(b"k", b"v").unwrap();

    // A stranger's .lock in a shared folder: refused, naming the owner.
    let shared = shared_folder(&base, "shared");
    let theirs = shared.join("store");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o777)).unwrap();
    let stranger = plant_held_lock(&theirs.join(".lock"));
    assert_eq!(stranger.result, 0, "the stranger could not plant its lock file");
    let e = within(HANG, "opening a store whose .lock a stranger holds", move || {
        FileStore::open(&theirs).and_then(|s| s.set(b"k", b"v")).expect_err("a stranger's .lock was accepted")
    });
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("uid 65534") && e.message().contains(".lock"), "{}", e.message());
    drop(stranger);

    // Our own user holding the lock (a stuck writer): writes time out.
    let ours = std::fs::File::open(&lock).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(ours.as_raw_fd(), libc::LOCK_EX) }, 0);
    let store = FileStore::open_with_lock_timeout(&dir, Some(Duration::from_millis(200))).unwrap();
    let e = within(HANG, "a set while the lock is held", move || store.set(b"k", b"w").unwrap_err());
    assert_eq!(e.kind(), ErrorKind::Timeout, "{}", e.message());
    assert!(e.message().contains("lock") && e.message().contains(&dir.display().to_string()), "{}", e.message());
}

#[test]
fn content_store_lock_cannot_be_held_by_another_user_and_waits_are_bounded() {
    if skip_unless_root("content_store_lock_cannot_be_held_by_another_user_and_waits_are_bounded") {
        return;
    }
    let base = NobodyDir::new("cslock");
    let root = base.path.join("cs");
    drop(Writer::open(&root, Format::Native).unwrap());
    let lock = root.join(".ss-lock");
    assert_eq!(std::fs::metadata(&lock).unwrap().mode() & 0o777, 0o600, ".ss-lock must be private");
    {
        let stranger = hold_lock(&lock);
        assert_eq!(stranger.result, libc::EACCES as u8, "uid 65534 could open and flock our .ss-lock (result {})", stranger.result);
    }

    let shared = shared_folder(&base, "shared");
    let theirs = shared.join("cs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o777)).unwrap();
    let stranger = plant_held_lock(&theirs.join(".ss-lock"));
    assert_eq!(stranger.result, 0, "the stranger could not plant its lock file");
    let e = within(HANG, "opening a writer on a store whose .ss-lock a stranger holds", move || {
        Writer::open(&theirs, Format::Native).err().expect("a stranger's .ss-lock was accepted")
    });
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("uid 65534") && e.message().contains(".ss-lock"), "{}", e.message());
    drop(stranger);

    let ours = std::fs::File::open(&lock).unwrap();
    // SAFETY: flock on a descriptor we own (as a gc does).
    assert_eq!(unsafe { libc::flock(ours.as_raw_fd(), libc::LOCK_EX) }, 0);
    let r = root.clone();
    let e = within(HANG, "a writer while the lock is held", move || {
        Writer::open_with_lock_wait(&r, Format::Native, Duration::from_millis(200)).err().expect("opened under a held lock")
    });
    assert_eq!(e.kind(), ErrorKind::Timeout, "{}", e.message());
    assert!(e.message().contains(".ss-lock"), "{}", e.message());
}

#[test]
fn pytorch_filestore_path_refuses_a_fifo_a_link_and_a_strangers_file() {
    if skip_unless_root("pytorch_filestore_path_refuses_a_fifo_a_link_and_a_strangers_file") {
        return;
    }
    let base = NobodyDir::new("torchfs");
    let shared = shared_folder(&base, "shared");
    let timeout = Some(Duration::from_secs(2));

    // Our store, then the stranger swaps its file for a FIFO.
    let path = shared.join("store");
    let store = TorchFileStore::open(&path, -1, timeout).unwrap();
    store.set(b"k", b"v").unwrap();
    let (p, fifo) = (c(&path), c(&path));
    let stranger = Stranger::run(move || unsafe {
        if libc::unlink(p.as_ptr()) != 0 || libc::mkfifo(fifo.as_ptr(), 0o666) != 0 {
            return errno();
        }
        0
    });
    assert_eq!(stranger.result, 0, "the stranger could not plant the FIFO");
    let e = within(HANG, "get on a FIFO", move || store.get(b"k", timeout).unwrap_err());
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("FIFO"), "{}", e.message());
    let p = path.clone();
    let e = within(HANG, "open on a FIFO", move || TorchFileStore::open(&p, -1, timeout).err().expect("a FIFO was accepted"));
    assert!(e.message().contains("FIFO"), "{}", e.message());

    // A dangling link: nothing is created where it points.
    let link = shared.join("linked");
    let target = shared.join("chosen-by-stranger");
    let (l, t) = (c(&link), c(&target));
    let stranger = Stranger::run(move || unsafe {
        if libc::symlink(t.as_ptr(), l.as_ptr()) != 0 {
            return errno();
        }
        0
    });
    assert_eq!(stranger.result, 0);
    let e = within(HANG, "open through a link", move || TorchFileStore::open(&link, -1, timeout).err().expect("a link was followed"));
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("symbolic link"), "{}", e.message());
    assert!(std::fs::symlink_metadata(&target).is_err(), "the link's target was created");

    // A regular file of the stranger's: they could rewrite it under us.
    let theirs = shared.join("theirs");
    let t = c(&theirs);
    let stranger = Stranger::run(move || unsafe {
        let fd = libc::open(t.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o666);
        if fd < 0 || libc::fchmod(fd, 0o666) != 0 {
            return errno();
        }
        0
    });
    assert_eq!(stranger.result, 0);
    let e = within(HANG, "open of a stranger's file", move || TorchFileStore::open(&theirs, -1, timeout).err().expect("accepted"));
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("uid 65534"), "{}", e.message());
    drop(stranger);
}
