//! One rank's block: creating it, exporting it, and the rendezvous that
//! imports and maps every peer's block here.

use super::kernels::Module;
use super::peers::{CudaPeers, DeviceArray};
use super::records::HostRecords;
use super::{alloc_prop, teardown};
use crate::cuda::driver::{check, symm_driver, Driver, SymmFeatures};
use crate::cuda::vmm::Vmm;
use crate::error::{Error, ErrorKind, Result};
use crate::symm::backend::{Collective, Layout, PeerAccess, SymmBlock};
use crate::symm::cuda_plan::{self as plan, Multicast};
use crate::symm::request::RendezvousRequest;
use cudarc::driver::sys::{self, CUmemAllocationGranularity_flags_enum, CUmemAllocationHandleType_enum};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// One rank's block.
pub struct CudaBlock {
    pub(super) own: Arc<Vmm>,
    pub(super) layout: Layout,
    pub(super) device: i32,
    pub(super) granularity: usize,
    pub(super) multicast_capable: bool,
}

impl CudaBlock {
    /// Runs with `device`'s context current.
    pub(super) fn new(d: &Driver, features: &SymmFeatures, size: usize, device: i32, pad: usize) -> Result<CudaBlock> {
        for (attr, what) in [
            (plan::ATTR_VMM_SUPPORTED, "virtual memory management (cuMemCreate)"),
            (plan::ATTR_POSIX_FD_SUPPORTED, "POSIX file-descriptor handles for cuMemCreate memory"),
        ] {
            if d.device_attribute(device, attr)? == 0 {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("CUDA device {device} does not support {what}, which CUDA symmetric memory needs"),
                ));
            }
        }
        let mut prop = alloc_prop(device);
        if d.device_attribute(device, plan::ATTR_RDMA_WITH_VMM).unwrap_or(0) != 0 {
            prop.allocFlags.gpuDirectRDMACapable = 1;
        }
        let mut granularity = 0usize;
        // SAFETY: out-pointer ours; prop valid.
        check(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    CUmemAllocationGranularity_flags_enum::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            },
            || format!("cuMemGetAllocationGranularity on device {device}"),
        )?;
        let layout = plan::layout(size, pad, granularity)?;
        let mut own = Vmm::create(device, layout.block_size, &prop)?;
        own.map(granularity, "a symmetric block")?;
        // SAFETY: the pad lies at the start of the mapping just made.
        check(unsafe { sys::cuMemsetD8_v2(own.va, 0, pad) }, || "zeroing the signal pad".to_string())?;
        // SAFETY: plain driver call; the memset must be done before any
        // peer can see the block.
        check(unsafe { sys::cuCtxSynchronize() }, || "cuCtxSynchronize after zeroing the signal pad".to_string())?;
        // What this rank puts in its request: every local condition, so that
        // all ranks decide alike from the gathered requests.
        let multicast_capable = features.multicast_missing.is_none()
            && d.version >= plan::MULTICAST_MIN_DRIVER
            && !plan::env_flag(plan::DISABLE_MULTICAST_ENV)
            && d.device_attribute(device, plan::ATTR_MULTICAST_SUPPORTED).unwrap_or(0) != 0;
        Ok(CudaBlock { own: Arc::new(own), layout, device, granularity, multicast_capable })
    }
}

impl Drop for CudaBlock {
    fn drop(&mut self) {
        // PyTorch's order: synchronise the device, then unmap and release
        // (the Vmm's own drop, once the last rendezvous object let go).
        teardown(self.device, || {
            // SAFETY: plain driver call.
            unsafe { sys::cuCtxSynchronize() };
        });
    }
}

impl SymmBlock for CudaBlock {
    fn buffer_ptr(&self) -> *mut u8 {
        (self.own.va as usize + self.layout.buffer_offset) as *mut u8
    }

    fn device_idx(&self) -> i32 {
        self.device
    }

    fn layout(&self) -> Layout {
        self.layout
    }

    fn multicast_capable(&self) -> bool {
        self.multicast_capable
    }

    fn check_requests(&self, requests: &[RendezvousRequest], group: &str) -> Result<()> {
        plan::check_devices(requests, group, plan::env_flag(plan::ALLOW_OVERLAPPING_ENV)).map(|_| ())
    }

    fn export(&self) -> Result<OwnedFd> {
        let (d, _) = symm_driver()?;
        let handle = self.own.handle;
        d.with_device(self.device, || {
            let mut fd: libc::c_int = -1;
            // SAFETY: for POSIX descriptors the driver writes an int.
            check(
                unsafe {
                    sys::cuMemExportToShareableHandle(
                        (&mut fd as *mut libc::c_int).cast(),
                        handle,
                        CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    )
                },
                || "cuMemExportToShareableHandle of a symmetric block".to_string(),
            )?;
            if fd < 0 {
                return Err(Error::new(ErrorKind::CudaError, "cuMemExportToShareableHandle gave no descriptor"));
            }
            // SAFETY: the driver handed us this new descriptor.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })
    }

    fn import(
        &self,
        rank: usize,
        peers: Vec<Option<OwnedFd>>,
        requests: &[RendezvousRequest],
        coll: &dyn Collective,
    ) -> Result<Box<dyn PeerAccess>> {
        let (d, features) = symm_driver()?;
        let ws = peers.len();
        let layout = self.layout;
        let device = self.device;
        d.with_device(device, || {
            let mut mapped: Vec<Option<Vmm>> = Vec::with_capacity(ws);
            let mut bases = Vec::with_capacity(ws);
            for (r, fd) in peers.into_iter().enumerate() {
                if r == rank {
                    mapped.push(None);
                    bases.push(self.own.va);
                    continue;
                }
                let fd = fd.ok_or_else(|| Error::new(ErrorKind::Protocol, format!("no block descriptor from rank {r}")))?;
                let mut v = Vmm::import(device, layout.block_size, &fd, &format!("the block of rank {r}"))?;
                drop(fd); // the imported handle keeps the memory alive
                v.map(self.granularity, &format!("the block of rank {r}"))?;
                bases.push(v.va);
                mapped.push(Some(v));
            }
            let buffers: Vec<u64> = bases.iter().map(|b| b + layout.buffer_offset as u64).collect();
            let buffer_ptrs = DeviceArray::new(device, &buffers, "the buffer pointer array")?;
            let pad_ptrs = DeviceArray::new(device, &bases, "the signal pad pointer array")?;
            let module = Module::load(device)?;
            let records = HostRecords::new(device)?;
            let overlapping = plan::overlapping_devices(requests).is_some();
            let (multicast, multicast_off) = match plan::multicast_plan(
                requests,
                overlapping,
                plan::env_flag(plan::DISABLE_MULTICAST_ENV),
                d.version,
                features.multicast_missing.as_deref(),
            ) {
                Multicast::Off(why) => (None, why),
                Multicast::On => match self.setup_multicast(d, coll, rank, ws)? {
                    Ok(m) => (Some(m), String::new()),
                    Err(why) => (None, why),
                },
            };
            Ok(Box::new(CudaPeers {
                rank,
                ws,
                device,
                layout,
                bases,
                records,
                module,
                buffer_ptrs,
                pad_ptrs,
                multicast,
                peers: mapped,
                _own: self.own.clone(),
                launches: AtomicU64::new(0),
                multicast_off,
            }) as Box<dyn PeerAccess>)
        })
    }
}
