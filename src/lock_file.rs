//! Lock files that another user cannot hold against us: created 0600,
//! refused when someone else owns them, and locked with a deadline.
//!
//! `flock` needs only an open descriptor, and read permission is enough to
//! open: a lock file readable by others is one any local user can hold
//! exclusively for as long as they like. So the file is created 0600 (an
//! older one of ours with wider bits is narrowed), a link, FIFO or device
//! at its path is refused, a file of another owner is refused, and every
//! wait for the lock polls `LOCK_NB` until a deadline instead of blocking.

use crate::error::{Error, ErrorKind, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

/// Opens (creating it 0600 if missing) the lock file at `path`; `what`
/// names it in messages (`"lock file of file store </x>"`).
pub fn open_own(path: &Path, what: &str) -> Result<File> {
    let shown = || format!("{what} <{}>", path.display());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => Error::new(ErrorKind::Permission, format!("{} is a symbolic link; refused", shown())),
            Some(errno) => Error::from_errno(errno, format!("unable to open {}", shown())),
            None => Error::new(ErrorKind::Io, format!("unable to open {}: {e}", shown())),
        })?;
    let meta = file.metadata().map_err(|e| Error::new(ErrorKind::Io, format!("unable to stat {}: {e}", shown())))?;
    if !meta.is_file() {
        return Err(Error::new(ErrorKind::Corrupt, format!("{} is not a regular file; refused", shown())));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(Error::new(
            ErrorKind::Permission,
            format!(
                "{} belongs to uid {}, not to this user (uid {me}); refused: its owner could hold the lock for good",
                shown(),
                meta.uid()
            ),
        ));
    }
    if meta.mode() & 0o077 != 0 {
        // Ours, made by an older version with wider bits: narrow them, or
        // anyone who can read it can hold it.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::new(ErrorKind::Io, format!("unable to make {} private (mode 0600): {e}", shown())))?;
    }
    Ok(file)
}

/// `flock(op)` on `file` (`LOCK_SH` or `LOCK_EX`), polling without blocking
/// (50 µs doubling to 10 ms) until `end`; `None` waits as long as it takes.
/// Expiry is `Timeout` naming the file (`describe`) and the wait.
pub fn flock_until(file: &File, op: i32, end: Option<Instant>, describe: &dyn Fn() -> String) -> Result<()> {
    let started = Instant::now();
    let mut pause = Duration::from_micros(50);
    loop {
        // SAFETY: flock on a descriptor `file` owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        match crate::error::errno() {
            libc::EINTR => continue,
            libc::EWOULDBLOCK => {
                let now = Instant::now();
                if end.is_some_and(|e| now >= e) {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "timed out after {} ms waiting for the lock of {} (another process holds it)",
                            started.elapsed().as_millis(),
                            describe()
                        ),
                    ));
                }
                let left = end.map_or(pause, |e| e.saturating_duration_since(now));
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            errno => return Err(Error::from_errno(errno, format!("unable to lock {}", describe()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ss-lockfile-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn created_private_narrowed_and_links_refused() {
        let d = dir("mode");
        let p = d.join("lock");
        let f = open_own(&p, "lock file").unwrap();
        assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600);
        drop(f);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        open_own(&p, "lock file").unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        let link = d.join("link");
        std::os::unix::fs::symlink(d.join("elsewhere"), &link).unwrap();
        let e = open_own(&link, "lock file").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
        assert!(!d.join("elsewhere").exists());
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_held_lock_times_out() {
        let d = dir("held");
        let p = d.join("lock");
        let holder = open_own(&p, "lock file").unwrap();
        flock_until(&holder, libc::LOCK_EX, None, &|| "x".into()).unwrap();
        // Another open file description of the same file conflicts.
        let waiter = open_own(&p, "lock file").unwrap();
        let e =
            flock_until(&waiter, libc::LOCK_SH, Some(Instant::now() + Duration::from_millis(30)), &|| "the test lock".into()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.message().contains("the test lock"), "{}", e.message());
        drop(holder);
        flock_until(&waiter, libc::LOCK_SH, Some(Instant::now() + Duration::from_secs(10)), &|| "x".into()).unwrap();
        std::fs::remove_dir_all(d).unwrap();
    }
}
