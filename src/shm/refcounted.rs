//! RefcountedMapAllocator: a shared-memory segment whose first 64 bytes hold
//! an int32 reference count shared by every process that maps it. The user
//! data starts at +64; the process that brings the count to 0 removes the
//! name. Layout and flags match ATen's, so PyTorch processes share the count.

use super::flags::{EXCLUSIVE, FROMFD, KEEPFD, SHAREDMEM, UNLINK};
use super::map::{unlink_name, MapAllocator, Reserve};
use crate::error::{Error, ErrorKind, Result};
use std::sync::atomic::{AtomicI32, Ordering};

/// Bytes before the user data: ATen's `map_alloc_alignment`.
pub const HEADER_SIZE: usize = 64;

/// A mapped refcounted segment. Dropping it closes it (count −1).
///
/// Thread safety: all methods but `close` take `&self`; the count is
/// updated with atomic read-modify-write, so any thread and any process
/// may incref/decref concurrently.
#[derive(Debug)]
pub struct RefcountedMapAllocator {
    map: MapAllocator,
    closed: bool,
    /// `close` brought the count to 0 and the name is gone.
    removed: bool,
}

impl RefcountedMapAllocator {
    /// Creates (EXCLUSIVE: count = 1) or opens (count + 1) the segment
    /// `name` with `size` bytes of user data. `flags` must hold SHAREDMEM
    /// and none of FROMFD, KEEPFD, UNLINK. `size` may be 0: the segment is
    /// then its header alone, as ATen makes for an empty storage shared
    /// by name.
    pub fn open(name: &str, flags: i32, size: usize) -> Result<Self> {
        Self::open_with(name, flags, size, None)
    }

    /// Creates the segment `name` (flags must hold EXCLUSIVE) holding a copy
    /// of `bytes`, written with pwrite(2) as the pages are allocated: about
    /// twice as fast as creating it and copying through the mapping.
    pub fn create_with(name: &str, flags: i32, bytes: &[u8]) -> Result<Self> {
        if flags & EXCLUSIVE == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("creating <{name}> with its bytes needs the EXCLUSIVE flag (got {})", super::flags::describe(flags)),
            ));
        }
        Self::open_with(name, flags, bytes.len(), Some(bytes))
    }

    fn open_with(name: &str, flags: i32, size: usize, fill: Option<&[u8]>) -> Result<Self> {
        for (bit, text) in [(FROMFD, "FROMFD"), (KEEPFD, "KEEPFD"), (UNLINK, "UNLINK")] {
            if flags & bit != 0 {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("RefcountedMapAllocator doesn't support ALLOCATOR_MAPPED_{text} flag"),
                ));
            }
        }
        if flags & SHAREDMEM == 0 {
            return Err(Error::new(ErrorKind::Unsupported, "RefcountedMapAllocator requires ALLOCATOR_MAPPED_SHAREDMEM flag"));
        }
        let total = size.checked_add(HEADER_SIZE).filter(|t| *t <= isize::MAX as usize).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("size {size} for <{name}> overflows when the {HEADER_SIZE}-byte header is added"),
            )
        })?;
        let reserve = fill.map_or(Reserve::Now, |bytes| Reserve::Fill { at: HEADER_SIZE, bytes });
        let mut map = MapAllocator::open_with(name, None, flags, total, reserve)?;
        map.set_unlink_on_close(false);
        let this = RefcountedMapAllocator { map, closed: false, removed: false };
        if this.map.created() || flags & EXCLUSIVE != 0 {
            this.count().store(1, Ordering::SeqCst);
        } else if let Err(e) = this.join() {
            let mut this = this;
            this.closed = true;
            let _ = this.map.close();
            return Err(e);
        }
        Ok(this)
    }

    fn count(&self) -> &AtomicI32 {
        // SAFETY: the mapping is at least 64 bytes, page-aligned, and lives
        // as long as self; all users access the word atomically.
        unsafe { &*(self.map.data() as *const AtomicI32) }
    }

    /// Adds this process's reference, refusing a segment whose count is not
    /// positive (it is being released, or it is not a refcounted segment).
    fn join(&self) -> Result<()> {
        let count = self.count();
        let mut seen = count.load(Ordering::SeqCst);
        loop {
            if seen <= 0 || seen == i32::MAX {
                return Err(Error::new(
                    ErrorKind::BadRefcount,
                    format!(
                        "refcounted segment <{}> has count {seen} in its header: it is being released, is not a refcounted segment, or was overwritten",
                        self.map.filename()
                    ),
                ));
            }
            match count.compare_exchange_weak(seen, seen + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(()),
                Err(now) => seen = now,
            }
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, format!("refcounted segment <{}> is closed", self.map.filename())));
        }
        Ok(())
    }

    /// Start of the user data (base + 64); null once closed.
    pub fn data(&self) -> *mut u8 {
        if self.closed {
            std::ptr::null_mut()
        } else {
            // SAFETY: the mapping is HEADER_SIZE + size bytes long.
            unsafe { self.map.data().add(HEADER_SIZE) }
        }
    }

    /// Bytes of user data (mapped bytes minus the header).
    pub fn len(&self) -> usize {
        self.map.len() - HEADER_SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn filename(&self) -> &str {
        self.map.filename()
    }

    pub fn flags(&self) -> i32 {
        self.map.flags()
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether `close` dropped the last reference and the name is gone.
    pub fn name_removed(&self) -> bool {
        self.removed
    }

    /// Count + 1.
    pub fn incref(&self) -> Result<()> {
        self.check_open()?;
        // A count at i32::MAX was overwritten by someone: wrapping it to a
        // negative value would make every later open fail and close misfire.
        self.count().fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_add(1)).map(|_| ()).map_err(|c| {
            Error::new(
                ErrorKind::BadRefcount,
                format!("refcounted segment <{}> has count {c} in its header: one more would overflow", self.map.filename()),
            )
        })
    }

    /// Count − 1; true when it is now 0. The name is not removed here (as
    /// in ATen): the holder who closes last does that.
    pub fn decref(&self) -> Result<bool> {
        self.check_open()?;
        Ok(self.count().fetch_sub(1, Ordering::SeqCst) == 1)
    }

    /// The count now in the header.
    pub fn refcount(&self) -> Result<i32> {
        self.check_open()?;
        Ok(self.count().load(Ordering::SeqCst))
    }

    /// Drops this process's reference; the one that reaches 0 removes the
    /// name. Unmaps. Calling it again does nothing.
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let last = self.count().fetch_sub(1, Ordering::SeqCst) == 1;
        self.closed = true;
        let mut first = Ok(());
        if last {
            match unlink_name(self.map.c_filename(), self.map.filename(), self.map.flags()) {
                Err(e) if e.kind() != ErrorKind::NotFound => first = Err(e),
                _ => self.removed = true,
            }
        }
        first.and(self.map.close())
    }
}

