//! The creator record of a named segment: the pid namespace its creator
//! ran in, kept as an extended attribute (`user.ss.pidns`) of the file in
//! /dev/shm.
//!
//! A segment's name carries its creator's pid (`torch_<pid>_...`), but a
//! pid means something only in one pid namespace, and containers that
//! share /dev/shm (`--ipc=host`) each have their own. `ssctl gc` calls a
//! creator dead only when it knows in which namespace to look: this record
//! says so for the segments this library makes. Writing it is best effort
//! (a file system without user extended attributes keeps none); a segment
//! without one is judged as PyTorch's are (see `manager::creator`).

use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The attribute's name.
pub const XATTR: &std::ffi::CStr = c"user.ss.pidns";

/// The pid namespace of this process (the inode of `/proc/self/ns/pid`),
/// or None when it cannot be read. Not cached: a forked child of a process
/// that unshared its pid namespace lives in another one.
pub fn pid_namespace() -> Option<u64> {
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// Records this process's pid namespace on the segment open at `fd`.
pub fn stamp(fd: RawFd) {
    let Some(ns) = pid_namespace() else { return };
    let text = ns.to_string();
    // SAFETY: a NUL-terminated name and a buffer of the length given; the
    // kernel only reads them. Failure (no xattr support) is ignored.
    unsafe { libc::fsetxattr(fd, XATTR.as_ptr(), text.as_ptr().cast(), text.len(), 0) };
}

/// The pid namespace recorded on the file at `path` (not following a
/// link), or None when it carries no valid record.
pub fn recorded(path: &Path) -> Option<u64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut buf = [0u8; 24];
    // SAFETY: a NUL-terminated path and name, and a buffer of the length
    // given that the kernel writes at most that much into.
    let n = unsafe { libc::lgetxattr(c.as_ptr(), XATTR.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n <= 0 {
        return None;
    }
    std::str::from_utf8(&buf[..n as usize]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn stamp_and_read_back() {
        let path = std::path::PathBuf::from(format!("/dev/shm/ss_creator_record_test_{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        assert_eq!(recorded(&path), None);
        stamp(f.as_raw_fd());
        // Where /dev/shm keeps no user attributes, nothing is recorded.
        if let Some(ns) = recorded(&path) {
            assert_eq!(Some(ns), pid_namespace());
        }
        std::fs::remove_file(&path).unwrap();
    }
}
