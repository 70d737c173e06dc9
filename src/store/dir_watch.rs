//! An inotify watch of a store's folder, so a wait wakes as soon as a key
//! file appears instead of sleeping through a polling interval. One watch
//! is shared by all waits on a store: see [`super::shared_watch`].

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

/// An inotify watch for files renamed into one folder.
pub struct DirWatch {
    fd: OwnedFd,
}

impl DirWatch {
    /// A watch on `dir`; `None` where inotify cannot be used (no more
    /// instances or descriptors, a file system without it): callers poll.
    pub fn new(dir: &Path) -> Option<DirWatch> {
        let path = CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: inotify_init1 takes flags only; a non-negative result is a
        // descriptor we now own.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        // SAFETY: raw is a fresh descriptor owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Key files only ever appear by rename (temporary files are created
        // in the same folder and would wake us for nothing).
        let mask = libc::IN_MOVED_TO;
        // SAFETY: a valid descriptor and NUL-terminated path.
        if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) } < 0 {
            return None;
        }
        Some(DirWatch { fd })
    }

    /// Waits until something happened in the folder or `limit` passed, and
    /// consumes the events; true when there were any.
    pub fn wait(&self, limit: Duration) -> bool {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = limit.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        self.drain()
    }

    /// Reads every pending event; true when there was one.
    fn drain(&self) -> bool {
        let mut buf = [0u8; 4096];
        let mut any = false;
        loop {
            // SAFETY: reads into a local buffer of its stated size.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return any;
            }
            any = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_rename_into_the_folder_wakes_the_wait() {
        let dir = std::env::temp_dir().join(format!("ss-dirwatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(DirWatch::new(&dir.join("missing")).is_none(), "no watch on a missing folder: callers poll");
        let w = DirWatch::new(&dir).unwrap();
        let d2 = dir.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            std::fs::write(d2.join(".tmp"), b"x").unwrap();
            std::fs::rename(d2.join(".tmp"), d2.join("k.x")).unwrap();
        });
        let t0 = Instant::now();
        // Woken by the rename, not by the 60 s limit.
        assert!(w.wait(Duration::from_secs(60)));
        assert!(t0.elapsed() < Duration::from_secs(30));
        assert!(!w.wait(Duration::from_millis(1)), "the events were consumed");
        t.join().unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}
