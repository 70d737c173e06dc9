//! MapAllocator: a file or POSIX shared-memory object mapped into memory
//! with ATen's flags and ATen's open/grow/map/keep/unlink sequence.
//!
//! Where ATen misbehaves we keep the format and fix the behaviour: the pages
//! of a grown object are reserved up front (a full /dev/shm is `NoSpace` at
//! open, not SIGBUS later), a grown file is not stamped with a NUL at
//! offset 0, an opener that asks for more bytes than a NOCREATE object holds
//! is refused instead of silently growing it, and a failed create removes
//! the name it made.

use super::flags::{self, EXCLUSIVE, FROMFD, KEEPFD, NOCREATE, SHARED, SHAREDMEM, UNLINK};
use super::names::validate_shm_name;
use super::reserve;
use crate::error::{errno, Error, ErrorKind, Result};
use std::ffi::CString;
use std::os::fd::RawFd;

/// What ATen calls a name when none was given (FROMFD maps).
pub const UNNAMED: &str = "filename not specified";

/// How an open puts pages behind an object it grows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Reserve<'a> {
    /// Reserve them (posix_fallocate); they read as zeros.
    Now,
    /// Write `bytes` at offset `at` with pwrite(2), which allocates and
    /// fills each page in one pass (see `reserve`); the bytes must cover
    /// every page of the object (`at` < page size, `at + len` = size).
    Fill { at: usize, bytes: &'a [u8] },
}

/// One mapped file or shared-memory object. Dropping it closes it.
///
/// Thread safety: the accessors take `&self` and may be called from any
/// thread; `close` needs `&mut self`. What happens to the mapped bytes is
/// the caller's business (other processes may write them at any time).
#[derive(Debug)]
pub struct MapAllocator {
    name: String,
    c_name: CString,
    flags: i32,
    fd: RawFd,
    base: *mut u8,
    len: usize,
    unlink_on_close: bool,
    created: bool,
    closed: bool,
}

// SAFETY: the allocator owns its mapping and descriptor; nothing in it is
// tied to the creating thread, and shared access only reads plain fields.
unsafe impl Send for MapAllocator {}
// SAFETY: as above; `&self` methods never write through `base`.
unsafe impl Sync for MapAllocator {}

impl MapAllocator {
    /// Opens `name` with `flags` (see [`flags`]) and maps `size` bytes:
    /// ATen's `MapAllocator(name, flags, size)`.
    pub fn open(name: &str, flags: i32, size: usize) -> Result<Self> {
        Self::open_with(name, None, flags, size, Reserve::Now)
    }

