//! Process-wide segment names in ATen's format: `/torch_<pid>_<random>_<counter>`.

use crate::error::{Error, ErrorKind, Result};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Longest name a POSIX shm object may have here (NAME_MAX minus the '/').
pub const MAX_SHM_NAME_LEN: usize = 255;

/// A fresh name: pid, an unguessable 32-bit random draw from the kernel,
/// and a process-wide counter, so two calls never collide and another user
/// cannot predict (and pre-create) the next name.
pub fn new_process_wide_shm_handle() -> String {
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("/torch_{}_{}_{}", std::process::id(), random_u32(), counter)
}

fn random_u32() -> u32 {
    let mut bytes = [0u8; 4];
    let n = crate::syscalls::getrandom(&mut bytes);
    if n == bytes.len() as isize {
        return u32::from_ne_bytes(bytes);
    }
    // getrandom(2) exists on every kernel we support; if it fails anyway,
    // fall back on the hasher's per-process random keys plus the clock.
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish() as u32
}

/// Checks that `name` can name a POSIX shared-memory object: a leading '/',
/// no other '/', no NUL, at most [`MAX_SHM_NAME_LEN`] bytes after the '/'.
pub fn validate_shm_name(name: &str) -> Result<()> {
    if !name.starts_with('/') {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("shared memory name <{name}> must start with '/'")));
    }
    if name.len() == 1 || name[1..].contains('/') || name.contains('\0') {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("shared memory name <{name}> must be '/' followed by a non-empty name without '/' or NUL"),
        ));
    }
    if name.len() - 1 > MAX_SHM_NAME_LEN {
        return Err(Error::new(
            ErrorKind::NameTooLong,
            format!("shared memory name of {} bytes is longer than the {MAX_SHM_NAME_LEN} allowed", name.len() - 1),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_and_uniqueness() {
        let a = new_process_wide_shm_handle();
        let b = new_process_wide_shm_handle();
        assert_ne!(a, b);
        let parts: Vec<&str> = a.trim_start_matches("/torch_").split('_').collect();
        assert_eq!(parts.len(), 3, "{a}");
        assert_eq!(parts[0], std::process::id().to_string());
        parts[1].parse::<u32>().unwrap();
        let ca: u64 = parts[2].parse().unwrap();
        let cb: u64 = b.rsplit('_').next().unwrap().parse().unwrap();
        assert!(cb > ca);
        // Fits libshm's 60-byte filename field with its NUL.
        assert!(a.len() < 60);
        validate_shm_name(&a).unwrap();
    }

    #[test]
    fn rejects_bad_names() {
        assert_eq!(validate_shm_name("x").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(validate_shm_name("/").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(validate_shm_name("/a/b").unwrap_err().kind(), ErrorKind::InvalidArgument);
        let long = format!("/{}", "a".repeat(300));
        assert_eq!(validate_shm_name(&long).unwrap_err().kind(), ErrorKind::NameTooLong);
    }
}
