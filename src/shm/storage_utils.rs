//! ATen's StorageUtils: new fd-backed segments and `share_memory`.

use super::map::{MapAllocator, Reserve};
use super::names::new_process_wide_shm_handle;
use crate::error::{Error, ErrorKind, Result};

/// A new anonymous shared-memory segment of `size` bytes, reachable only
/// through its kept descriptor (flags 86). It never has a name in
/// /dev/shm (see `MapAllocator::create_nameless`), so a process killed
/// while it is being made leaks nothing; `filename()` still reports the
/// `/torch_...` name ATen would have used.
pub fn new_shm_fd_storage(size: usize) -> Result<MapAllocator> {
    MapAllocator::create_nameless(&new_process_wide_shm_handle(), size, Reserve::Now)
}

/// Copies `src` into a new fd-backed segment and returns its mapping: what
/// `share_memory_()` does to a CPU storage. The bytes go in with pwrite(2)
/// (`Reserve::Fill`),
/// which allocates and fills each page in one pass (see `reserve`); a full
/// /dev/shm gives `NoSpace`. The mapping's pages are then faulted in lazily
/// (minor faults, no allocation) on first access.
pub fn share_memory(src: &[u8]) -> Result<MapAllocator> {
    if src.is_empty() {
        return Err(Error::new(ErrorKind::InvalidArgument, "share_memory of 0 bytes: nothing to share"));
    }
    MapAllocator::create_nameless(&new_process_wide_shm_handle(), src.len(), Reserve::Fill { at: 0, bytes: src })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_memory_copies_every_byte() {
        for len in [1usize, 4095, 4096, 3 << 20, (9 << 20) + 17] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let m = share_memory(&src).unwrap();
            assert_eq!(m.len(), len);
            assert!(m.fd() >= 0);
            // SAFETY: the mapping holds len bytes.
            let got = unsafe { std::slice::from_raw_parts(m.data(), len) };
            assert!(got == &src[..], "mismatch at len {len}");
        }
        assert_eq!(share_memory(&[]).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn new_fd_storage_is_zeroed_and_nameless() {
        let m = new_shm_fd_storage(10_000).unwrap();
        assert_eq!(m.flags(), crate::shm::flags::SHM_FD_STORAGE);
        assert!(!std::path::Path::new(&format!("/dev/shm{}", m.filename())).exists());
        // SAFETY: 10_000 bytes mapped.
        assert!(unsafe { std::slice::from_raw_parts(m.data(), 10_000) }.iter().all(|b| *b == 0));
    }
}
