//! Running test binaries as another user (uid 65534): a folder that user
//! can enter, holding copies of the binaries it runs.

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// A fresh folder that uid 65534 can enter (mode 0755, under the first of
/// TMPDIR, /tmp, /var/tmp whose every ancestor it can traverse), removed on
/// drop: the tests that run a binary as nobody run a copy from here.
pub struct NobodyDir {
    pub path: std::path::PathBuf,
}

impl NobodyDir {
    pub fn new(tag: &str) -> NobodyDir {
        let others_can_enter = |dir: &std::path::Path| {
            dir.ancestors().all(|d| std::fs::metadata(d).map(|m| m.permissions().mode() & 0o001 != 0).unwrap_or(false))
        };
        let base = [std::env::temp_dir(), "/tmp".into(), "/var/tmp".into()]
            .into_iter()
            .find(|d| others_can_enter(d))
            .expect("no folder that uid 65534 can traverse among TMPDIR, /tmp, /var/tmp");
        let path = base.join(format!("ss-nobody-{tag}-{}", std::process::id()));
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        NobodyDir { path }
    }

    /// A copy of `bin` in this folder that anyone may run.
    pub fn copy_of(&self, bin: &std::path::Path) -> std::path::PathBuf {
        let copy = self.path.join(bin.file_name().unwrap());
        std::fs::copy(bin, &copy).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        copy
    }
}

/// Runs `exec` (a spawn of a freshly copied binary) again while it fails
/// with ETXTBSY: a child that another test thread forks while the copy's
/// descriptor is open holds it until that child execs.
pub fn retry_while_busy<T>(mut exec: impl FnMut() -> std::io::Result<T>) -> T {
    for _ in 0..200 {
        match exec() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => std::thread::sleep(std::time::Duration::from_millis(10)),
            other => return other.unwrap(),
        }
    }
    exec().unwrap()
}

impl Drop for NobodyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Makes `cmd` drop to uid and gid 65534 (nobody), with no supplementary
/// groups, between fork and exec: the process it runs plays another user.
pub fn run_as_nobody(cmd: &mut Command) {
    // SAFETY: only async-signal-safe syscalls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