    /// Maps `size` bytes of the open descriptor `fd`; `flags` must hold
    /// FROMFD. On success the allocator owns `fd` (kept with KEEPFD, closed
    /// right away otherwise); on failure the caller still owns it.
    pub fn open_fd(name: &str, fd: RawFd, flags: i32, size: usize) -> Result<Self> {
        if flags & FROMFD == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("mapping fd {fd} needs the FROMFD flag (got flags {})", flags::describe(flags)),
            ));
        }
        Self::open_with(name, Some(fd), flags, size, Reserve::Now)
    }

    pub(crate) fn open_with(name: &str, fd: Option<RawFd>, flags: i32, size: usize, reserve: Reserve) -> Result<Self> {
        let source = fd.map_or(Source::Named, Source::Fd);
        Self::open_from(name, source, flags, size, reserve)
    }

    /// A new object with flags 86 (SHAREDMEM | EXCLUSIVE | KEEPFD | UNLINK)
    /// that never has a name in /dev/shm: an O_TMPFILE file of the tmpfs
    /// behind /dev/shm (same space limit, same kind of descriptor), so a
    /// process killed while the bytes are reserved or copied leaves
    /// nothing behind. `name` is only what `filename()` reports, as ATen
    /// would have named it. Where O_TMPFILE is refused the object is
    /// created under `name` and the name removed right after the open.
    pub(crate) fn create_nameless(name: &str, size: usize, reserve: Reserve) -> Result<Self> {
        Self::open_from(name, Source::Nameless, flags::SHM_FD_STORAGE, size, reserve)
    }

    fn open_from(name: &str, source: Source, flags: i32, size: usize, reserve: Reserve) -> Result<Self> {
        let fd = match source {
            Source::Fd(fd) => Some(fd),
            Source::Named | Source::Nameless => None,
        };
        let flags = check_flags(flags, fd)?;
        let name = if name.is_empty() { UNNAMED } else { name };
        check_size(name, size)?;
        if flags & FROMFD == 0 {
            check_name(name, flags)?;
        }
        let c_name =
            CString::new(name).map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("name <{name}> contains a NUL byte")))?;
        let mut opened = match source {
            Source::Nameless => match Opened::nameless(&c_name, flags) {
                Some(o) => o,
                None => Opened::new(&c_name, name, None, flags)?,
            },
            _ => Opened::new(&c_name, name, fd, flags)?,
        };
        if flags & UNLINK != 0 && !in_shm_namespace(flags) && !opened.made_here {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "UNLINK would remove the file <{name}>, which this call did not create (flags {}): only a file made by this open is removed",
                    flags::describe(flags)
                ),
            ));
        }
        // A name this open made and is asked to remove goes now, before the
        // pages are reserved or filled: if this process dies meanwhile, the
        // kernel frees the object with the descriptor and nothing is left.
        if flags & UNLINK != 0 && opened.made_here && !opened.name_gone {
            unlink_name(&c_name, name, flags)?;
            opened.name_gone = true;
        }
        let st_size = opened.file_size(name)?;
        let grown_from = if size > st_size {
            if flags & NOCREATE != 0 || flags & (SHARED | SHAREDMEM) == 0 {
                return Err(Error::new(
                    ErrorKind::SizeMismatch,
                    format!("file <{name}> size <{st_size}> is smaller than the required mapping size <{size}>"),
                ));
            }
            if let Err(e) = opened.grow(name, size) {
                return Err(opened.undo(st_size, e));
            }
            Some(st_size)
        } else {
            None
        };
        let created = opened.made_here || grown_from == Some(0);
        let base = match map(opened.fd, size, flags, name) {
            Ok(b) => b,
            Err(e) => return Err(opened.undo(grown_from.unwrap_or(st_size), e)),
        };
        let mut this = MapAllocator {
            name: name.to_string(),
            c_name: c_name.clone(),
            flags,
            fd: -1,
            base,
            len: size,
            unlink_on_close: in_shm_namespace(flags) && flags & (FROMFD | UNLINK) == 0,
            created,
            closed: false,
        };
        let filled = match (grown_from, reserve) {
            (_, Reserve::Fill { at, bytes }) => reserve::write_all(opened.fd, at, bytes, name),
            (Some(old), Reserve::Now) => reserve::reserve(opened.fd, base, old, size - old, in_shm_namespace(flags), name),
            (None, Reserve::Now) => Ok(()),
        };
        if let Err(e) = filled {
            let _ = this.unmap_only();
            return Err(opened.undo(grown_from.unwrap_or(st_size), e));
        }
        // UNLINK of an object this open did not make: ATen's order (after
        // mapping), and only ever a shared-memory name (checked above).
        if flags & UNLINK != 0 && !opened.name_gone && (flags & FROMFD == 0 || name != UNNAMED) {
            if let Err(e) = unlink_name(&c_name, name, flags) {
                let _ = this.unmap_only();
                return Err(opened.undo(grown_from.unwrap_or(st_size), e));
            }
        }
        this.fd = opened.release(flags & KEEPFD != 0, name)?;
        Ok(this)
    }

    /// Start of the mapped bytes; null once closed.
    pub fn data(&self) -> *mut u8 {
        if self.closed {
            std::ptr::null_mut()
        } else {
            self.base
        }
    }

    /// Number of mapped bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The kept descriptor (KEEPFD), else -1.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    pub fn filename(&self) -> &str {
        &self.name
    }

    pub(crate) fn c_filename(&self) -> &CString {
        &self.c_name
    }

    pub fn flags(&self) -> i32 {
        self.flags
    }

    /// Whether this open made the object (EXCLUSIVE, or grew it from empty).
    pub fn created(&self) -> bool {
        self.created
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Unmaps, closes a kept descriptor and, for a SHAREDMEM object opened
    /// without FROMFD or UNLINK, removes its name (ATen's close). Calling it
    /// again does nothing.
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let mut first: Result<()> = Ok(());
        if self.fd >= 0 {
            // SAFETY: we own the kept descriptor and close it once.
            if unsafe { libc::close(self.fd) } != 0 {
                first = Err(Error::last_os_error(format!("could not close file descriptor {}", self.fd)));
            }
            self.fd = -1;
        }
        if let Err(e) = self.unmap_only() {
            first = first.and(Err(e));
        }
        if self.unlink_on_close {
            // A name someone else removed already is the state we want.
            match unlink_name(&self.c_name, &self.name, self.flags) {
                Err(e) if e.kind() != ErrorKind::NotFound => first = first.and(Err(e)),
                _ => {}
            }
        }
        first
    }

    /// Removes the name on close: refcounted maps decide that themselves.
    pub(crate) fn set_unlink_on_close(&mut self, on: bool) {
        self.unlink_on_close = on;
    }

    fn unmap_only(&mut self) -> Result<()> {
        self.closed = true;
        if self.base.is_null() {
            return Ok(());
        }
        // SAFETY: base/len are exactly what mmap returned for this object,
        // and `closed` keeps anyone from using them afterwards.
        let rc = unsafe { libc::munmap(self.base.cast(), self.len) };
        self.base = std::ptr::null_mut();
        if rc != 0 {
            return Err(Error::last_os_error(format!("could not unmap the shared memory file <{}>", self.name)));
        }
        Ok(())
    }
}

