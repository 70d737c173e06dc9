//! The host backend: pool memory in host RAM, so the whole protocol runs
//! for real across processes without a GPU (the tests), and CPU weights
//! can be shared the same way.
//!
//! - Vmm kind: a segment is a memfd sealed against shrinking, sent as a
//!   descriptor; nothing is named, so a kill -9 leaves nothing behind.
//! - Legacy kind: a segment is a named POSIX shm object
//!   (`/ss_pool_<pid>_<random>_<n>`), its handle the name, as a CUDA
//!   legacy IPC handle names an allocation. The producer unlinks it when
//!   the pool goes, or at exit if the pool was never dropped (Python's
//!   teardown may skip it); mappings made by then stay valid. After a
//!   kill -9 of the producer its consumers unlink the names when they
//!   see it gone, and the shared memory manager, with which each name is
//!   registered before it exists, unlinks them once no live process maps
//!   them (so a producer killed before any consumer came leaves nothing;
//!   without a manager, `ssctl gc` knows the names).
//!
//! Events are not needed: host writes are visible once made.

use super::backend::{MappedSegment, PoolBackend, PoolSegment, RecordedEvent, EVENT_BYTES};
use super::options::PoolKind;
use super::region::{page_size, random_u64, Region};
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::seals::{check_received, file_size, seal_against_shrinking, sealable_memfd};
use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};

/// Legacy names made by this process and not unlinked yet, for the exit hook.
static LIVE_NAMES: Mutex<Option<HashSet<String>>> = Mutex::new(None);
static EXIT_HOOK: Once = Once::new();

extern "C" fn unlink_live_names() {
    let _ = std::panic::catch_unwind(|| {
        let names = LIVE_NAMES.lock().map(|mut n| n.take()).unwrap_or(None);
        for name in names.into_iter().flatten() {
            unlink(&name);
        }
    });
}

fn unlink(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: unlinking a name; mappings stay valid.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

fn remember(name: &str) {
    EXIT_HOOK.call_once(|| {
        // SAFETY: registers a C-ABI function that takes no arguments.
        unsafe { libc::atexit(unlink_live_names) };
    });
    if let Ok(mut names) = LIVE_NAMES.lock() {
        names.get_or_insert_with(HashSet::new).insert(name.to_string());
    }
}

fn forget(name: &str) {
    if let Ok(mut names) = LIVE_NAMES.lock() {
        if let Some(n) = names.as_mut() {
            n.remove(name);
        }
    }
}

/// Unlinks the Legacy host segment names of a producer that is gone
/// (`pid`), so a kill -9 of the producer leaves nothing in /dev/shm once
/// a consumer noticed. Names of another pid are left alone.
pub fn unlink_names_of(handles: &[Vec<u8>], pid: i32) {
    let prefix = format!("{LEGACY_PREFIX}{pid}_");
    for h in handles {
        if let Ok(name) = legacy_name_of(h) {
            if name.starts_with(&prefix) {
                unlink(&name);
            }
        }
    }
}

/// Prefix of every Legacy-kind host segment name.
pub const LEGACY_PREFIX: &str = "/ss_pool_";

pub struct HostBackend {
    kind: PoolKind,
    tag: u64,
    next: AtomicU64,
}

impl HostBackend {
    pub fn new(kind: PoolKind) -> HostBackend {
        HostBackend { kind, tag: random_u64(), next: AtomicU64::new(0) }
    }

    fn legacy_name(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{LEGACY_PREFIX}{}_{:016x}_{n}", std::process::id(), self.tag)
    }
}

struct MemfdSegment {
    fd: OwnedFd,
    region: Region,
}

struct NamedSegment {
    name: String,
    region: Region,
    /// The manager told of the name, told again when it is unlinked.
    manager: Option<Arc<crate::manager::Client>>,
}

struct Mapped {
    region: Region,
    /// Kept open for a memfd (nothing else holds it); None for a name.
    _fd: Option<OwnedFd>,
}

impl PoolSegment for MemfdSegment {
    fn addr(&self) -> u64 {
        self.region.addr()
    }
    fn size(&self) -> usize {
        self.region.len()
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }
    fn handle(&self) -> Vec<u8> {
        Vec::new()
    }
}

impl PoolSegment for NamedSegment {
    fn addr(&self) -> u64 {
        self.region.addr()
    }
    fn size(&self) -> usize {
        self.region.len()
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    fn handle(&self) -> Vec<u8> {
        self.name.as_bytes().to_vec()
    }
}

impl Drop for NamedSegment {
    fn drop(&mut self) {
        unlink(&self.name);
        forget(&self.name);
        crate::manager::tell_freed(&self.manager, &self.name);
    }
}

impl MappedSegment for Mapped {
    fn addr(&self) -> u64 {
        self.region.addr()
    }
    fn size(&self) -> usize {
        self.region.len()
    }
}

fn sized(fd: &OwnedFd, size: usize, what: &str) -> Result<()> {
    // SAFETY: ftruncate on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(Error::last_os_error(format!("unable to size {what} to {size} bytes")));
    }
    Ok(())
}

/// Checks a Legacy host handle: a shm name of this backend's form.
pub fn legacy_name_of(handle: &[u8]) -> Result<String> {
    let name = std::str::from_utf8(handle).map_err(|_| Error::new(ErrorKind::Protocol, "a host segment handle is not UTF-8"))?;
    let rest = name.strip_prefix(LEGACY_PREFIX);
    let ok = rest.is_some_and(|r| !r.is_empty() && r.len() < 200 && r.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    if !ok {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("host segment handle {name:?} is not a pool segment name ({LEGACY_PREFIX}...)"),
        ));
    }
    Ok(name.to_string())
}

