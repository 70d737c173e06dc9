//! File-system steps of the content store: files written atomically
//! (temporary file in the same folder, fsync, rename, folder fsync), and
//! files opened from a possibly hostile folder without following links or
//! blocking on FIFOs.

use super::names::TEMP_PREFIX;
use crate::error::{Error, ErrorKind, Result};
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::Mode;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

fn io_error(e: std::io::Error, what: impl std::fmt::Display) -> Error {
    match e.raw_os_error() {
        Some(errno) => Error::from_errno(errno, what),
        None => Error::new(ErrorKind::Io, format!("{what}: {e}")),
    }
}

/// fsync of a folder, so a rename or a new entry in it survives a crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let f = File::open(dir).map_err(|e| io_error(e, format!("unable to open folder {} to fsync it", dir.display())))?;
    f.sync_all().map_err(|e| io_error(e, format!("unable to fsync folder {}", dir.display())))
}

/// Makes `base/parts...` as real folders (no symbolic links followed),
/// fsyncing each parent that got a new entry. Returns the deepest folder.
pub fn make_dirs(base: &Path, parts: &[&str]) -> Result<PathBuf> {
    let mut dir = base.to_path_buf();
    for part in parts {
        let next = dir.join(part);
        match std::fs::create_dir(&next) {
            Ok(()) => sync_dir(&dir)?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error(e, format!("unable to create folder {}", next.display()))),
        }
        let meta = std::fs::symlink_metadata(&next).map_err(|e| io_error(e, format!("unable to stat {}", next.display())))?;
        if !meta.is_dir() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("{} exists and is not a folder (a tensor of that name, or a link)", next.display()),
            ));
        }
        dir = next;
    }
    Ok(dir)
}

/// A name for a temporary file, unique in this process and across
/// processes (the pid), with the prefix listings skip and gc removes.
fn temp_name() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{TEMP_PREFIX}{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Writes `dir/name` atomically: the bytes go to a temporary file in
/// `dir`, which is fsynced and renamed over `name`, then `dir` is
/// fsynced. A crash at any moment leaves either no `name` or a complete
/// one (and maybe a temporary file, which `gc` removes). With `durable`
/// false both fsyncs are skipped: a killed process still never leaves a
/// partial file under `name`, but a power loss may.
pub fn write_atomic(dir: &Path, name: &str, durable: bool, fill: impl FnOnce(&mut File) -> std::io::Result<()>) -> Result<()> {
    let tmp = dir.join(temp_name());
    let dest = dir.join(name);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(|e| io_error(e, format!("unable to create {}", tmp.display())))?;
        fill(&mut f).map_err(|e| io_error(e, format!("unable to write {}", tmp.display())))?;
        if durable {
            f.sync_all().map_err(|e| io_error(e, format!("unable to fsync {}", tmp.display())))?;
        }
        drop(f);
        if std::fs::symlink_metadata(&dest).is_ok_and(|m| m.is_dir()) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("{} is a folder (it holds other tensors)", dest.display())));
        }
        std::fs::rename(&tmp, &dest).map_err(|e| io_error(e, format!("unable to rename {} to {}", tmp.display(), dest.display())))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    if durable {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Writes all of `data` to `f` (used by [`write_atomic`] callers).
pub fn write_all(f: &mut File, data: &[u8]) -> std::io::Result<()> {
    f.write_all(data)
}

/// Opens the root folder of a store (following a link there is fine: the
/// caller chose the path).
pub fn open_root(root: &Path) -> Result<OwnedFd> {
    open_raw(None, root, OFlag::O_DIRECTORY, false, "store folder", &root.display().to_string())
}

/// Opens `root/parts...` for reading without following any symbolic link
/// below `root`, without blocking on a FIFO, and only if it is a regular
/// file. `what` names the object in messages.
pub fn open_regular(root: &OwnedFd, root_path: &Path, parts: &[&str], what: &str) -> Result<File> {
    let mut shown = root_path.to_path_buf();
    let mut dir: Option<OwnedFd> = None;
    for (i, part) in parts.iter().enumerate() {
        shown.push(part);
        let last = i + 1 == parts.len();
        let flags = if last { OFlag::O_NONBLOCK } else { OFlag::O_DIRECTORY };
        let fd = open_raw(Some(dir.as_ref().unwrap_or(root)), Path::new(part), flags, true, what, &shown.display().to_string())?;
        dir = Some(fd);
    }
    let fd = dir.ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("{what}: empty path")))?;
    let file = File::from(fd);
    let meta = file.metadata().map_err(|e| io_error(e, format!("unable to stat {what} {}", shown.display())))?;
    if meta.is_dir() {
        return Err(Error::new(ErrorKind::NotFound, format!("{} is a folder, not a {what}", shown.display())));
    }
    if !meta.is_file() {
        let kind = file_kind(meta.file_type());
        return Err(Error::new(ErrorKind::Corrupt, format!("{what} {} is {kind}, not a regular file", shown.display())));
    }
    Ok(file)
}