impl Drop for MapAllocator {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// Validates and normalises flags as ATen does, plus the checks it lacks.
fn check_flags(flags: i32, fd: Option<RawFd>) -> Result<i32> {
    if flags & !flags::ALL != 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("unknown flag bits {:#x} in flags {flags}", flags & !flags::ALL)));
    }
    if flags & SHARED != 0 && flags & SHAREDMEM != 0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "flags SHARED (a regular file) and SHAREDMEM (a shared-memory object) contradict each other (got flags {})",
                flags::describe(flags)
            ),
        ));
    }
    let mut flags = flags;
    if flags & (SHARED | SHAREDMEM) == 0 {
        flags &= !NOCREATE;
    }
    if flags == EXCLUSIVE {
        return Err(Error::new(ErrorKind::InvalidArgument, "ALLOCATOR_MAPPED_EXCLUSIVE flag requires opening the file in shared mode"));
    }
    if flags & EXCLUSIVE != 0 && flags & NOCREATE != 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, "flags EXCLUSIVE and NOCREATE contradict each other"));
    }
    match (flags & FROMFD != 0, fd) {
        (true, None) => Err(Error::new(ErrorKind::InvalidArgument, "FROMFD flag given but no file descriptor")),
        (true, Some(fd)) if fd < 0 => Err(Error::new(ErrorKind::InvalidArgument, format!("invalid file descriptor {fd} with FROMFD"))),
        (false, Some(fd)) => Err(Error::new(ErrorKind::InvalidArgument, format!("file descriptor {fd} given without the FROMFD flag"))),
        _ => Ok(flags),
    }
}

