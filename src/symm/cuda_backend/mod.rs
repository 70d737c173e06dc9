//! The CUDA backend of symmetric memory (PyTorch's `CUDASymmetricMemory`,
//! docs/pytorch-compat.md), on the driver API loaded at run time:
//!
//! - a block is one `cuMemCreate` allocation (pinned, on the device,
//!   shareable as a POSIX file descriptor), its size rounded up to the
//!   recommended granularity, reserved and mapped with `cuMemAddressReserve`,
//!   `cuMemMap` and `cuMemSetAccess`, laid out `[signal pad | buffer]` with
//!   the pad zeroed (see [`super::cuda_plan::layout`]);
//! - the rendezvous exports it with `cuMemExportToShareableHandle`, the
//!   descriptors travel round the same socket ring as the CPU
//!   backend's, and every peer's block is imported and mapped here;
//! - put_signal / wait_signal / barrier are PTX kernels (`cuda_signals.ptx`,
//!   JIT-compiled by the driver) launched on the caller's stream; a kernel
//!   that times out writes a record into host-mapped memory and ends, and
//!   the next call on the same object reports it as `SS_ERR_TIMEOUT`.
//!
//! Without a driver or device every call fails with `CudaUnavailable` and
//! the reason (from [`crate::cuda::driver`]).

mod block;
mod kernels;
mod multicast;
mod peers;
mod records;

use crate::cuda::driver::symm_driver;
use crate::error::Result;
use crate::symm::backend::{SymmAllocator, SymmBlock};
use crate::symm::registry::is_finalizing;
use crate::symm::DeviceType;
use block::CudaBlock;

pub use kernels::{KERNELS, SIGNAL_PTX};

/// The CUDA allocator, registered by the library under PyTorch's name "CUDA".
pub struct CudaSymmAllocator;

impl SymmAllocator for CudaSymmAllocator {
    fn name(&self) -> &str {
        "CUDA"
    }

    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }

    fn alloc(&self, size: usize, device_idx: i32) -> Result<Box<dyn SymmBlock>> {
        let (d, features) = symm_driver()?;
        let pad = super::registry::signal_pad_size();
        let block = d.with_device(device_idx, || CudaBlock::new(d, features, size, device_idx, pad))?;
        Ok(Box::new(block))
    }
}

use crate::cuda::vmm::alloc_prop;

/// Runs `f` with `device`'s context current, for teardown: errors are
/// dropped (nothing can be done about them in a destructor), and nothing
/// runs while the process is finalizing, nor in a child forked after the
/// driver was initialised (no driver call is defined there; the child's
/// copy of the address space holds none of the driver's mappings anyway).
fn teardown(device: i32, f: impl FnOnce()) {
    if is_finalizing() {
        return;
    }
    crate::cuda::vmm::teardown(device, f)
}
