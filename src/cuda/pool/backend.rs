//! The device calls of a pool, behind one trait so that the manifest,
//! placement, versions, holds and liveness run unchanged on host memory
//! (the host backend, used by the tests and usable for CPU weights) and on
//! a CUDA device.

use crate::error::{Error, ErrorKind, Result};
use std::os::fd::{BorrowedFd, OwnedFd};

/// Bytes of an event handle kept in the control block.
pub const EVENT_BYTES: usize = 64;

/// A segment made by this process.
pub trait PoolSegment: Send + Sync {
    /// Its address in this process.
    fn addr(&self) -> u64;
    fn size(&self) -> usize;
    /// The descriptor a consumer imports it from (Vmm kind).
    fn fd(&self) -> Option<BorrowedFd<'_>>;
    /// The handle a consumer opens it with (Legacy kind; empty for Vmm).
    fn handle(&self) -> Vec<u8>;
    /// PyTorch's 8-tuple of the whole segment, with a ref-counter slot of
    /// its own, for a consumer with only stock PyTorch (Legacy kind on CUDA).
    fn stock_share(&self) -> Result<crate::cuda::IpcHandle> {
        Err(Error::new(ErrorKind::Unsupported, "stock PyTorch tuples exist for Legacy pools on a CUDA device only"))
    }
}

/// A producer's segment mapped into a consumer.
pub trait MappedSegment: Send + Sync {
    fn addr(&self) -> u64;
    fn size(&self) -> usize;
}

/// An event recorded at publish: its id here (destroyed at the next
/// publish) and the handle consumers wait on.
pub struct RecordedEvent {
    pub id: u64,
    pub handle: [u8; EVENT_BYTES],
}

pub trait PoolBackend: Send + Sync {
    /// Segment sizes are multiples of this (a multiple of 512).
    fn granularity(&self) -> usize;
    fn create_segment(&self, size: usize) -> Result<Box<dyn PoolSegment>>;
    /// Maps a segment received as a descriptor (Vmm kind); `size` is the
    /// manifest's. The descriptor is checked before anything is mapped.
    fn import_fd(&self, fd: OwnedFd, size: usize, what: &str) -> Result<Box<dyn MappedSegment>>;
    /// Opens a segment by its handle (Legacy kind).
    fn import_handle(&self, handle: &[u8], size: usize, what: &str) -> Result<Box<dyn MappedSegment>>;
    /// Records an interprocess event on `stream` (None: nothing to wait
    /// for, host memory is coherent once written).
    fn record_event(&self, stream: u64) -> Result<Option<RecordedEvent>>;
    fn destroy_event(&self, id: u64);
    /// Makes later work on `stream` wait for the event of `handle`.
    fn wait_event(&self, handle: &[u8; EVENT_BYTES], stream: u64) -> Result<()>;
    /// Waits until the work queued on `stream` is done.
    fn sync_stream(&self, stream: u64) -> Result<()>;
}