fn check_size(name: &str, size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("size 0 for <{name}>: a mapping needs at least one byte")));
    }
    if size > isize::MAX as usize || size as u64 > libc::off_t::MAX as u64 {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("size {size} for <{name}> is too large to map")));
    }
    Ok(())
}

fn check_name(name: &str, flags: i32) -> Result<()> {
    if flags & SHARED == 0 && flags & SHAREDMEM != 0 {
        validate_shm_name(name)
    } else if name == UNNAMED {
        Err(Error::new(ErrorKind::InvalidArgument, "a file name is required unless FROMFD is given"))
    } else {
        Ok(())
    }
}

/// Where an open gets its descriptor.
#[derive(Clone, Copy)]
enum Source {
    /// open(2) or shm_open(3) of the name.
    Named,
    /// The caller's descriptor (FROMFD).
    Fd(RawFd),
    /// A new object that never has a name (see `create_nameless`).
    Nameless,
}

/// True when the name lives in the shm namespace (shm_open/shm_unlink).
fn in_shm_namespace(flags: i32) -> bool {
    flags & SHAREDMEM != 0 && flags & SHARED == 0
}

/// The descriptor during an open: closed again on failure unless the
/// caller passed it in (FROMFD).
struct Opened {
    fd: RawFd,
    owned: bool,
    /// This call created the object (an O_EXCL open succeeded).
    made_here: bool,
    /// The object has no name any more (or never had one).
    name_gone: bool,
    c_name: CString,
    flags: i32,
}

impl Opened {
    fn new(c_name: &CString, name: &str, fd: Option<RawFd>, flags: i32) -> Result<Self> {
        if let Some(fd) = fd {
            return Ok(Opened { fd, owned: false, made_here: false, name_gone: false, c_name: c_name.clone(), flags });
        }
        let shared = flags & (SHARED | SHAREDMEM) != 0;
        let mut oflags = if shared { libc::O_RDWR | libc::O_CREAT } else { libc::O_RDONLY };
        if flags & EXCLUSIVE != 0 {
            oflags |= libc::O_EXCL;
        }
        if flags & NOCREATE != 0 {
            oflags &= !libc::O_CREAT;
        }
        oflags |= libc::O_CLOEXEC;
        let what = if flags & SHARED == 0 && flags & SHAREDMEM != 0 { "shared memory object" } else { "file" };
        let fail = || {
            let mode = if shared { "read-write" } else { "read-only" };
            Err(Error::last_os_error(format!("unable to open {what} <{name}> in {mode} mode")))
        };
        let made = |fd| {
            if in_shm_namespace(flags) {
                // Says in which pid namespace the pid in the name lives.
                super::creator_record::stamp(fd);
            }
            Ok(Opened { fd, owned: true, made_here: true, name_gone: false, c_name: c_name.clone(), flags })
        };
        let found = |fd| Ok(Opened { fd, owned: true, made_here: false, name_gone: false, c_name: c_name.clone(), flags });
        if oflags & libc::O_CREAT == 0 || oflags & libc::O_EXCL != 0 {
            let fd = open_raw(c_name, oflags, flags);
            return if fd < 0 {
                fail()
            } else if oflags & libc::O_EXCL != 0 {
                made(fd)
            } else {
                found(fd)
            };
        }
        // Create-or-open: try to create first, so that we know whether this
        // call made the object (and may remove it if the open fails later).
        // Someone may remove it between the two tries: start again then.
        for _ in 0..100 {
            let fd = open_raw(c_name, oflags | libc::O_EXCL, flags);
            if fd >= 0 {
                return made(fd);
            }
            if errno() != libc::EEXIST {
                return fail();
            }
            let fd = open_raw(c_name, oflags & !libc::O_CREAT, flags);
            if fd >= 0 {
                return found(fd);
            }
            if errno() != libc::ENOENT {
                return fail();
            }
        }
        fail()
    }

