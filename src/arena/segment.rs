//! One arena segment: a memfd or a named POSIX shm object. Its size is
//! fixed at creation, but its data pages are reserved as the producer
//! carves blocks (`reserve_data`), each before any block over it is handed
//! out (a full file system is `NoSpace` then, never a SIGBUS later); a
//! segment costs the memory of what was carved, not of its size. Pages no
//! hold covers in a segment its producer gave up are given back
//! (`release_unheld_pages`), so a small block a consumer keeps does not
//! keep the whole segment.
//!
//! Layout: the data first, at offset 0 (so a block that owns its whole
//! segment is, by fd, exactly what PyTorch maps: bytes `[0, size)`), then
//! a page-aligned trailer: a 4 KiB header and the hold slots.

use super::counters::{HoldSlot, SLOT_SIZE};
use super::handle::Strategy;
use crate::error::{errno, Error, ErrorKind, Result};
use crate::fdpass::seals::{check_named, check_received, seal_against_shrinking, sealable_memfd};
use crate::shm::reserve::reserve;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"SSARENA1");
/// 2: hold slots record the size of the shared block beside its offset.
const VERSION: u32 = 2;
const HEADER_SIZE: usize = 4096;

/// The header at the start of the trailer.
#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    strategy: u32,
    producer_pid: i32,
    _pad: u32,
    producer_start: u64,
    segment_id: u64,
    data_size: u64,
    nslots: u64,
    /// Set by the producer when it gives the segment up.
    retired: AtomicU32,
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}

pub fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

fn trailer_size(nslots: usize) -> usize {
    round_up(HEADER_SIZE + nslots * SLOT_SIZE, page_size()).unwrap_or(usize::MAX)
}

/// Who made a segment and which one it is: the key of a consumer's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentKey {
    pub producer_pid: i32,
    pub producer_start: u64,
    pub segment_id: u64,
}

/// A mapped segment. The creator unlinks the name (by-name) when it drops
/// it; a consumer may unlink it when it finds the producer dead.
#[derive(Debug)]
pub struct Segment {
    base: *mut u8,
    total: usize,
    data_size: usize,
    nslots: usize,
    key: SegmentKey,
    strategy: Strategy,
    fd: Option<OwnedFd>,
    name: Option<String>,
    unlink_on_drop: std::sync::atomic::AtomicBool,
    creator: bool,
    /// By name, the manager daemon the creator registered the name with:
    /// it removes the name if the creator is killed before unlinking it.
    manager: Option<std::sync::Arc<crate::manager::Client>>,
}