/// What a file type is, for messages ("a FIFO", "a symbolic link", ...).
pub fn file_kind(ty: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ty.is_file() {
        "a regular file"
    } else if ty.is_dir() {
        "a folder"
    } else if ty.is_symlink() {
        "a symbolic link"
    } else if ty.is_fifo() {
        "a FIFO"
    } else if ty.is_socket() {
        "a socket"
    } else if ty.is_block_device() || ty.is_char_device() {
        "a device"
    } else {
        "an unknown kind of file"
    }
}

/// Opens (creating it 0600 if missing) the store's lock file for flock:
/// no link followed, no blocking on a FIFO, only a regular file of this
/// user (see [`crate::lock_file::open_own`]).
pub fn open_lock_file(path: &Path) -> Result<File> {
    crate::lock_file::open_own(path, "content store lock file")
}

fn open_raw(dir: Option<&OwnedFd>, path: &Path, extra: OFlag, nofollow: bool, what: &str, shown: &str) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let mut flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | extra;
    if nofollow {
        flags |= OFlag::O_NOFOLLOW;
    }
    match openat(dir.map(|d| d.as_raw_fd()), path, flags, Mode::empty()) {
        // SAFETY: openat returned a new descriptor that nothing else owns.
        Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        Err(nix::errno::Errno::ELOOP) if nofollow => {
            Err(Error::new(ErrorKind::Permission, format!("{what} {shown} is a symbolic link; refused (the store may be hostile)")))
        }
        // O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR: tell the two apart.
        Err(nix::errno::Errno::ENOTDIR) if nofollow && is_link(dir, path) => {
            Err(Error::new(ErrorKind::Permission, format!("{what} {shown} is a symbolic link; refused (the store may be hostile)")))
        }
        // A file where a folder should be: `a/b` asked for while `a` is a file.
        Err(nix::errno::Errno::ENOTDIR) => Err(Error::new(ErrorKind::NotFound, format!("{shown} is not a folder (looking for a {what})"))),
        Err(e) => Err(Error::from_errno(e as i32, format!("unable to open {what} {shown}"))),
    }
}

fn is_link(dir: Option<&OwnedFd>, path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let st = nix::sys::stat::fstatat(dir.map(|d| d.as_raw_fd()), path, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
    st.is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK)
}

/// Reads a whole small file, refusing one longer than `max` bytes before
/// reading it (and if it grows while being read).
pub fn read_small(mut file: File, max: usize, what: &str) -> Result<Vec<u8>> {
    let len = file.metadata().map_err(|e| io_error(e, format!("unable to stat {what}")))?.len();
    if len > max as u64 {
        return Err(Error::new(ErrorKind::Corrupt, format!("{what} is {len} bytes, more than the {max} allowed")));
    }
    let mut buf = Vec::with_capacity(len as usize);
    (&mut file).take(max as u64 + 1).read_to_end(&mut buf).map_err(|e| io_error(e, format!("unable to read {what}")))?;
    if buf.len() > max {
        return Err(Error::new(ErrorKind::Corrupt, format!("{what} grew past the {max} bytes allowed while being read")));
    }
    Ok(buf)
}
