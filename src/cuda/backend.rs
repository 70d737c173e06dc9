//! The device calls of the IPC layer, behind one small trait so that the
//! device-independent logic (counter files, slots, limbo, collection, the
//! handle cache) runs unchanged on host memory in tests. [`CudaBackend`]
//! is the product.
//!
//! [`CudaBackend`]: super::cuda_backend::CudaBackend

use super::handle::IPC_HANDLE_SIZE;
use crate::error::Result;

/// A raw IPC handle (memory or event): 64 opaque bytes.
pub type RawHandle = [u8; IPC_HANDLE_SIZE];

/// Device operations needed to send and receive memory. Pointers, streams
/// and events are passed as integers (a `CUdeviceptr`, `CUstream`, `CUevent`).
pub trait IpcBackend: Send + Sync + 'static {
    /// Ok when the device side can be used; else why not.
    fn check_available(&self) -> Result<()>;
    /// Base and size of the allocation on `device` that holds `ptr`.
    fn allocation_range(&self, device: i32, ptr: u64) -> Result<(u64, usize)>;
    /// The IPC handle of the allocation that starts at `base`.
    fn export_memory(&self, device: i32, base: u64) -> Result<RawHandle>;
    /// Records a new interprocess event on `stream`: (event, its handle).
    fn record_event(&self, device: i32, stream: u64) -> Result<(u64, RawHandle)>;
    /// Destroys an event made by [`IpcBackend::record_event`].
    fn destroy_event(&self, device: i32, event: u64) -> Result<()>;
    /// Waits until all work queued on `stream` is done.
    fn sync_stream(&self, device: i32, stream: u64) -> Result<()>;
    /// Maps a peer's allocation: (base, size) in this process.
    fn open_memory(&self, device: i32, handle: &RawHandle) -> Result<(u64, usize)>;
    /// Unmaps what [`IpcBackend::open_memory`] returned.
    fn close_memory(&self, device: i32, base: u64) -> Result<()>;
    /// Makes later work on `stream` wait for a peer's event.
    fn wait_event(&self, device: i32, handle: &RawHandle, stream: u64) -> Result<()>;
}
