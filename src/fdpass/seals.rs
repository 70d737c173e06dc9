//! Descriptors that cannot shrink under a mapping. A process that maps a
//! file another process can truncate dies of SIGBUS when it touches a page
//! past the new end. So the library's own shared memfds (arena segments,
//! symmetric-memory blocks) are sealed against shrinking when made, and a
//! descriptor received for mapping is accepted only with that seal and a
//! size that covers the mapping: the sender can then neither shrink it
//! nor, having sealed it, unseal it. Sealed or not, a hugetlbfs file can
//! have holes punched in it, and a hole that finds no free huge page is a
//! SIGBUS too: such descriptors are refused.
//!
//! A file opened by name (a by-name arena segment) cannot be sealed; it is
//! mapped only when this user owns it and nobody else may write it
//! ([`check_named`]): then no other user can shrink it. (A process of the
//! same user could, but it could as well signal this one.)

use crate::error::{Error, ErrorKind, Result};
use std::ffi::CStr;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Seals every sealed memfd of the library carries. `F_SEAL_SEAL` stops
/// anyone who receives it from adding more (a `F_SEAL_FUTURE_WRITE` added
/// by one consumer would stop every later consumer from mapping it
/// writable).
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;

/// A new close-on-exec memfd named `label` that can be sealed.
pub fn sealable_memfd(label: &CStr, what: &str) -> Result<OwnedFd> {
    let fd = crate::syscalls::memfd_create(label, libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
    if fd < 0 {
        return Err(Error::last_os_error(format!("memfd_create for {what}")));
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seals `fd` (a memfd made by [`sealable_memfd`], sized already) so that
/// nobody can shrink it again, nor add other seals.
pub fn seal_against_shrinking(fd: RawFd, what: &str) -> Result<()> {
    // SAFETY: fcntl on a descriptor we own; F_ADD_SEALS takes an int.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, SEALS) } != 0 {
        return Err(Error::last_os_error(format!("unable to seal {what} against shrinking")));
    }
    Ok(())
}

/// Seals `fd` (a sized memfd made by [`sealable_memfd`], mapped writable
/// by its maker already) so that nobody can shrink it, and nobody can
/// write it except through the mappings that exist now
/// (`F_SEAL_FUTURE_WRITE`): a receiver can map it read-only, never
/// writable, nor write it with write(2). False when the kernel lacks that
/// seal (before Linux 5.1): then it is sealed against shrinking only.
pub fn seal_against_others_writing(fd: RawFd, what: &str) -> Result<bool> {
    // SAFETY: fcntl on a descriptor we own; F_ADD_SEALS takes an int.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, SEALS | libc::F_SEAL_FUTURE_WRITE) } == 0 {
        return Ok(true);
    }
    if crate::error::errno() != libc::EINVAL {
        return Err(Error::last_os_error(format!("unable to seal {what} against writes")));
    }
    seal_against_shrinking(fd, what).map(|_| false)
}

/// Checks a received descriptor before it is mapped: it must be sealed
/// against shrinking and hold at least `need` bytes. Returns its size.
/// Refused descriptors get a `Permission` (not sealed) or `SizeMismatch`
/// (too small) error naming `what`; nothing is mapped.
pub fn check_received(fd: RawFd, need: usize, what: &str) -> Result<usize> {
    // SAFETY: F_GET_SEALS only reads the descriptor's seals.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 {
        let e = crate::error::errno();
        if e != libc::EINVAL {
            return Err(Error::from_errno(e, format!("reading the seals of {what}")));
        }
    }
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(Error::new(
            ErrorKind::Permission,
            format!(
                "{what}: refused, the descriptor is not sealed against shrinking (F_SEAL_SHRINK), so its sender could truncate it and crash this process with SIGBUS; nothing was mapped"
            ),
        ));
    }
    refuse_hugetlbfs(fd, what)?;
    let size = file_size(fd, what)?;
    if size < need {
        return Err(Error::new(
            ErrorKind::SizeMismatch,
            format!("{what}: refused, the descriptor holds {size} bytes, fewer than the {need} to be mapped; nothing was mapped"),
        ));
    }
    Ok(size)
}

/// hugetlbfs's `f_type` (linux/magic.h).
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Refuses a descriptor on hugetlbfs (a `MFD_HUGETLB` memfd): the seal
/// against shrinking does not stop its sender from punching holes
/// (`fallocate`), and touching a hole when no huge page is free is SIGBUS.
fn refuse_hugetlbfs(fd: RawFd, what: &str) -> Result<()> {
    // SAFETY: plain data filled by fstatfs.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid for the call; a bad descriptor gives EBADF.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return Err(Error::last_os_error(format!("fstatfs of {what}")));
    }
    if st.f_type as u64 & 0xffff_ffff == HUGETLBFS_MAGIC {
        return Err(Error::new(
            ErrorKind::Permission,
            format!(
                "{what}: refused, the descriptor is a hugetlbfs file (a MFD_HUGETLB memfd): its sender can punch holes in it despite the seal, \
                 and a hole with no free huge page crashes this process with SIGBUS; nothing was mapped"
            ),
        ));
    }
    Ok(())
}

