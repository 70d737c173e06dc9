//! Every rank's block mapped here, the device pointer arrays the kernels
//! take, and the kernel launches of put_signal, wait_signal and barrier.

use super::kernels::{Module, Op, KERNELS};
use super::multicast::McMapping;
use super::records::HostRecords;
use super::teardown;
use crate::cuda::driver::{check, symm_driver};
use crate::cuda::vmm::Vmm;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use crate::symm::backend::{Layout, PeerAccess};
use crate::symm::cuda_plan as plan;
use cudarc::driver::sys::{self, CUdeviceptr};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A small device array of u64 (the pointer arrays kernels take).
pub(super) struct DeviceArray {
    pub(super) device: i32,
    pub(super) ptr: CUdeviceptr,
}

impl DeviceArray {
    pub(super) fn new(device: i32, values: &[u64], what: &str) -> Result<DeviceArray> {
        let bytes = std::mem::size_of_val(values);
        let mut ptr = 0;
        // SAFETY: out-pointer ours.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(8)) }, || format!("cuMemAlloc for {what}"))?;
        let a = DeviceArray { device, ptr };
        // SAFETY: `bytes` from our slice into the allocation just made.
        check(unsafe { sys::cuMemcpyHtoD_v2(a.ptr, values.as_ptr().cast(), bytes) }, || format!("copying {what} to the device"))?;
        Ok(a)
    }
}

impl Drop for DeviceArray {
    fn drop(&mut self) {
        let ptr = self.ptr;
        // SAFETY: our allocation.
        teardown(self.device, || unsafe {
            sys::cuMemFree_v2(ptr);
        });
    }
}

/// Every rank's block mapped here, the pointer arrays, the kernels.
pub(super) struct CudaPeers {
    pub(super) rank: usize,
    pub(super) ws: usize,
    pub(super) device: i32,
    pub(super) layout: Layout,
    pub(super) bases: Vec<CUdeviceptr>,
    // Dropped in this order, after `Drop::drop` synchronised the device.
    pub(super) records: HostRecords,
    pub(super) module: Module,
    pub(super) buffer_ptrs: DeviceArray,
    pub(super) pad_ptrs: DeviceArray,
    /// The multicast mapping (unbound before our block goes).
    pub(super) multicast: Option<McMapping>,
    pub(super) peers: Vec<Option<Vmm>>,
    /// Our own block stays mapped while this object lives.
    pub(super) _own: Arc<Vmm>,
    /// Launches so far: picks each launch's timeout record.
    pub(super) launches: AtomicU64,
    /// Why there is no multicast (empty when there is).
    pub(super) multicast_off: String,
}

// SAFETY: driver handles and addresses only; the records are touched with
// volatile accesses, and `launches` is atomic.
unsafe impl Send for CudaPeers {}
// SAFETY: as above.
unsafe impl Sync for CudaPeers {}

impl Drop for CudaPeers {
    fn drop(&mut self) {
        // Kernels of ours may still be queued: let them end before the
        // mappings, kernels and records go.
        teardown(self.device, || {
            // SAFETY: plain driver call.
            unsafe { sys::cuCtxSynchronize() };
        });
        self.peers.clear();
    }
}

impl CudaPeers {
    /// Reports a timeout an earlier kernel recorded, then enqueues `op`.
    pub(super) fn launch(&self, op: Op, peer: usize, channel: usize, timeout: Timeout, stream: usize) -> Result<()> {
        // The driver first: in a forked child it refuses before the records
        // are touched (pinned host memory may be left out of a fork child's
        // address space, as pinned ranges often are, and then reading it
        // there faults).
        let (d, _) = symm_driver()?;
        if let Some(t) = self.records.take() {
            return Err(Error::new(ErrorKind::Timeout, t.message()));
        }
        let slot = (self.launches.fetch_add(1, Ordering::Relaxed) % plan::RECORDS as u64) as u32;
        let mut pads: u64 = self.pad_ptrs.ptr;
        let mut status: u64 = self.records.dev;
        let mut timeout_ns: u64 = plan::timeout_ns(timeout);
        let mut rank = self.rank as u32;
        let mut ws = self.ws as u32;
        let mut channel = channel as u32;
        let mut peer = peer as u32;
        let mut slot = slot;
        let mut params: [*mut c_void; 8] = [
            (&mut pads as *mut u64).cast(),
            (&mut status as *mut u64).cast(),
            (&mut timeout_ns as *mut u64).cast(),
            (&mut rank as *mut u32).cast(),
            (&mut ws as *mut u32).cast(),
            (&mut channel as *mut u32).cast(),
            (&mut peer as *mut u32).cast(),
            (&mut slot as *mut u32).cast(),
        ];
        let threads = match op {
            Op::Barrier => plan::barrier_threads(self.ws, self.module.max_threads[Op::Barrier as usize]),
            Op::Put | Op::Wait => 1,
        };
        let f = self.module.functions[op as usize] as sys::CUfunction;
        d.with_device(self.device, || {
            // SAFETY: `f` is a kernel of our live module whose parameters
            // are exactly these eight values (see cuda_signals.ptx); the
            // driver copies them before returning.
            check(
                unsafe {
                    sys::cuLaunchKernel(f, 1, 1, 1, threads, 1, 1, 0, stream as sys::CUstream, params.as_mut_ptr(), std::ptr::null_mut())
                },
                || format!("cuLaunchKernel({})", KERNELS[op as usize]),
            )
        })
    }
}

impl PeerAccess for CudaPeers {
    fn buffer_ptr(&self, rank: usize) -> *mut u8 {
        (self.bases[rank] as usize + self.layout.buffer_offset) as *mut u8
    }

    fn signal_pad_ptr(&self, rank: usize) -> *mut u8 {
        self.bases[rank] as usize as *mut u8
    }

    fn buffer_ptrs_dev(&self) -> Result<*mut u8> {
        Ok(self.buffer_ptrs.ptr as usize as *mut u8)
    }

    fn signal_pad_ptrs_dev(&self) -> Result<*mut u8> {
        Ok(self.pad_ptrs.ptr as usize as *mut u8)
    }

    fn multicast_ptr(&self) -> std::result::Result<*mut u8, String> {
        match &self.multicast {
            // The buffer's address in the multicast mapping of the block.
            Some(m) => Ok((m.va as usize + self.layout.buffer_offset) as *mut u8),
            None => Err(self.multicast_off.clone()),
        }
    }

    fn put_signal(&self, dst: usize, channel: usize, timeout: Timeout, stream: usize) -> Result<()> {
        self.launch(Op::Put, dst, channel, timeout, stream)
    }

    fn wait_signal(&self, src: usize, channel: usize, timeout: Timeout, stream: usize) -> Result<()> {
        self.launch(Op::Wait, src, channel, timeout, stream)
    }

    fn barrier(&self, channel: usize, timeout: Timeout, stream: usize) -> Result<()> {
        self.launch(Op::Barrier, 0, channel, timeout, stream)
    }
}
