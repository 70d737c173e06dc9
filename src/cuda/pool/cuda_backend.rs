//! The CUDA backend of a pool, on the driver loaded at run time (written
//! for a GPU; on machines without one it builds, and every call fails with
//! `CudaUnavailable` and the reason).
//!
//! - Vmm kind: a segment is a `cuMemCreate` allocation mapped here and
//!   exported as a POSIX file descriptor ([`crate::cuda::vmm`], shared
//!   with symmetric memory); a consumer imports the descriptor and maps
//!   it. The driver refcounts the physical memory, so it lives until the
//!   producer and every consumer have released it.
//! - Legacy kind: a segment is a `cuMemAlloc` allocation with a legacy IPC
//!   handle (`cuIpcGetMemHandle`), which stock PyTorch can open too
//!   (`Pool::stock_segments` gives PyTorch's 8-tuples with ref-counter
//!   slots, through `crate::cuda::global()`). The memory is freed once the
//!   pool, every stock tuple (its counter at 0, via limbo) and every
//!   consumer connection are done with it.
//! - Events: publish records an interprocess event on the producer's
//!   stream; acquire makes the consumer's stream wait on it; release
//!   synchronizes the consumer's stream.

use super::backend::{MappedSegment, PoolBackend, PoolSegment, RecordedEvent, EVENT_BYTES};
use super::options::PoolKind;
use crate::cuda::backend::IpcBackend;
use crate::cuda::driver::{driver, symm_driver};
use crate::cuda::handle::IPC_HANDLE_SIZE;
use crate::cuda::vmm::{alloc_prop, granularity, Vmm};
use crate::cuda::{global, CudaBackend, IpcHandle, SentData};
use crate::error::{Error, ErrorKind, Result};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// Granularity of Legacy segments (cuMemAlloc takes any size; 2 MiB keeps
/// segments on large pages).
const LEGACY_GRANULARITY: usize = 2 << 20;

pub struct CudaPoolBackend {
    device: i32,
    kind: PoolKind,
    granularity: usize,
}

impl CudaPoolBackend {
    pub fn new(device: i32, kind: PoolKind) -> Result<CudaPoolBackend> {
        let granularity = match kind {
            PoolKind::Vmm => {
                let (d, _) = symm_driver().map_err(|e| e.context("the GPU weights pool (Vmm kind)"))?;
                d.with_device(device, || granularity(device, &alloc_prop(device)))?
            }
            PoolKind::Legacy => {
                let d = driver()?;
                if d.in_forked_child() {
                    return Err(Error::new(
                        ErrorKind::CudaUnavailable,
                        crate::cuda::driver::forked_child(d.loaded_by, std::process::id()).unwrap_or_default(),
                    ));
                }
                d.with_device(device, || Ok(()))?;
                LEGACY_GRANULARITY
            }
        };
        Ok(CudaPoolBackend { device, kind, granularity })
    }
}

/// A Vmm segment of this process: the mapping and its exported descriptor.
struct VmmSegment {
    vmm: Vmm,
    fd: OwnedFd,
}

/// The memory of a Legacy segment, freed when its last holder drops it
/// (the pool, and each stock tuple's limbo deleter).
struct LegacyMemory {
    device: i32,
    ptr: u64,
}

impl Drop for LegacyMemory {
    fn drop(&mut self) {
        // Not at exit nor in a forked child (no driver call is defined there).
        let (device, ptr) = (self.device, self.ptr);
        crate::cuda::vmm::teardown(device, || {
            let _ = CudaBackend.free(device, ptr);
        });
    }
}

struct LegacySegment {
    memory: Arc<LegacyMemory>,
    size: usize,
    handle: [u8; IPC_HANDLE_SIZE],
    /// The stock tuples handed out, released to limbo when the pool goes.
    stock: Mutex<Vec<SentData>>,
}

impl Drop for LegacySegment {
    fn drop(&mut self) {
        let sent = std::mem::take(&mut *super::lock(&self.stock));
        for s in sent {
            global().sent_free(s);
        }
    }
}

impl PoolSegment for VmmSegment {
    fn addr(&self) -> u64 {
        self.vmm.va
    }
    fn size(&self) -> usize {
        self.vmm.size
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }
    fn handle(&self) -> Vec<u8> {
        Vec::new()
    }
}

