//! Ref-counter files: refcounted shm segments of 10000 int64 slots, one
//! slot per send, laid out as PyTorch's `CudaIPCRefCountersFile` (64-byte
//! header, slot k at byte 64 + 8k), so PyTorch consumers release our slots
//! and we release theirs.

use crate::error::{Error, ErrorKind, Result};
use crate::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use crate::shm::names::{new_process_wide_shm_handle, validate_shm_name};
use crate::shm::RefcountedMapAllocator;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// Slots per file (`CUDA_IPC_REF_COUNTER_FILE_SIZE`).
pub const SLOTS_PER_FILE: usize = 10_000;
/// Bytes of data in a counter file: one int64 per slot.
pub const COUNTER_FILE_DATA_SIZE: usize = SLOTS_PER_FILE * std::mem::size_of::<i64>();

/// One mapped counter file.
#[derive(Debug)]
pub struct CounterFile {
    map: RefcountedMapAllocator,
}

impl CounterFile {
    /// Creates a new file under a fresh process-wide name.
    pub fn create() -> Result<Self> {
        let name = new_process_wide_shm_handle();
        let map = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, COUNTER_FILE_DATA_SIZE)
            .map_err(|e| e.context("creating a CUDA IPC ref-counter file"))?;
        Ok(CounterFile { map })
    }

    /// Opens a producer's file, as a consumer does to release its slot.
    /// A missing file means the producer is gone: `PeerGone`.
    pub fn open(name: &str) -> Result<Self> {
        validate_shm_name(name)?;
        match RefcountedMapAllocator::open(name, SHAREDMEM | NOCREATE, COUNTER_FILE_DATA_SIZE) {
            Ok(map) => Ok(CounterFile { map }),
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::BadRefcount) => Err(producer_gone(name, &format!(" ({e})"))),
            Err(e) => Err(e.context(format!("opening CUDA IPC ref-counter file <{name}>"))),
        }
    }

    pub fn name(&self) -> &str {
        self.map.filename()
    }

    /// The slot's counter, shared with every process mapping the file.
    pub fn slot(&self, slot: usize) -> &AtomicI64 {
        assert!(slot < SLOTS_PER_FILE, "slot {slot} out of range");
        // SAFETY: the data is COUNTER_FILE_DATA_SIZE bytes starting 64 bytes
        // into a page-aligned mapping, so every slot is an aligned, in-bounds
        // int64 that lives as long as `self`; all our accesses are atomic.
        unsafe { &*(self.map.data().add(slot * 8) as *const AtomicI64) }
    }

    /// Processes mapping the file now (the header's count).
    pub fn mappers(&self) -> Result<i32> {
        self.map.refcount()
    }
}

/// `PeerGone` for a counter file that no longer exists (or is being
/// released), with `detail` appended to the message.
fn producer_gone(name: &str, detail: &str) -> Error {
    Error::new(
        ErrorKind::PeerGone,
        format!("CUDA IPC ref-counter file <{name}> is gone: its producer process has exited or released it{detail}"),
    )
}

/// Decrements `slot` of the counter file `name` by one, atomically (PyTorch
/// does a plain read-modify-write), as a consumer does when it drops
/// received memory. Refuses to go below 0 (`BadRefcount`: released twice)
/// and reports a vanished producer as `PeerGone`.
pub fn release_slot(name: &str, slot: u64) -> Result<()> {
    let slot = check_slot(slot)?;
    let file = CounterFile::open(name)?;
    let counter = file.slot(slot);
    let mut seen = counter.load(Ordering::SeqCst);
    loop {
        if seen <= 0 {
            return Err(Error::new(
                ErrorKind::BadRefcount,
                format!("slot {slot} of CUDA IPC ref-counter file <{name}> is {seen}: it was already released"),
            ));
        }
        match counter.compare_exchange_weak(seen, seen - 1, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return Ok(()),
            Err(now) => seen = now,
        }
    }
}

