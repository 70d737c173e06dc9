//! Starting a manager daemon for a process that has none (libshm's
//! `start_manager`): find the binary, run it, read the socket path it
//! prints on its first line (or its `ERROR: ...` line) within
//! [`START_TIMEOUT`].
//!
//! The binary is looked up in this order: the path set with
//! [`set_manager_binary`]; the environment variable `SS_SHM_MANAGER`;
//! `ss_shm_manager` beside the shared library (or executable) holding this
//! code, then in `../bin` from there; `ss_shm_manager` on `PATH`.

use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// File name of the daemon.
pub const MANAGER_BINARY: &str = "ss_shm_manager";
/// Environment variable naming the daemon binary.
pub const MANAGER_ENV: &str = "SS_SHM_MANAGER";

/// How long a started daemon may take to print its socket path.
pub const START_TIMEOUT: Duration = Duration::from_secs(5);

static BINARY: ForkSafeMutex<Option<PathBuf>> = ForkSafeMutex::new(None);

/// Uses `path` as the daemon binary from now on (libshm's `libshm_init`).
pub fn set_manager_binary(path: &str) -> Result<()> {
    if path.is_empty() {
        return Err(Error::new(ErrorKind::InvalidArgument, "empty shared memory manager binary path"));
    }
    *BINARY.lock_static() = Some(PathBuf::from(path));
    Ok(())
}

/// Where the daemon binary is, per the lookup order above.
pub fn find_manager_binary() -> Result<PathBuf> {
    if let Some(p) = BINARY.lock_static().clone() {
        return Ok(p);
    }
    if let Some(p) = std::env::var_os(MANAGER_ENV).filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let mut tried = Vec::new();
    if let Some(dir) = own_object_dir() {
        for candidate in [dir.join(MANAGER_BINARY), dir.join("../bin").join(MANAGER_BINARY)] {
            if is_executable(&candidate) {
                return Ok(candidate);
            }
            tried.push(candidate.display().to_string());
        }
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join(MANAGER_BINARY);
            if is_executable(&candidate) {
                return Ok(candidate);
            }
        }
    }
    tried.push("$PATH".to_string());
    Err(Error::new(
        ErrorKind::NotFound,
        format!("could not find the {MANAGER_BINARY} binary: set {MANAGER_ENV}; looked in {}", tried.join(", ")),
    ))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Folder of the shared object (or executable) this function is part of.
pub fn own_object_dir() -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data that dladdr fills in; the address is a
    // function of this object, so dladdr resolves it to our own file.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = own_object_dir as *const () as *const libc::c_void;
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
    let file = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_str().ok()?;
    let file = if file.contains('/') { PathBuf::from(file) } else { std::env::current_exe().ok()? };
    std::fs::canonicalize(file).ok()?.parent().map(Path::to_path_buf)
}

/// Starts a daemon and returns its socket path.
pub fn spawn_manager() -> Result<String> {
    let binary = find_manager_binary()?;
    spawn_manager_at(&binary)
}

/// Starts the daemon `binary` (ours or torch_shm_manager) and returns the
/// socket path it prints.
pub fn spawn_manager_at(binary: &Path) -> Result<String> {
    spawn_manager_then(binary, |_| Ok(())).map(|(path, ())| path)
}

/// Starts the daemon `binary`, then runs `use_it` on its socket path
/// (e.g. connects to it). If anything fails, the daemon is stopped.
pub fn spawn_manager_then<T>(binary: &Path, use_it: impl FnOnce(&str) -> Result<T>) -> Result<(String, T)> {
    let mut started = Started::run(binary)?;
    let path = started.socket_path()?;
    let value = use_it(&path)?;
    started.keep();
    Ok((path, value))
}

/// A daemon being started. Unless [`Started::keep`] is called, dropping it
/// kills and reaps the daemon: a failed start never leaves one running.
struct Started {
    child: Option<Child>,
    shown: String,
}

impl Started {
    fn run(binary: &Path) -> Result<Self> {
        let shown = binary.display().to_string();
        let child = Command::new(binary).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("could not start the shared memory manager \"{shown}\""))
        })?;
        Ok(Started { child: Some(child), shown })
    }

    /// The socket path the daemon printed, checked to be one we can use.
    fn socket_path(&mut self) -> Result<String> {
        let shown = &self.shown;
        let out = self.child.as_mut().and_then(|c| c.stdout.take());
        let line = match out {
            Some(out) => read_first_line(out, shown, START_TIMEOUT)?,
            None => return Err(Error::new(ErrorKind::Io, format!("no stdout pipe to the shared memory manager \"{shown}\""))),
        };
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches('\n');
        if text.is_empty() {
            return Err(Error::new(ErrorKind::PeerGone, format!("no response from the shared memory manager at \"{shown}\"")));
        }
        if let Some(rest) = text.strip_prefix("ERROR: ").or_else(|| text.strip_prefix("ERROR")) {
            return Err(Error::new(ErrorKind::Io, format!("shared memory manager at \"{shown}\": {}", rest.trim())));
        }
        check_socket_path(text, shown)?;
        Ok(text.to_string())
    }

    /// The daemon outlives this call; a thread reaps it when it exits so
    /// it never lingers as a zombie of the host process.
    fn keep(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = std::thread::Builder::new().name("ss-manager-reaper".into()).spawn(move || {
                let _ = child.wait();
            });
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A path a client can connect to: fits sun_path (107 bytes and the NUL)
/// and names a socket.
fn check_socket_path(path: &str, shown: &str) -> Result<()> {
    if path.len() >= 108 {
        return Err(Error::new(
            ErrorKind::NameTooLong,
            format!(
                "the shared memory manager \"{shown}\" printed a socket path of {} bytes, at most 107 fit: <{path}>; it was stopped",
                path.len()
            ),
        ));
    }
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_socket() => Ok(()),
        Ok(_) => Err(Error::new(
            ErrorKind::Protocol,
            format!("the shared memory manager \"{shown}\" printed <{path}>, which is not a socket; it was stopped"),
        )),
        Err(e) => Err(Error::from_errno(
            e.raw_os_error().unwrap_or(libc::EIO),
            format!("the shared memory manager \"{shown}\" printed the socket path <{path}>, which cannot be used; it was stopped"),
        )),
    }
}

/// The daemon's first line (up to 4 KiB), or what it wrote before closing;
/// a `Timeout` error when it has written no full line after `limit`.
fn read_first_line(mut out: std::process::ChildStdout, shown: &str, limit: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + limit;
    let mut line = Vec::new();
    let mut chunk = [0u8; 256];
    while !line.ends_with(b"\n") && line.len() < 4096 {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd { fd: out.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as libc::c_int) };
        if n == 0 {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("the shared memory manager \"{shown}\" printed no socket path within {} ms", limit.as_millis()),
            ));
        }
        if n < 0 {
            let errno = crate::error::errno();
            if errno == libc::EINTR {
                continue;
            }
            return Err(Error::from_errno(errno, format!("waiting for the shared memory manager \"{shown}\"")));
        }
        match out.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => line.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Error::from_errno(
                    e.raw_os_error().unwrap_or(libc::EIO),
                    format!("reading from the shared memory manager \"{shown}\""),
                ))
            }
        }
    }
    Ok(line)
}
