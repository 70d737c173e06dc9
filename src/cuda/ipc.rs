//! The send/receive protocol with cross-process reference counts
//! (docs/pytorch-compat.md, "CUDA IPC"), independent of the device behind [`IpcBackend`].
//!
//! Producer: each send takes a counter slot set to 1 and keeps the
//! allocation; the consumer decrements the slot when done; the producer's
//! free puts a still-referenced block in limbo, and a collection gives
//! back the blocks whose counter reached 0.

use super::backend::IpcBackend;
use super::counters::{peek_slot, release_slot, CounterFiles};
use super::handle::{decode_mem_handle, encode_mem_handle, IpcHandle, IPC_HANDLE_SIZE};
use super::limbo::Limbo;
use super::received::{Received, ReceivedCache};
use super::sent::{Deleter, PinnedBlock, SentData};
use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use crate::shm::flags::SHAREDMEM;
use crate::shm::map::unlink_name;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::MutexGuard;

/// Interprocess events alive at once before sends fall back to a stream
/// synchronisation (old drivers ran out at about 22,000).
pub const MAX_EVENTS_IN_USE: usize = 1000;

/// PyTorch's message for sending memory this process received.
pub const RESEND_MESSAGE: &str =
    "Attempted to send CUDA tensor received from another process; this is not currently supported. Consider cloning before sending.";

/// Sending and receiving device memory with cross-process reference
/// counts. One per process in the product ([`super::global()`]); tests make
/// their own over a host backend.
///
/// Thread safety: every method takes `&self` and may be called from any
/// thread; the counter files live under one lock, limbo and the handle
/// cache under their own.
pub struct CudaIpc<B: IpcBackend> {
    backend: B,
    counters: ForkSafeMutex<CounterFiles>,
    limbo: Limbo,
    events_in_use: AtomicUsize,
    received: ReceivedCache,
    teardown_warned: AtomicBool,
}

/// What a teardown found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TeardownReport {
    /// Blocks in limbo that consumers still referred to.
    pub still_referenced: usize,
    /// Counter files whose names were removed.
    pub counter_files_removed: usize,
}