/// Reads `slot` of the counter file `name` without mapping it (one
/// `pread`, cheaper than a mapping): a consumer's check at open that the
/// producer is still there (`PeerGone` otherwise) and the tuple not yet
/// released.
pub fn peek_slot(name: &str, slot: u64) -> Result<i64> {
    let slot = check_slot(slot)?;
    validate_shm_name(name)?;
    let c =
        std::ffi::CString::new(name).map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("name <{name}> contains a NUL byte")))?;
    // SAFETY: shm_open with a valid C string; the descriptor is closed below.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        let e = Error::last_os_error(format!("opening CUDA IPC ref-counter file <{name}>"));
        if e.kind() == ErrorKind::NotFound {
            return Err(producer_gone(name, ""));
        }
        return Err(e);
    }
    let mut bytes = [0u8; 8];
    let at = (crate::shm::HEADER_SIZE + slot * 8) as libc::off_t;
    // SAFETY: reads at most 8 bytes into our buffer from our descriptor.
    let n = unsafe { libc::pread(fd, bytes.as_mut_ptr().cast(), 8, at) };
    let read_error = (n < 0).then(|| Error::last_os_error(format!("reading slot {slot} of <{name}>")));
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    if let Some(e) = read_error {
        return Err(e);
    }
    if n != 8 {
        return Err(Error::new(ErrorKind::SizeMismatch, format!("<{name}> is too short for slot {slot}: not a CUDA IPC ref-counter file")));
    }
    Ok(i64::from_ne_bytes(bytes))
}

/// A slot number from a tuple, checked against the file size.
pub fn check_slot(slot: u64) -> Result<usize> {
    if slot >= SLOTS_PER_FILE as u64 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("ref-counter slot {slot} is out of range: a counter file has {SLOTS_PER_FILE} slots"),
        ));
    }
    Ok(slot as usize)
}

/// A slot handed out for one send.
#[derive(Debug)]
pub struct Slot {
    pub file: Arc<CounterFile>,
    pub index: usize,
}

impl Slot {
    pub fn value(&self) -> i64 {
        self.file.slot(self.index).load(Ordering::SeqCst)
    }
}

struct FileState {
    file: Arc<CounterFile>,
    next: usize,
    used: usize,
}

/// The process's counter files: the current one (slots left) and every
/// file with slots still in use. Callers hold it under one lock.
#[derive(Default)]
pub struct CounterFiles {
    files: HashMap<String, FileState>,
    current: Option<String>,
}

impl CounterFiles {
    /// Hands out the next slot, set to 1, creating a file when none has
    /// slots left; a file whose last slot is handed out stops being current.
    pub fn take_slot(&mut self) -> Result<Slot> {
        let name = match &self.current {
            Some(n) => n.clone(),
            None => {
                let file = CounterFile::create()?;
                let name = file.name().to_string();
                self.files.insert(name.clone(), FileState { file: Arc::new(file), next: 0, used: 0 });
                self.current = Some(name.clone());
                name
            }
        };
        let state = self.files.get_mut(&name).expect("current file is registered");
        let index = state.next;
        state.next += 1;
        state.used += 1;
        state.file.slot(index).store(1, Ordering::SeqCst);
        if state.next == SLOTS_PER_FILE {
            self.current = None;
        }
        Ok(Slot { file: state.file.clone(), index })
    }

    /// Gives a slot back; an exhausted file with no slot in use is dropped
    /// (closing it, which removes its name once no consumer maps it).
    pub fn return_slot(&mut self, slot: Slot) {
        let name = slot.file.name().to_string();
        drop(slot);
        if let Some(state) = self.files.get_mut(&name) {
            state.used -= 1;
            if state.used == 0 && state.next == SLOTS_PER_FILE {
                self.files.remove(&name);
            }
        }
    }

    /// Drops the current file if none of its slots is in use.
    pub fn drop_current_if_unused(&mut self) {
        if let Some(name) = &self.current {
            if self.files.get(name).is_some_and(|s| s.used == 0) {
                self.files.remove(name);
                self.current = None;
            }
        }
    }