// SAFETY: the segment owns its mapping and descriptor; the shared parts
// are accessed through atomics or by the callers that own the blocks.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Segment {
    /// A new segment with `data_size` bytes of data (rounded up to pages)
    /// and `nslots` hold slots; the trailer and the first `reserved_data`
    /// bytes of data (rounded up to pages) are reserved now, the rest by
    /// [`Segment::reserve_data`] when blocks reach it.
    pub fn create(strategy: Strategy, data_size: usize, nslots: usize, reserved_data: usize) -> Result<Segment> {
        let data_size = round_up(data_size.max(1), page_size())
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("segment of {data_size} bytes is too large")))?;
        let total = data_size
            .checked_add(trailer_size(nslots))
            .filter(|t| *t <= isize::MAX as usize)
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("segment of {data_size} bytes is too large")))?;
        let me = super::counters::me();
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut manager = None;
        let key = SegmentKey { producer_pid: me.0, producer_start: me.1, segment_id: id };
        let (fd, name) = match strategy {
            Strategy::Fd => (memfd(id)?, None),
            Strategy::Name => {
                // The one form `handle::is_segment_name` accepts in a handle.
                let name = format!("/ss_arena_{}_{}_{:08x}", me.0, id, random_u32());
                manager = register_with_manager(&name);
                match shm_create(&name) {
                    Ok(fd) => (fd, Some(name)),
                    Err(e) => {
                        crate::manager::tell_freed(&manager, &name);
                        return Err(e);
                    }
                }
            }
        };
        let what = name.clone().unwrap_or_else(|| format!("arena memfd segment {id}"));
        let made = (|| {
            // SAFETY: ftruncate acts on our new descriptor only.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), total as libc::off_t) } != 0 {
                return Err(Error::last_os_error(format!("unable to size <{what}> to {total} bytes")));
            }
            if strategy == Strategy::Fd {
                // Consumers map it only sealed: nobody can shrink it under them.
                seal_against_shrinking(fd.as_raw_fd(), &what)?;
            }
            let base = map(fd.as_raw_fd(), total, &what)?;
            let first = round_up(reserved_data.min(data_size), page_size()).unwrap_or(data_size);
            let reserved = reserve(fd.as_raw_fd(), base, data_size, total - data_size, false, &what)
                .and_then(|()| reserve(fd.as_raw_fd(), base, 0, first, false, &what));
            if let Err(e) = reserved {
                // SAFETY: the mapping we just made, not used by anyone.
                unsafe { libc::munmap(base.cast(), total) };
                return Err(e);
            }
            Ok(base)
        })();
        let base = match made {
            Ok(b) => b,
            Err(e) => {
                if let Some(n) = &name {
                    unlink(n);
                    crate::manager::tell_freed(&manager, n);
                }
                return Err(e);
            }
        };
        let seg = Segment {
            base,
            total,
            data_size,
            nslots,
            key,
            strategy,
            // By name, the descriptor is not needed once mapped: no fd per segment.
            fd: if strategy == Strategy::Fd { Some(fd) } else { None },
            name,
            unlink_on_drop: true.into(),
            creator: true,
            manager,
        };
        // SAFETY: the header lies inside our fresh mapping, page aligned;
        // nobody else knows the segment yet.
        unsafe {
            seg.header_ptr().write(Header {
                magic: MAGIC,
                version: VERSION,
                strategy: strategy as u32,
                producer_pid: key.producer_pid,
                _pad: 0,
                producer_start: key.producer_start,
                segment_id: id,
                data_size: data_size as u64,
                nslots: nslots as u64,
                retired: AtomicU32::new(0),
            })
        };
        Ok(seg)
    }

    /// Maps a segment received as `fd` (which it takes over) or opened by
    /// `name`, and checks that its header is the one `key` and
    /// `data_size` describe. A received descriptor must be sealed against
    /// shrinking (as `create` seals every memfd segment) and cover the
    /// data and header: one that its sender could truncate would crash
    /// this process with SIGBUS, so it is refused unmapped. A file opened
    /// by name must be this user's and written by nobody else (another
    /// user may have taken the name after the producer exited).
    pub fn open(key: SegmentKey, strategy: Strategy, data_size: usize, fd: Option<OwnedFd>, name: Option<&str>) -> Result<Segment> {
        let what = name.map(str::to_string).unwrap_or_else(|| format!("arena segment {} of pid {}", key.segment_id, key.producer_pid));
        let least = data_size.saturating_add(HEADER_SIZE);
        let (fd, total) = match (fd, name) {
            (Some(fd), _) => {
                let total = check_received(fd.as_raw_fd(), least, &format!("<{what}>"))?;
                (fd, total)
            }
            (None, Some(n)) => {
                let fd = shm_open_existing(n)?;
                // A name can be taken by another user once the producer
                // gave it up: map only a file of this user nobody else writes.
                let total = check_named(fd.as_raw_fd(), least, &format!("<{what}>"))?;
                (fd, total)
            }
            (None, None) => return Err(Error::new(ErrorKind::InvalidArgument, "a segment needs an fd or a name")),
        };
        if data_size % page_size() != 0 || total < least {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("<{what}> holds {total} bytes, not a segment with {data_size} bytes of data"),
            ));
        }
        let base = map(fd.as_raw_fd(), total, &what)?;
        let mut seg = Segment {
            base,
            total,
            data_size,
            nslots: 0,
            key,
            strategy,
            fd: if strategy == Strategy::Fd { Some(fd) } else { None },
            name: name.map(str::to_string),
            unlink_on_drop: false.into(),
            creator: false,
            manager: None,
        };
        // SAFETY: total >= data_size + HEADER_SIZE, so the header is mapped.
        let h = unsafe { &*seg.header_ptr() };
        let nslots = h.nslots as usize;
        if h.magic != MAGIC
            || h.version != VERSION
            || h.segment_id != key.segment_id
            || h.producer_pid != key.producer_pid
            || h.producer_start != key.producer_start
            || h.data_size != data_size as u64
            || h.strategy != strategy as u32
            || nslots > (total - data_size - HEADER_SIZE) / SLOT_SIZE
        {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "<{what}> is not arena segment {} of pid {} with {data_size} data bytes (header does not match)",
                    key.segment_id, key.producer_pid
                ),
            ));
        }
        seg.nslots = nslots;
        Ok(seg)
    }

    fn header_ptr(&self) -> *mut Header {
        // SAFETY: data_size < total and the trailer starts page aligned.
        unsafe { self.base.add(self.data_size).cast() }
    }

    pub fn key(&self) -> SegmentKey {
        self.key
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn data_size(&self) -> usize {
        self.data_size
    }

    pub fn nslots(&self) -> usize {
        self.nslots
    }

    pub fn fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(|f| f.as_raw_fd())
    }

    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Whether `p` points into the data of this segment.
    pub fn contains(&self, p: usize) -> bool {
        p >= self.base as usize && p < self.base as usize + self.data_size
    }

    /// Reserves the data pages of `[from, to)` (the producer, before it
    /// carves blocks there). Memory-backed: posix_fallocate on the
    /// descriptor, or (by name, whose descriptor is closed) over the mapping.
    pub fn reserve_data(&self, from: usize, to: usize) -> Result<()> {
        let to = to.min(self.data_size);
        if from >= to {
            return Ok(());
        }
        let what = self.name.clone().unwrap_or_else(|| format!("arena memfd segment {}", self.key.segment_id));
        match &self.fd {
            Some(fd) => reserve(fd.as_raw_fd(), self.base, from, to - from, false, &what),
            None => {
                let fd = self.reopen_for_reserve(&what)?;
                reserve(fd.as_raw_fd(), self.base, from, to - from, false, &what)
            }
        }
    }

    /// A by-name segment's descriptor, opened again to reserve pages (the
    /// creator keeps no descriptor per segment).
    fn reopen_for_reserve(&self, what: &str) -> Result<OwnedFd> {
        let n = self.name.as_deref().ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("<{what}> has neither fd nor name")))?;
        let c = CString::new(n).map_err(|_| Error::new(ErrorKind::InvalidArgument, "NUL in segment name"))?;
        // SAFETY: shm_open reads the NUL-terminated name.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::last_os_error(format!("unable to open <{what}> to reserve pages")));
        }
        // SAFETY: a fresh descriptor we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Blocks (offset, size) that a hold slot covers now: shares in flight,
    /// being adopted, or held; sorted. Reads every slot (a slot page given
    /// back is faulted in again: call it once per segment given up).
    pub fn held_blocks(&self) -> Vec<(usize, usize)> {
        let mut held: Vec<(usize, usize)> = (0..self.nslots)
            .filter_map(|i| {
                let s = self.slot(i);
                (s.load().1 != super::counters::FREE).then(|| s.block())
            })
            .map(|(o, n)| (o as usize, n as usize))
            .filter(|&(o, n)| o < self.data_size && n > 0)
            .collect();
        held.sort_unstable();
        held
    }

    /// Gives back the pages of data in `[from, to)` that none of the
    /// blocks `held` (sorted, as [`Segment::held_blocks`] gives them)
    /// touches, for a segment whose producer will carve no more blocks in
    /// it (it retired it, or died): only held blocks are used there, and
    /// no new hold can appear. The range is widened to whole pages; a page
    /// shared with a held block stays. Returns the bytes released
    /// (including pages that were released already).
    pub fn release_pages_outside(&self, from: usize, to: usize, held: &[(usize, usize)]) -> usize {
        let page = page_size();
        let to = round_up(to.min(self.data_size), page).unwrap_or(self.data_size).min(self.data_size);
        let mut at = from / page * page;
        let mut released = 0;
        for &(o, n) in held.iter().chain(std::iter::once(&(to, 0))) {
            let keep_from = o / page * page;
            let keep_to = round_up(o.saturating_add(n), page).unwrap_or(usize::MAX);
            let end = keep_from.min(to);
            if end > at {
                // SAFETY: [at, end) is page aligned and inside our shared,
                // writable mapping of the data; no block there is in use
                // (no hold covers it and its producer carves no more).
                if unsafe { libc::madvise(self.base.add(at).cast(), end - at, libc::MADV_REMOVE) } == 0 {
                    released += end - at;
                }
            }
            at = at.max(keep_to);
            if at >= to {
                break;
            }
        }
        released
    }

    /// Gives back the pages of the hold-slot area that hold no slot in use
    /// (same precondition as [`Segment::release_pages_outside`]: nobody
    /// claims slots any more). A slot page reads as free slots afterwards.
    pub fn release_unused_slot_pages(&self) -> usize {
        let page = page_size();
        let slots_at = self.data_size + HEADER_SIZE;
        let first_page = round_up(slots_at, page).unwrap_or(self.total);
        let end = slots_at + self.nslots * SLOT_SIZE;
        let last_page = round_up(end, page).unwrap_or(self.total).min(self.total);
        if first_page >= last_page {
            return 0;
        }
        let mut kept = vec![false; (last_page - first_page) / page];
        for i in 0..self.nslots {
            if self.slot(i).load().1 != super::counters::FREE {
                let (a, b) = (slots_at + i * SLOT_SIZE, slots_at + (i + 1) * SLOT_SIZE - 1);
                for p in (a.max(first_page) - first_page) / page..=(b.max(first_page) - first_page) / page {
                    if let Some(k) = kept.get_mut(p) {
                        *k = true;
                    }
                }
            }
        }
        let mut released = 0;
        let mut p = 0;
        while p < kept.len() {
            let run = kept[p..].iter().take_while(|k| !**k).count();
            if run > 0 {
                // SAFETY: whole pages of our shared, writable mapping of the
                // slot area that no slot in use touches.
                if unsafe { libc::madvise(self.base.add(first_page + p * page).cast(), run * page, libc::MADV_REMOVE) } == 0 {
                    released += run * page;
                }
            }
            p += run + 1;
        }
        released
    }

    pub fn slot(&self, i: usize) -> &HoldSlot {
        assert!(i < self.nslots, "slot {i} out of {}", self.nslots);
        // SAFETY: slot i lies inside the trailer (checked at open/create),
        // 8-byte aligned; all accesses to it are atomic.
        unsafe { &*(self.base.add(self.data_size + HEADER_SIZE + i * SLOT_SIZE) as *const HoldSlot) }
    }

    pub fn retire(&self) {
        // SAFETY: the header is mapped for our lifetime; the field is atomic.
        unsafe { &*self.header_ptr() }.retired.store(1, Ordering::Release);
    }

    pub fn retired(&self) -> bool {
        // SAFETY: as above.
        unsafe { &*self.header_ptr() }.retired.load(Ordering::Acquire) != 0
    }

    /// Makes a consumer remove the name when it drops the segment (the
    /// producer died without doing it).
    pub fn unlink_when_dropped(&self) {
        self.unlink_on_drop.store(true, Ordering::Relaxed);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // A forked child's copy of its parent's segment is only unmapped:
        // the retired flag, the name and the manager's record are the
        // parent's.
        if self.creator && std::process::id() as i32 != self.key.producer_pid {
            // SAFETY: this process's mapping; no block of it is used after this.
            unsafe { libc::munmap(self.base.cast(), self.total) };
            return;
        }
        if self.creator {
            // Consumers unmap their copy once their last view goes.
            self.retire();
        }
        // SAFETY: our own mapping; no block of it is used after this.
        unsafe { libc::munmap(self.base.cast(), self.total) };
        if self.unlink_on_drop.load(Ordering::Relaxed) {
            if let Some(n) = &self.name {
                unlink(n);
            }
        }
        if let Some(n) = &self.name {
            crate::manager::tell_freed(&self.manager, n);
        }
    }
}