/// Checks a file opened by name before it is mapped: a regular file that
/// this process's user owns and that neither group nor others may write,
/// of at least `need` bytes. Returns its size. Anything else is refused
/// unmapped (`Permission`, or `SizeMismatch` when too small): a file of
/// another user at a name the producer gave up, that user could truncate
/// under the mapping (SIGBUS) or fill with bytes of its choosing.
pub fn check_named(fd: RawFd, need: usize, what: &str) -> Result<usize> {
    // SAFETY: plain data filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid for the call; a bad descriptor gives EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::last_os_error(format!("fstat of {what}")));
    }
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let mode = st.st_mode & 0o7777;
    let why = if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        Some("it is not a regular file".to_string())
    } else if st.st_uid != me {
        Some(format!("it belongs to uid {} (mode {mode:04o}), not to this process's uid {me}", st.st_uid))
    } else if mode & 0o022 != 0 {
        Some(format!("its mode {mode:04o} lets other users write it"))
    } else {
        None
    };
    if let Some(why) = why {
        return Err(Error::new(
            ErrorKind::Permission,
            format!(
                "{what}: refused, {why}: another user could have put it at the producer's name, and could truncate it under the mapping \
                 (SIGBUS); nothing was mapped"
            ),
        ));
    }
    let size = st.st_size.max(0) as usize;
    if size < need {
        return Err(Error::new(
            ErrorKind::SizeMismatch,
            format!("{what}: refused, the file holds {size} bytes, fewer than the {need} to be mapped; nothing was mapped"),
        ));
    }
    Ok(size)
}

/// The size of the file behind `fd` (fstat).
pub fn file_size(fd: RawFd, what: &str) -> Result<usize> {
    // SAFETY: plain data filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid for the call; a bad descriptor gives EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::last_os_error(format!("fstat of {what}")));
    }
    Ok(st.st_size.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn sized(fd: &OwnedFd, len: i64) {
        // SAFETY: ftruncate on our own memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }, 0);
    }

    #[test]
    fn only_sealed_descriptors_that_cover_the_mapping_pass() {
        let fd = sealable_memfd(c"ss-seal-test", "a test memfd").unwrap();
        sized(&fd, 8192);
        let e = check_received(fd.as_raw_fd(), 4096, "unsealed").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
        seal_against_shrinking(fd.as_raw_fd(), "a test memfd").unwrap();
        assert_eq!(check_received(fd.as_raw_fd(), 8192, "sealed").unwrap(), 8192);
        let e = check_received(fd.as_raw_fd(), 8193, "sealed").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{e}");
        // SAFETY: ftruncate on our own memfd; the seal refuses it.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0, "a sealed memfd shrank");
        // F_SEAL_SEAL: no one adds seals afterwards.
        // SAFETY: as above.
        assert_ne!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) }, 0);
        // A file that is no memfd has no seals at all.
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        assert_eq!(check_received(f.as_raw_fd(), 0, "a proc file").unwrap_err().kind(), ErrorKind::Permission);
    }

    #[test]
    fn a_sealed_hugetlb_memfd_is_refused() {
        let raw = crate::syscalls::memfd_create(c"ss-huge-test", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB);
        if raw < 0 {
            println!("skipped: no hugetlbfs memfd here ({})", std::io::Error::last_os_error());
            return;
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        sized(&fd, 2 << 20);
        seal_against_shrinking(fd.as_raw_fd(), "a hugetlb memfd").unwrap();
        let e = check_received(fd.as_raw_fd(), 4096, "huge").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
        assert!(e.message().contains("hugetlbfs"), "{e}");
    }

    #[test]
    fn a_named_file_must_be_ours_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ss-check-named-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(8192).unwrap();
        f.set_permissions(std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(check_named(f.as_raw_fd(), 8192, "ours").unwrap(), 8192);
        assert_eq!(check_named(f.as_raw_fd(), 8193, "ours").unwrap_err().kind(), ErrorKind::SizeMismatch);
        for mode in [0o620, 0o602, 0o666] {
            f.set_permissions(std::fs::Permissions::from_mode(mode)).unwrap();
            let e = check_named(f.as_raw_fd(), 0, "writable").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
            assert!(e.message().contains(&format!("{mode:04o}")), "{e}");
        }
        let d = std::fs::File::open(&dir).unwrap();
        assert_eq!(check_named(d.as_raw_fd(), 0, "a folder").unwrap_err().kind(), ErrorKind::Permission);
        drop(f);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