impl PoolSegment for LegacySegment {
    fn addr(&self) -> u64 {
        self.memory.ptr
    }
    fn size(&self) -> usize {
        self.size
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    fn handle(&self) -> Vec<u8> {
        self.handle.to_vec()
    }
    fn stock_share(&self) -> Result<IpcHandle> {
        let keep = self.memory.clone();
        let deleter: crate::cuda::Deleter = Box::new(move |_| drop(keep));
        let (h, sent) = global().share(self.memory.ptr, self.size, self.memory.device, 0, Some(deleter))?;
        if let Some(s) = sent {
            super::lock(&self.stock).push(s);
        }
        Ok(h)
    }
}

/// A producer's Vmm segment mapped here.
struct VmmMapped {
    vmm: Vmm,
}

impl MappedSegment for VmmMapped {
    fn addr(&self) -> u64 {
        self.vmm.va
    }
    fn size(&self) -> usize {
        self.vmm.size
    }
}

/// A producer's Legacy segment opened here (`cuIpcOpenMemHandle`).
struct LegacyMapped {
    device: i32,
    base: u64,
    size: usize,
}

impl MappedSegment for LegacyMapped {
    fn addr(&self) -> u64 {
        self.base
    }
    fn size(&self) -> usize {
        self.size
    }
}

impl Drop for LegacyMapped {
    fn drop(&mut self) {
        let base = self.base;
        crate::cuda::vmm::teardown(self.device, || {
            let _ = CudaBackend.close_memory(self.device, base);
        });
    }
}

impl PoolBackend for CudaPoolBackend {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn create_segment(&self, size: usize) -> Result<Box<dyn PoolSegment>> {
        let device = self.device;
        match self.kind {
            PoolKind::Vmm => {
                let (d, _) = symm_driver()?;
                d.with_device(device, || {
                    let mut vmm = Vmm::create(device, size, &alloc_prop(device))?;
                    vmm.map(self.granularity, "a pool segment")?;
                    let fd = vmm.export_fd("a pool segment")?;
                    Ok(Box::new(VmmSegment { vmm, fd }) as Box<dyn PoolSegment>)
                })
            }
            PoolKind::Legacy => {
                let ptr = crate::cuda::device_alloc(device, size)?;
                let memory = Arc::new(LegacyMemory { device, ptr });
                let handle = CudaBackend.export_memory(device, ptr)?;
                Ok(Box::new(LegacySegment { memory, size, handle, stock: Mutex::new(Vec::new()) }))
            }
        }
    }

    fn import_fd(&self, fd: OwnedFd, size: usize, what: &str) -> Result<Box<dyn MappedSegment>> {
        let (d, _) = symm_driver()?;
        let device = self.device;
        d.with_device(device, || {
            let mut vmm = Vmm::import(device, size, &fd, what)?;
            drop(fd); // the imported handle keeps the memory
            vmm.map(self.granularity, what)?;
            Ok(Box::new(VmmMapped { vmm }) as Box<dyn MappedSegment>)
        })
    }

    fn import_handle(&self, handle: &[u8], size: usize, what: &str) -> Result<Box<dyn MappedSegment>> {
        let raw: [u8; IPC_HANDLE_SIZE] = handle.try_into().map_err(|_| {
            Error::new(ErrorKind::Protocol, format!("{what}: a CUDA IPC handle of {} bytes, not {IPC_HANDLE_SIZE}", handle.len()))
        })?;
        let (base, have) = CudaBackend.open_memory(self.device, &raw)?;
        let mapped = LegacyMapped { device: self.device, base, size };
        if have < size {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("{what}: the allocation holds {have} bytes, fewer than the {size} of the manifest; nothing was kept mapped"),
            ));
        }
        Ok(Box::new(mapped))
    }

    fn record_event(&self, stream: u64) -> Result<Option<RecordedEvent>> {
        let (id, handle) = CudaBackend.record_event(self.device, stream)?;
        Ok(Some(RecordedEvent { id, handle }))
    }

    fn destroy_event(&self, id: u64) {
        let device = self.device;
        crate::cuda::vmm::teardown(device, || {
            let _ = CudaBackend.destroy_event(device, id);
        });
    }

    fn wait_event(&self, handle: &[u8; EVENT_BYTES], stream: u64) -> Result<()> {
        CudaBackend.wait_event(self.device, handle, stream)
    }

    fn sync_stream(&self, stream: u64) -> Result<()> {
        CudaBackend.sync_stream(self.device, stream)
    }
}