    /// An object without a name on the tmpfs behind /dev/shm; None where
    /// the kernel or file system does not offer O_TMPFILE there.
    fn nameless(c_name: &CString, flags: i32) -> Option<Self> {
        let oflags = libc::O_TMPFILE | libc::O_RDWR | libc::O_EXCL | libc::O_CLOEXEC;
        // SAFETY: a constant NUL-terminated path; open returns a new fd or -1.
        let fd = unsafe { libc::open(c"/dev/shm".as_ptr(), oflags, 0o600 as libc::c_uint) };
        (fd >= 0).then(|| Opened { fd, owned: true, made_here: true, name_gone: true, c_name: c_name.clone(), flags })
    }

    fn file_size(&self, name: &str) -> Result<usize> {
        // SAFETY: stat is plain data that fstat fills in.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open and st is a valid out-pointer.
        if unsafe { libc::fstat(self.fd, &mut st) } != 0 {
            return Err(Error::last_os_error(format!("unable to stat the file <{name}>")));
        }
        Ok(st.st_size.max(0) as usize)
    }

    fn grow(&self, name: &str, size: usize) -> Result<()> {
        // SAFETY: ftruncate acts only on the descriptor.
        if unsafe { libc::ftruncate(self.fd, size as libc::off_t) } != 0 {
            return Err(Error::last_os_error(format!("unable to resize file <{name}> to the right size <{size}>")));
        }
        Ok(())
    }

    /// After a failed open: remove the object if this call made it (and
    /// its name is still there), else shrink it back to `old` bytes.
    /// Returns `e` for the caller to pass on.
    fn undo(&self, old: usize, e: Error) -> Error {
        if self.made_here && self.owned {
            if !self.name_gone {
                let _ = unlink_name(&self.c_name, "", self.flags);
            }
        } else {
            // SAFETY: best-effort cleanup on the descriptor of this open
            // (a no-op when the object was not grown).
            unsafe { libc::ftruncate(self.fd, old as libc::off_t) };
        }
        e
    }

    /// Hands the descriptor over: kept (returned) or closed now.
    fn release(mut self, keep: bool, name: &str) -> Result<RawFd> {
        let fd = self.fd;
        self.fd = -1;
        if keep {
            return Ok(fd);
        }
        // SAFETY: fd is ours now (opened here, or passed with FROMFD and
        // consumed by a successful open, as in ATen).
        if unsafe { libc::close(fd) } != 0 {
            return Err(Error::last_os_error(format!("Error closing file <{name}>")));
        }
        Ok(-1)
    }
}

/// open(2) for files, shm_open(3) for SHAREDMEM; -1 with errno on failure.
fn open_raw(c_name: &CString, oflags: i32, flags: i32) -> RawFd {
    // SAFETY: c_name is a valid NUL-terminated string for the call.
    unsafe {
        if flags & SHARED != 0 {
            libc::open(c_name.as_ptr(), oflags, 0o600 as libc::c_uint)
        } else if flags & SHAREDMEM != 0 {
            libc::shm_open(c_name.as_ptr(), oflags, 0o600)
        } else {
            libc::open(c_name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC)
        }
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if self.owned && self.fd >= 0 {
            // SAFETY: we opened this descriptor and nobody took it.
            unsafe { libc::close(self.fd) };
        }
    }
}

fn map(fd: RawFd, size: usize, flags: i32, name: &str) -> Result<*mut u8> {
    let share = if flags & (SHARED | SHAREDMEM) != 0 { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
    // SAFETY: a fresh mapping chosen by the kernel; nothing of ours is
    // overwritten.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, share, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::last_os_error(format!("unable to mmap {size} bytes from file <{name}>")));
    }
    Ok(p.cast())
}

