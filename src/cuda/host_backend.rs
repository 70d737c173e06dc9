//! A host-memory [`IpcBackend`] for tests only: "device memory" is a POSIX
//! shm segment, its IPC handle the segment's name, so the device-independent
//! logic runs for real across processes without a GPU. Events are numbered
//! tokens (host writes are visible once made), counted so tests can check
//! the event budget and the stream-sync fallback.

use super::backend::{IpcBackend, RawHandle};
use super::sent::Deleter;
use crate::error::{Error, ErrorKind, Result};
use crate::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use crate::shm::MapAllocator;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct HostBackend {
    tag: String,
    next_alloc: AtomicU64,
    allocs: Arc<Mutex<HashMap<u64, MapAllocator>>>,
    opened: Mutex<HashMap<u64, MapAllocator>>,
    next_event: AtomicU64,
    pub events_destroyed: AtomicUsize,
    pub stream_syncs: AtomicUsize,
    pub event_waits: AtomicUsize,
}

impl HostBackend {
    /// `tag` goes into every segment name so a test can check that none is left.
    pub fn new(tag: &str) -> Self {
        HostBackend {
            tag: tag.to_string(),
            next_alloc: AtomicU64::new(0),
            allocs: Arc::new(Mutex::new(HashMap::new())),
            opened: Mutex::new(HashMap::new()),
            next_event: AtomicU64::new(1),
            events_destroyed: AtomicUsize::new(0),
            stream_syncs: AtomicUsize::new(0),
            event_waits: AtomicUsize::new(0),
        }
    }

    /// Segment-name prefix of this backend's allocations in any process.
    pub fn prefix(tag: &str) -> String {
        format!("ss_host_{tag}_")
    }

    /// "Device" allocation of `nbytes` (a new shm segment).
    pub fn alloc(&self, nbytes: usize) -> u64 {
        let n = self.next_alloc.fetch_add(1, Ordering::SeqCst);
        let name = format!("/{}{}_{n}", Self::prefix(&self.tag), std::process::id());
        let map = MapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, nbytes).expect("host allocation");
        let base = map.data() as u64;
        self.allocs.lock().unwrap().insert(base, map);
        base
    }

    /// Frees an allocation (removing its segment).
    pub fn free(&self, base: u64) {
        let map = self.allocs.lock().unwrap().remove(&base);
        drop(map.expect("freeing an allocation this backend made"));
    }

    /// A deleter that frees the allocation holding the pointer it gets and
    /// logs that pointer in `log`.
    pub fn deleter(&self, log: &Arc<Mutex<Vec<u64>>>) -> Deleter {
        let (allocs, log) = (self.allocs.clone(), log.clone());
        Box::new(move |ptr| {
            let mut allocs = allocs.lock().unwrap();
            let base = allocs.iter().find(|(b, m)| ptr >= **b && ptr < **b + m.len() as u64).map(|(b, _)| *b);
            let base = base.unwrap_or_else(|| panic!("deleter got 0x{ptr:x}, in no allocation"));
            allocs.remove(&base);
            log.lock().unwrap().push(ptr);
        })
    }

    pub fn live_allocations(&self) -> usize {
        self.allocs.lock().unwrap().len()
    }

    fn check_device(device: i32) -> Result<()> {
        if device != 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("host device {device} does not exist: 1 device(s) visible")));
        }
        Ok(())
    }
}

fn handle_of(name: &str) -> RawHandle {
    let mut h = [0u8; 64];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h
}

fn name_of(handle: &RawHandle) -> Result<String> {
    let end = handle.iter().position(|b| *b == 0).unwrap_or(64);
    let name = std::str::from_utf8(&handle[..end]).map_err(|_| Error::new(ErrorKind::InvalidArgument, "host handle is not a name"))?;
    if !name.starts_with("/ss_host_") {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("host handle {name:?} names no host allocation")));
    }
    Ok(name.to_string())
}

impl IpcBackend for HostBackend {
    fn check_available(&self) -> Result<()> {
        Ok(())
    }

    fn allocation_range(&self, device: i32, ptr: u64) -> Result<(u64, usize)> {
        Self::check_device(device)?;
        let allocs = self.allocs.lock().unwrap();
        allocs
            .iter()
            .find(|(base, m)| ptr >= **base && ptr < **base + m.len() as u64)
            .map(|(base, m)| (*base, m.len()))
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("0x{ptr:x} is not host-device memory")))
    }

    fn export_memory(&self, device: i32, base: u64) -> Result<RawHandle> {
        Self::check_device(device)?;
        let allocs = self.allocs.lock().unwrap();
        let m = allocs.get(&base).ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("0x{base:x} is no allocation base")))?;
        Ok(handle_of(m.filename()))
    }

    fn record_event(&self, device: i32, _stream: u64) -> Result<(u64, RawHandle)> {
        Self::check_device(device)?;
        let id = self.next_event.fetch_add(1, Ordering::SeqCst);
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&id.to_ne_bytes());
        Ok((id, h))
    }

    fn destroy_event(&self, _device: i32, _event: u64) -> Result<()> {
        self.events_destroyed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn sync_stream(&self, _device: i32, _stream: u64) -> Result<()> {
        self.stream_syncs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn open_memory(&self, device: i32, handle: &RawHandle) -> Result<(u64, usize)> {
        Self::check_device(device)?;
        let name = name_of(handle)?;
        let len = std::fs::metadata(format!("/dev/shm{name}"))
            .map_err(|e| Error::new(ErrorKind::NotFound, format!("host allocation <{name}>: {e}")))?
            .len() as usize;
        let mut map = MapAllocator::open(&name, SHAREDMEM | NOCREATE, len)?;
        map.set_unlink_on_close(false);
        let base = map.data() as u64;
        self.opened.lock().unwrap().insert(base, map);
        Ok((base, len))
    }

    fn close_memory(&self, _device: i32, base: u64) -> Result<()> {
        match self.opened.lock().unwrap().remove(&base) {
            Some(_) => Ok(()),
            None => Err(Error::new(ErrorKind::InvalidArgument, format!("0x{base:x} was not opened"))),
        }
    }

    fn wait_event(&self, device: i32, _handle: &RawHandle, _stream: u64) -> Result<()> {
        Self::check_device(device)?;
        self.event_waits.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