impl Drop for RefcountedMapAllocator {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::flags::NOCREATE;
    use crate::shm::names::new_process_wide_shm_handle;

    fn exists(name: &str) -> bool {
        std::path::Path::new(&format!("/dev/shm{name}")).exists()
    }

    #[test]
    fn count_follows_opens_and_last_close_unlinks() {
        let name = new_process_wide_shm_handle();
        let mut a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 1000).unwrap();
        assert_eq!(a.refcount().unwrap(), 1);
        assert_eq!(a.len(), 1000);
        assert_eq!(std::fs::metadata(format!("/dev/shm{name}")).unwrap().len(), 1064);
        let mut b = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 1000).unwrap();
        assert_eq!(a.refcount().unwrap(), 2);
        b.incref().unwrap();
        assert_eq!(b.refcount().unwrap(), 3);
        assert!(!b.decref().unwrap());
        a.close().unwrap();
        assert!(exists(&name));
        assert_eq!(a.refcount().unwrap_err().kind(), ErrorKind::Closed);
        b.close().unwrap();
        assert!(!exists(&name));
    }

    #[test]
    fn create_with_writes_bytes_after_a_clean_header() {
        let name = new_process_wide_shm_handle();
        let src: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let m = RefcountedMapAllocator::create_with(&name, SHAREDMEM | EXCLUSIVE, &src).unwrap();
        assert_eq!(m.refcount().unwrap(), 1);
        assert_eq!(m.len(), src.len());
        // SAFETY: the segment holds the header and len bytes of data.
        unsafe {
            assert_eq!(std::slice::from_raw_parts(m.data(), src.len()), &src[..]);
            let header = std::slice::from_raw_parts(m.data().sub(HEADER_SIZE), HEADER_SIZE);
            assert!(header[4..].iter().all(|b| *b == 0), "unused header bytes are zero");
        }
        let e = RefcountedMapAllocator::create_with(&name, SHAREDMEM, &src).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = RefcountedMapAllocator::create_with(&name, SHAREDMEM | EXCLUSIVE, &src).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        drop(m);
        assert!(!exists(&name));
    }

    #[test]
    fn zero_data_bytes_is_a_header_only_segment() {
        let name = new_process_wide_shm_handle();
        let a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 0).unwrap();
        assert_eq!(a.len(), 0);
        assert_eq!(std::fs::metadata(format!("/dev/shm{name}")).unwrap().len(), HEADER_SIZE as u64);
        let b = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 0).unwrap();
        assert_eq!(b.refcount().unwrap(), 2);
        drop(a);
        drop(b);
        assert!(!exists(&name));
        let c = RefcountedMapAllocator::create_with(&name, SHAREDMEM | EXCLUSIVE, &[]).unwrap();
        assert_eq!((c.len(), c.refcount().unwrap()), (0, 1));
        drop(c);
        assert!(!exists(&name));
    }

    #[test]
    fn rejects_flags_and_dead_counts() {
        let name = new_process_wide_shm_handle();
        for f in [FROMFD, KEEPFD, UNLINK] {
            let e = RefcountedMapAllocator::open(&name, SHAREDMEM | f, 10).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unsupported);
        }
        assert_eq!(RefcountedMapAllocator::open(&name, EXCLUSIVE | 1, 10).unwrap_err().kind(), ErrorKind::Unsupported);
        let e = RefcountedMapAllocator::open(&name, SHAREDMEM, usize::MAX - 10).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 10).unwrap();
        assert!(a.decref().unwrap());
        let e = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 10).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRefcount);
        assert!(e.message().contains("count 0"), "{e}");
        a.incref().unwrap();
        drop(a);
        assert!(!exists(&name));
    }

    #[test]
    fn overwritten_count_at_max_is_refused_not_wrapped() {
        let name = new_process_wide_shm_handle();
        let a = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 10).unwrap();
        a.count().store(i32::MAX, Ordering::SeqCst);
        let e = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 10).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRefcount, "{e}");
        assert_eq!(a.incref().unwrap_err().kind(), ErrorKind::BadRefcount);
        assert_eq!(a.refcount().unwrap(), i32::MAX);
        a.count().store(1, Ordering::SeqCst);
        drop(a);
        assert!(!exists(&name));
    }
}