/// Registers a by-name segment with this process's manager daemon (the
/// one already connected, else one spawned now) before the name exists,
/// so a creator killed with -9 leaves nothing: the manager removes the
/// name once no live process maps it. Best effort: without a manager
/// binary the segment still works, and `ssctl gc` recognises
/// `ss_arena_<pid>_...` names of dead creators; the process is warned
/// once that this cleanup is lost.
fn register_with_manager(name: &str) -> Option<std::sync::Arc<crate::manager::Client>> {
    match crate::manager::register_with_default(name) {
        Ok(client) => Some(client),
        Err(e) => {
            super::no_manager_warning::warn_once(&e);
            None
        }
    }
}

fn memfd(id: u64) -> Result<OwnedFd> {
    let label = CString::new(format!("ss_arena_{id}")).unwrap_or_default();
    sealable_memfd(&label, "an arena segment")
}

fn shm_create(name: &str) -> Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| Error::new(ErrorKind::InvalidArgument, "NUL in segment name"))?;
    // SAFETY: shm_open reads the NUL-terminated name.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        return Err(Error::last_os_error(format!("unable to create arena segment <{name}>")));
    }
    // Says in which pid namespace the pid in the name lives (`ssctl gc`).
    crate::shm::creator_record::stamp(fd);
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn shm_open_existing(name: &str) -> Result<OwnedFd> {
    crate::shm::names::validate_shm_name(name)?;
    let c = CString::new(name).map_err(|_| Error::new(ErrorKind::InvalidArgument, "NUL in segment name"))?;
    // SAFETY: as above.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK, 0) };
    if fd < 0 {
        let e = errno();
        let mut err = Error::from_errno(e, format!("unable to open arena segment <{name}>"));
        if e == libc::ENOENT {
            err = err.context("the producer freed the segment or exited");
        }
        return Err(err);
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn unlink(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: shm_unlink reads the NUL-terminated name.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

fn map(fd: RawFd, len: usize, what: &str) -> Result<*mut u8> {
    // SAFETY: a new shared mapping of our descriptor; the kernel picks the address.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::last_os_error(format!("unable to mmap {len} bytes of <{what}>")));
    }
    Ok(p.cast())
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    crate::syscalls::getrandom(&mut b);
    u32::from_ne_bytes(b) ^ std::process::id().rotate_left(16)
}