impl PoolBackend for HostBackend {
    fn granularity(&self) -> usize {
        page_size()
    }

    fn create_segment(&self, size: usize) -> Result<Box<dyn PoolSegment>> {
        match self.kind {
            PoolKind::Vmm => {
                let what = format!("a pool segment of {size} bytes");
                let fd = sealable_memfd(c"ss-pool-segment", &what)?;
                sized(&fd, size, &what)?;
                seal_against_shrinking(fd.as_raw_fd(), &what)?;
                let region = Region::map(fd.as_raw_fd(), size, &what)?;
                Ok(Box::new(MemfdSegment { fd, region }))
            }
            PoolKind::Legacy => {
                let name = self.legacy_name();
                let c = CString::new(name.as_str()).expect("our names have no NUL");
                // Best effort: without a manager the segment still works;
                // only the cleanup after a kill -9 with no consumer is lost.
                let manager = crate::manager::register_with_default(&name).ok();
                // SAFETY: shm_open with a valid name; a new object only we may open.
                let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC, 0o600) };
                if raw < 0 {
                    let e = Error::last_os_error(format!("unable to create pool segment <{name}>"));
                    crate::manager::tell_freed(&manager, &name);
                    return Err(e);
                }
                // Says in which pid namespace the pid in the name lives (`ssctl gc`).
                crate::shm::creator_record::stamp(raw);
                // SAFETY: a fresh descriptor of ours.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                // From here the name is unlinked when `seg` drops, on any error too.
                let made = sized(&fd, size, &name).and_then(|_| Region::map(fd.as_raw_fd(), size, &name));
                match made {
                    Ok(region) => {
                        remember(&name);
                        Ok(Box::new(NamedSegment { name, region, manager }))
                    }
                    Err(e) => {
                        // SAFETY: removing the name we just made.
                        unsafe { libc::shm_unlink(c.as_ptr()) };
                        crate::manager::tell_freed(&manager, &name);
                        Err(e)
                    }
                }
            }
        }
    }

    fn import_fd(&self, fd: OwnedFd, size: usize, what: &str) -> Result<Box<dyn MappedSegment>> {
        check_received(fd.as_raw_fd(), size, what)?;
        let region = Region::map(fd.as_raw_fd(), size, what)?;
        Ok(Box::new(Mapped { region, _fd: Some(fd) }))
    }

    fn import_handle(&self, handle: &[u8], size: usize, what: &str) -> Result<Box<dyn MappedSegment>> {
        let name = legacy_name_of(handle).map_err(|e| e.context(what))?;
        let c = CString::new(name.as_str()).expect("checked above");
        // SAFETY: shm_open of an existing object, no creation.
        let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            return Err(Error::last_os_error(format!("{what}: unable to open <{name}> (has the producer gone?)")));
        }
        // SAFETY: a fresh descriptor of ours, closed when this returns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let have = file_size(fd.as_raw_fd(), what)?;
        if have < size {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("{what}: <{name}> holds {have} bytes, fewer than the {size} of the manifest; nothing was mapped"),
            ));
        }
        let region = Region::map(fd.as_raw_fd(), size, what)?;
        Ok(Box::new(Mapped { region, _fd: None }))
    }

    fn record_event(&self, _stream: u64) -> Result<Option<RecordedEvent>> {
        Ok(None)
    }

    fn destroy_event(&self, _id: u64) {}

    fn wait_event(&self, _handle: &[u8; EVENT_BYTES], _stream: u64) -> Result<()> {
        Ok(())
    }

    fn sync_stream(&self, _stream: u64) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_round_trip_in_one_process() {
        for kind in [PoolKind::Vmm, PoolKind::Legacy] {
            let b = HostBackend::new(kind);
            let seg = b.create_segment(8192).unwrap();
            // SAFETY: the segment is 8192 bytes of our memory.
            unsafe { (seg.addr() as *mut u8).add(100).write(42) };
            let mapped = match kind {
                PoolKind::Vmm => {
                    let fd = seg.fd().unwrap().try_clone_to_owned().unwrap();
                    b.import_fd(fd, 8192, "test").unwrap()
                }
                PoolKind::Legacy => b.import_handle(&seg.handle(), 8192, "test").unwrap(),
            };
            // SAFETY: as above, through the second mapping.
            assert_eq!(unsafe { (mapped.addr() as *const u8).add(100).read() }, 42);
            let too_big = match kind {
                PoolKind::Vmm => b.import_fd(seg.fd().unwrap().try_clone_to_owned().unwrap(), 8193, "test"),
                PoolKind::Legacy => b.import_handle(&seg.handle(), 8193, "test"),
            };
            assert_eq!(too_big.err().unwrap().kind(), ErrorKind::SizeMismatch);
        }
        let b = HostBackend::new(PoolKind::Legacy);
        for bad in [&b"/etc/passwd"[..], b"/ss_pool_../x", b"/ss_pool_", b"\xff"] {
            assert_eq!(b.import_handle(bad, 10, "test").err().unwrap().kind(), ErrorKind::Protocol, "{bad:?}");
        }
    }
}
