//! ATen's `MappedAllocatorModes`, same names and values.

/// `open(2)` a regular file read-write (created unless NOCREATE), MAP_SHARED.
pub const SHARED: i32 = 1;
/// `shm_open(3)` a POSIX shared-memory object read-write, MAP_SHARED.
pub const SHAREDMEM: i32 = 2;
/// Fail if the object exists (O_EXCL): the caller creates it.
pub const EXCLUSIVE: i32 = 4;
/// Never create: the object must exist.
pub const NOCREATE: i32 = 8;
/// Keep the file descriptor open in the allocator; `close` closes it.
pub const KEEPFD: i32 = 16;
/// Open nothing: map the descriptor given to the constructor.
pub const FROMFD: i32 = 32;
/// Remove the name right after mapping.
pub const UNLINK: i32 = 64;

/// Every bit ATen defines.
pub const ALL: i32 = SHARED | SHAREDMEM | EXCLUSIVE | NOCREATE | KEEPFD | FROMFD | UNLINK;

/// Flags of `new_shm_fd_storage`: SHAREDMEM | EXCLUSIVE | KEEPFD | UNLINK.
pub const SHM_FD_STORAGE: i32 = SHAREDMEM | EXCLUSIVE | KEEPFD | UNLINK;
/// Flags a receiver uses for a shared fd: SHAREDMEM | NOCREATE | KEEPFD | FROMFD.
pub const OPEN_SHARED_FD: i32 = SHAREDMEM | NOCREATE | KEEPFD | FROMFD;

/// Human-readable `A|B|C` form, for messages.
pub fn describe(flags: i32) -> String {
    const NAMES: [(i32, &str); 7] = [
        (SHARED, "SHARED"),
        (SHAREDMEM, "SHAREDMEM"),
        (EXCLUSIVE, "EXCLUSIVE"),
        (NOCREATE, "NOCREATE"),
        (KEEPFD, "KEEPFD"),
        (FROMFD, "FROMFD"),
        (UNLINK, "UNLINK"),
    ];
    let parts: Vec<&str> = NAMES.iter().filter(|(bit, _)| flags & bit != 0).map(|(_, n)| *n).collect();
    if parts.is_empty() {
        "0".to_string()
    } else {
        parts.join("|")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aten_values() {
        assert_eq!((SHARED, SHAREDMEM, EXCLUSIVE, NOCREATE, KEEPFD, FROMFD, UNLINK), (1, 2, 4, 8, 16, 32, 64));
        assert_eq!(SHM_FD_STORAGE, 86);
        assert_eq!(OPEN_SHARED_FD, 58);
        assert_eq!(describe(6), "SHAREDMEM|EXCLUSIVE");
        assert_eq!(describe(0), "0");
    }
}