impl<B: IpcBackend> CudaIpc<B> {
    pub fn new(backend: B) -> Self {
        CudaIpc {
            backend,
            counters: ForkSafeMutex::new(CounterFiles::default()),
            limbo: Limbo::default(),
            events_in_use: AtomicUsize::new(0),
            received: ReceivedCache::default(),
            teardown_warned: AtomicBool::new(false),
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn counters(&self) -> MutexGuard<'_, CounterFiles> {
        self.counters.lock()
    }

    /// Makes fork() take this state's locks (see `fork_safe`): for the
    /// process's one state, which lives as long as the process.
    pub fn register_fork_locks(&'static self) {
        self.counters.register();
        self.limbo.register_fork_lock();
        self.received.register_fork_lock();
    }

    /// Shares `nbytes` at device pointer `ptr` on `device`: returns the
    /// tuple for the consumer and the producer's record of the send, which
    /// keeps the allocation until [`CudaIpc::sent_free`] and the consumer
    /// are both done; then `deleter` gets `ptr` back. Work queued on
    /// `stream` before this call is visible to the consumer (through an
    /// event, or a stream synchronisation once 1000 events are in use).
    /// A null `ptr` gives PyTorch's tuple for a storage without data and no
    /// record.
    pub fn share(
        &self,
        ptr: u64,
        nbytes: usize,
        device: i32,
        stream: u64,
        deleter: Option<Deleter>,
    ) -> Result<(IpcHandle, Option<SentData>)> {
        self.backend.check_available()?;
        if ptr == 0 {
            if nbytes != 0 {
                return Err(Error::new(ErrorKind::InvalidArgument, format!("null device pointer with {nbytes} bytes")));
            }
            let handle = IpcHandle {
                device,
                mem_handle: Vec::new(),
                size_bytes: 0,
                offset_bytes: 0,
                ref_counter_handle: String::new(),
                ref_counter_offset: 0,
                event_handle: [0; IPC_HANDLE_SIZE],
                event_sync_required: false,
            };
            return Ok((handle, None));
        }
        if self.received.holds(device, ptr) {
            return Err(Error::new(ErrorKind::Unsupported, RESEND_MESSAGE));
        }
        let (base, alloc_size) = self.backend.allocation_range(device, ptr)?;
        let offset = ptr - base;
        if nbytes as u64 > alloc_size as u64 - offset {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!(
                    "cannot share {nbytes} bytes at 0x{ptr:x}: its allocation (base 0x{base:x}, {alloc_size} bytes) has only {} bytes from there",
                    alloc_size as u64 - offset
                ),
            ));
        }
        let raw = self.backend.export_memory(device, base)?;
        let (event, event_handle) = self.sync_for_consumer(device, stream)?;
        let slot = match self.counters().take_slot() {
            Ok(s) => s,
            Err(e) => {
                self.drop_event(device, event);
                return Err(e);
            }
        };
        let handle = IpcHandle {
            device,
            mem_handle: encode_mem_handle(&raw).to_vec(),
            size_bytes: nbytes as u64,
            offset_bytes: offset,
            ref_counter_handle: slot.file.name().to_string(),
            ref_counter_offset: slot.index as u64,
            event_handle,
            event_sync_required: event.is_some(),
        };
        Ok((handle, Some(SentData { device, ptr, slot, event, deleter })))
    }

    /// An event recorded on `stream`, or a synchronisation of it when too
    /// many events are alive.
    fn sync_for_consumer(&self, device: i32, stream: u64) -> Result<(Option<u64>, [u8; IPC_HANDLE_SIZE])> {
        if self.events_in_use.fetch_add(1, Ordering::SeqCst) < MAX_EVENTS_IN_USE {
            match self.backend.record_event(device, stream) {
                Ok((ev, h)) => return Ok((Some(ev), h)),
                Err(e) => {
                    self.events_in_use.fetch_sub(1, Ordering::SeqCst);
                    return Err(e);
                }
            }
        }
        self.events_in_use.fetch_sub(1, Ordering::SeqCst);
        self.backend.sync_stream(device, stream)?;
        Ok((None, [0; IPC_HANDLE_SIZE]))
    }

    fn drop_event(&self, device: i32, event: Option<u64>) {
        if let Some(ev) = event {
            let _ = self.backend.destroy_event(device, ev);
            self.events_in_use.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Gives a block back for good: destroys its event, hands the memory to
    /// its deleter, returns its slot.
    fn retire(&self, mut block: SentData) {
        self.drop_event(block.device, block.event.take());
        if let Some(deleter) = block.deleter.take() {
            deleter(block.ptr);
        }
        self.counters().return_slot(block.slot);
    }

    /// The producer's release of a send: given back now if no consumer
    /// refers to it, else put in limbo (true) until a collection finds its
    /// counter at 0. Then frees the limbo blocks already released (but
    /// keeps the current counter file, so that steady send/free cycles do
    /// not create a file each).
    pub fn sent_free(&self, block: SentData) -> bool {
        let pending = !block.released();
        if pending {
            self.limbo.add(block);
        } else {
            self.retire(block);
        }
        self.collect_limbo();
        pending
    }

    /// Gives back the limbo blocks whose counter reached 0, outside the
    /// limbo lock; returns how many.
    fn collect_limbo(&self) -> usize {
        let done = self.limbo.take_released();
        let n = done.len();
        for block in done {
            self.retire(block);
        }
        n
    }

    /// A full collection (`torch.cuda.ipc_collect()`, and what runs before an
    /// allocation gives up): frees the limbo blocks whose counter reached 0;
    /// with limbo then empty, also drops the current counter file if none
    /// of its slots is in use. Returns how many blocks were freed.
    pub fn collect(&self) -> usize {
        let n = self.collect_limbo();
        if self.limbo.is_empty() {
            self.counters().drop_current_if_unused();
        }
        n
    }

    /// Blocks waiting in limbo.
    pub fn limbo_size(&self) -> usize {
        self.limbo.len()
    }

    /// The blocks in limbo with their counters (a consumer that died
    /// without releasing leaves its block here for good).
    pub fn limbo_report(&self) -> Vec<PinnedBlock> {
        self.limbo.report()
    }

    /// Whether the "too many blocks in limbo" warning was printed.
    pub fn limbo_warned(&self) -> bool {
        self.limbo.warned()
    }

    /// Events alive now (one per send still held, up to the limit).
    pub fn events_in_use(&self) -> usize {
        self.events_in_use.load(Ordering::SeqCst)
    }

    /// Names of the counter files this process holds.
    pub fn counter_file_names(&self) -> Vec<String> {
        self.counters().names()
    }

    /// Opens a tuple from another process: maps its memory (once per
    /// handle in this process), makes `stream` wait for the producer's
    /// event, and returns the storage. Give it back with
    /// [`CudaIpc::received_free`] so the producer can free the memory.
    pub fn open(&self, h: &IpcHandle, stream: u64) -> Result<Received> {
        self.backend.check_available()?;
        if h.is_null() {
            return Ok(Received { device: h.device, key: None, data: 0, size: 0, counter_name: String::new(), slot: 0, stream });
        }
        let raw = decode_mem_handle(&h.mem_handle)?;
        // The counter file tells whether the producer is still there, and
        // whether this tuple was already released (peek_slot also checks
        // the slot number).
        let value = peek_slot(&h.ref_counter_handle, h.ref_counter_offset)?;
        if value <= 0 {
            return Err(Error::new(
                ErrorKind::BadRefcount,
                format!(
                    "slot {} of CUDA IPC ref-counter file <{}> is {value}: this tuple was already released",
                    h.ref_counter_offset, h.ref_counter_handle
                ),
            ));
        }
        let device = h.device;
        let (base, size) = self.received.acquire(device, &raw, || self.backend.open_memory(device, &raw))?;
        let undo = |e: Error| {
            let _ = self.received.release(device, &raw, |b| self.backend.close_memory(device, b));
            Err(e)
        };
        let end = h.offset_bytes.checked_add(h.size_bytes);
        if end.map_or(true, |end| end > size as u64) {
            return undo(Error::new(
                ErrorKind::SizeMismatch,
                format!("tuple asks for {} bytes at offset {} but the shared allocation has {size} bytes", h.size_bytes, h.offset_bytes),
            ));
        }
        if h.event_sync_required {
            if let Err(e) = self.backend.wait_event(device, &h.event_handle, stream) {
                return undo(e);
            }
        }
        Ok(Received {
            device,
            key: Some(raw),
            data: base + h.offset_bytes,
            size: h.size_bytes,
            counter_name: h.ref_counter_handle.clone(),
            slot: h.ref_counter_offset,
            stream,
        })
    }

    /// The consumer's release: waits for the work queued on the stream
    /// given to `open`, unmaps when this was the last user of the mapping,
    /// then decrements the producer's slot (atomically). Every step runs;
    /// the first failure is returned (`PeerGone` when the producer's
    /// counter file is gone).
    pub fn received_free(&self, r: Received) -> Result<()> {
        let Some(raw) = r.key else { return Ok(()) };
        let synced = self.backend.sync_stream(r.device, r.stream);
        let closed = self.received.release(r.device, &raw, |b| self.backend.close_memory(r.device, b));
        let released = release_slot(&r.counter_name, r.slot);
        synced.and(closed).and(released)
    }

    /// Mappings of received memory open now.
    pub fn open_mappings(&self) -> usize {
        self.received.len()
    }

    /// At the end of the producer's life: reports (once, through
    /// `crate::log`) blocks that consumers still hold, and removes the names
    /// of all counter files, so nothing stays in /dev/shm; consumers releasing later get
    /// `PeerGone`. Makes no device call (the driver frees the memory at
    /// exit) and runs no deleter.
    pub fn teardown(&self) -> TeardownReport {
        let blocks = self.limbo.take_all();
        let still_referenced = blocks.iter().filter(|b| !b.released()).count();
        if still_referenced > 0 && !self.teardown_warned.swap(true, Ordering::Relaxed) {
            crate::log::warn(&format!(
                "storage-sharing warning: this producer is ending while consumer processes still hold {still_referenced} \
                 of its CUDA blocks; their memory goes away with this process."
            ));
        }
        let mut names = self.counters().names();
        names.extend(blocks.iter().map(|b| b.counter_name().to_string()));
        names.sort();
        names.dedup();
        let removed = names
            .iter()
            .filter(|name| {
                let Ok(c) = CString::new(name.as_str()) else { return false };
                unlink_name(&c, name, SHAREDMEM).is_ok()
            })
            .count();
        // Forget events and deleters: no device or user code at teardown.
        for mut b in blocks {
            if b.event.take().is_some() {
                self.events_in_use.fetch_sub(1, Ordering::SeqCst);
            }
            b.deleter = None;
        }
        self.counters().clear();
        TeardownReport { still_referenced, counter_files_removed: removed }
    }
}

impl<B: IpcBackend> Drop for CudaIpc<B> {
    fn drop(&mut self) {
        self.teardown();
    }
}