/// shm_unlink for shared memory, unlink for files.
pub(crate) fn unlink_name(c_name: &CString, name: &str, flags: i32) -> Result<()> {
    let shm = in_shm_namespace(flags);
    // SAFETY: c_name is a valid NUL-terminated string.
    let rc = unsafe {
        if shm {
            libc::shm_unlink(c_name.as_ptr())
        } else {
            libc::unlink(c_name.as_ptr())
        }
    };
    if rc != 0 {
        let what = if shm { "the shared memory file" } else { "file" };
        return Err(Error::from_errno(errno(), format!("could not unlink {what} <{name}>")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::names::new_process_wide_shm_handle;

    fn shm_exists(name: &str) -> bool {
        std::path::Path::new(&format!("/dev/shm{name}")).exists()
    }

    #[test]
    fn create_write_reopen_and_unlink_on_close() {
        let name = new_process_wide_shm_handle();
        let mut a = MapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 10_000).unwrap();
        assert!(a.created());
        // SAFETY: the mapping holds 10_000 bytes.
        unsafe { a.data().add(9_999).write(42) };
        let b = MapAllocator::open(&name, SHAREDMEM | NOCREATE, 10_000).unwrap();
        // SAFETY: same object, same size.
        assert_eq!(unsafe { b.data().add(9_999).read() }, 42);
        assert!(!b.created());
        a.close().unwrap();
        assert!(!shm_exists(&name), "plain SHAREDMEM close removes the name");
        a.close().unwrap();
        assert!(a.data().is_null());
    }

    #[test]
    fn keepfd_unlink_and_fromfd() {
        let name = new_process_wide_shm_handle();
        let a = MapAllocator::open(&name, flags::SHM_FD_STORAGE, 4096).unwrap();
        assert!(a.fd() >= 0);
        assert!(!shm_exists(&name), "UNLINK removes the name at once");
        // SAFETY: 4096 bytes mapped.
        unsafe { a.data().write(7) };
        let dup = nix::unistd::dup(a.fd()).unwrap();
        let b = MapAllocator::open_fd("", dup, flags::OPEN_SHARED_FD, 4096).unwrap();
        assert_eq!(b.fd(), dup);
        assert_eq!(b.filename(), UNNAMED);
        // SAFETY: 4096 bytes mapped.
        assert_eq!(unsafe { b.data().read() }, 7);
    }

    #[test]
    fn errors_are_specific() {
        let name = new_process_wide_shm_handle();
        let e = MapAllocator::open(&name, SHAREDMEM | NOCREATE, 10).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.message().contains(&name), "{e}");
        assert_eq!(MapAllocator::open(&name, EXCLUSIVE, 10).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(MapAllocator::open(&name, SHAREDMEM, 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(MapAllocator::open("noslash", SHAREDMEM, 10).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(MapAllocator::open(&name, 1 << 9, 10).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(MapAllocator::open(&name, SHAREDMEM, usize::MAX).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let mut small = MapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 100).unwrap();
        let e = MapAllocator::open(&name, SHAREDMEM | NOCREATE, 200).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::SizeMismatch);
        assert!(e.message().contains("size <100>") && e.message().contains("<200>"), "{e}");
        let e = MapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 100).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        small.close().unwrap();
    }

    #[test]
    fn regular_file_grows_without_stamping_byte_zero() {
        let dir = std::env::temp_dir().join(format!("ss-map-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, [9u8; 10]).unwrap();
        let p = path.to_str().unwrap();
        let mut m = MapAllocator::open(p, SHARED, 8192).unwrap();
        // SAFETY: 8192 bytes mapped.
        assert_eq!(unsafe { m.data().read() }, 9);
        m.close().unwrap();
        assert!(path.exists(), "regular files are never unlinked by close");
        let ro = MapAllocator::open(p, 0, 8192).unwrap();
        // SAFETY: 8192 bytes mapped privately.
        assert_eq!(unsafe { ro.data().add(5).read() }, 9);
        assert_eq!(MapAllocator::open(p, 0, 10_000).unwrap_err().kind(), ErrorKind::SizeMismatch);
        drop(ro);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
