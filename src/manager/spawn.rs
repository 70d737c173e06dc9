//! Starting a manager daemon for a process that has none (libshm's
//! `start_manager`): find the binary, run it, read the socket path it
//! prints on its first line (or its `ERROR: ...` line).
//!
//! The binary is looked up in this order: the path set with
//! [`set_manager_binary`]; the environment variable `SS_SHM_MANAGER`;
//! `ss_shm_manager` beside the shared library (or executable) holding this
//! code, then in `../bin` from there; `ss_shm_manager` on `PATH`.

use crate::error::{Error, ErrorKind, Result};
use once_cell::sync::Lazy;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// File name of the daemon.
pub const MANAGER_BINARY: &str = "ss_shm_manager";
/// Environment variable naming the daemon binary.
pub const MANAGER_ENV: &str = "SS_SHM_MANAGER";

static BINARY: Lazy<Mutex<Option<PathBuf>>> = Lazy::new(|| Mutex::new(None));

/// Uses `path` as the daemon binary from now on (libshm's `libshm_init`).
pub fn set_manager_binary(path: &str) -> Result<()> {
    if path.is_empty() {
        return Err(Error::new(ErrorKind::InvalidArgument, "empty shared memory manager binary path"));
    }
    *BINARY.lock().unwrap_or_else(|p| p.into_inner()) = Some(PathBuf::from(path));
    Ok(())
}

/// Where the daemon binary is, per the lookup order above.
pub fn find_manager_binary() -> Result<PathBuf> {
    if let Some(p) = BINARY.lock().unwrap_or_else(|p| p.into_inner()).clone() {
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
fn own_object_dir() -> Option<PathBuf> {
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
    let shown = binary.display().to_string();
    let mut child = Command::new(binary)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("could not start the shared memory manager \"{shown}\""))
        })?;
    let mut out = child.stdout.take().expect("stdout was piped");
    let mut line = Vec::new();
    let mut chunk = [0u8; 256];
    while !line.ends_with(b"\n") && line.len() < 4096 {
        match out.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => line.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("reading from the shared memory manager \"{shown}\"")))
            }
        }
    }
    drop(out);
    // The daemon outlives this call; a thread reaps it when it exits so it
    // never lingers as a zombie of the host process.
    let reaper = std::thread::Builder::new().name("ss-manager-reaper".into()).spawn(move || {
        let _ = child.wait();
    });
    if reaper.is_err() {
        // Without a thread the child stays unreaped until we exit; still usable.
    }
    let text = String::from_utf8_lossy(&line);
    let text = text.trim_end_matches('\n');
    if text.is_empty() {
        return Err(Error::new(ErrorKind::PeerGone, format!("no response from the shared memory manager at \"{shown}\"")));
    }
    if let Some(rest) = text.strip_prefix("ERROR: ").or_else(|| text.strip_prefix("ERROR")) {
        return Err(Error::new(ErrorKind::Io, format!("shared memory manager at \"{shown}\": {}", rest.trim())));
    }
    Ok(text.to_string())
}