    /// Names of the files held now (current and in use).
    pub fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    /// Slots in use over all files.
    pub fn slots_in_use(&self) -> usize {
        self.files.values().map(|s| s.used).sum()
    }

    /// Forgets every file (at teardown): each closes once the last slot
    /// referring to it is dropped.
    pub fn clear(&mut self) {
        self.files.clear();
        self.current = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(name: &str) -> bool {
        std::path::Path::new(&format!("/dev/shm{name}")).exists()
    }

    #[test]
    fn layout_matches_pytorch() {
        let mut files = CounterFiles::default();
        let a = files.take_slot().unwrap();
        let name = a.file.name().to_string();
        assert!(name.starts_with(&format!("/torch_{}_", std::process::id())), "{name}");
        assert_eq!(std::fs::metadata(format!("/dev/shm{name}")).unwrap().len(), 64 + 80_000);
        let b = files.take_slot().unwrap();
        assert_eq!((a.index, b.index), (0, 1));
        // Slot k lives at byte 64 + 8k of the segment, as a native int64.
        let raw = std::fs::read(format!("/dev/shm{name}")).unwrap();
        assert_eq!(i32::from_ne_bytes(raw[0..4].try_into().unwrap()), 1, "header count: the producer");
        assert_eq!(i64::from_ne_bytes(raw[64..72].try_into().unwrap()), 1);
        assert_eq!(i64::from_ne_bytes(raw[72..80].try_into().unwrap()), 1);
        assert_eq!(peek_slot(&name, 1).unwrap(), 1);
        release_slot(&name, 1).unwrap();
        assert_eq!(b.value(), 0);
        assert_eq!(peek_slot(&name, 1).unwrap(), 0);
        assert_eq!(peek_slot(&name, 10_000).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let e = release_slot(&name, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRefcount, "{e}");
        assert_eq!(b.value(), 0, "a refused release leaves the slot alone");
        assert_eq!(release_slot(&name, 10_000).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.file.mappers().unwrap(), 1, "release_slot closed its mapping");
        files.return_slot(a);
        files.return_slot(b);
        assert!(exists(&name), "the current file stays until collected");
        files.drop_current_if_unused();
        assert!(!exists(&name));
        let e = release_slot(&name, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
        assert_eq!(peek_slot(&name, 0).unwrap_err().kind(), ErrorKind::PeerGone);
        assert!(e.message().contains(&name), "{e}");
        assert_eq!(release_slot("no-slash", 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
        // A segment too small to be a counter file.
        let small = new_process_wide_shm_handle();
        let m = RefcountedMapAllocator::open(&small, SHAREDMEM | EXCLUSIVE, 16).unwrap();
        let e = peek_slot(&small, 5).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{e}");
        drop(m);
        assert!(!exists(&small));
    }

    #[test]
    fn exhausted_file_rotates_and_retires_when_unused() {
        let mut files = CounterFiles::default();
        let mut slots: Vec<Slot> = (0..SLOTS_PER_FILE + 5).map(|_| files.take_slot().unwrap()).collect();
        let first = slots[0].file.name().to_string();
        let second = slots[SLOTS_PER_FILE].file.name().to_string();
        assert_ne!(first, second);
        assert_eq!(slots[SLOTS_PER_FILE - 1].index, SLOTS_PER_FILE - 1);
        assert_eq!(slots[SLOTS_PER_FILE].index, 0);
        assert_eq!(files.slots_in_use(), SLOTS_PER_FILE + 5);
        let rest = slots.split_off(SLOTS_PER_FILE);
        let last_of_first = slots.pop().unwrap();
        for s in slots {
            files.return_slot(s);
        }
        assert!(exists(&first), "one slot of the exhausted file is still in use");
        files.return_slot(last_of_first);
        assert!(!exists(&first), "exhausted and unused: retired");
        for s in rest {
            files.return_slot(s);
        }
        assert!(exists(&second));
        files.drop_current_if_unused();
        assert!(!exists(&second));
        assert!(files.names().is_empty());
    }
}
