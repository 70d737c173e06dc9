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

use super::backend::{Collective, Layout, PeerAccess, SymmAllocator, SymmBlock};
use super::cuda_plan::{self as plan, Multicast, Undo, VmmProgress};
use super::registry::is_finalizing;
use super::request::RendezvousRequest;
use super::DeviceType;
use crate::cuda::driver::{check, symm_driver, Driver, SymmFeatures};
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccess_flags_enum, CUmemAllocationGranularity_flags_enum, CUmemAllocationHandleType_enum,
    CUmemAllocationType_enum, CUmemGenericAllocationHandle, CUmemLocationType_enum,
};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

/// The signal kernels, NUL-terminated for `cuModuleLoadDataEx`.
pub const SIGNAL_PTX: &str = concat!(include_str!("cuda_signals.ptx"), "\0");
/// Kernel names in the PTX, in `Op` order.
pub const KERNELS: [&str; 3] = ["ss_symm_put_signal", "ss_symm_wait_signal", "ss_symm_barrier"];

#[derive(Clone, Copy)]
enum Op {
    Put = 0,
    Wait = 1,
    Barrier = 2,
}

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

fn alloc_prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is valid (enum fields 0 = INVALID)
    // and every field that matters is set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = CUmemAllocationType_enum::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type_ = CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    p
}

/// Runs `f` with `device`'s context current, for teardown: errors are
/// dropped (nothing can be done about them in a destructor), and nothing
/// runs while the process is finalizing, nor in a child forked after the
/// driver was initialised (no driver call is defined there; the child's
/// copy of the address space holds none of the driver's mappings anyway).
fn teardown(device: i32, f: impl FnOnce()) {
    if is_finalizing() {
        return;
    }
    if let Ok(d) = crate::cuda::driver::driver() {
        if d.in_forked_child() {
            return;
        }
        let _ = d.with_device(device, || {
            f();
            Ok(())
        });
    }
}

/// One mapped allocation (ours or a peer's): the handle, its address range
/// and how far they were made, so a failure half-way undoes exactly that.
struct Vmm {
    device: i32,
    handle: CUmemGenericAllocationHandle,
    va: CUdeviceptr,
    size: usize,
    progress: VmmProgress,
}

impl Vmm {
    /// A new allocation of `size` bytes on `device` (context current).
    fn create(device: i32, size: usize, prop: &sys::CUmemAllocationProp) -> Result<Vmm> {
        let mut v = Vmm { device, handle: 0, va: 0, size, progress: VmmProgress::default() };
        // SAFETY: out-pointer ours; prop is a valid property struct.
        check(unsafe { sys::cuMemCreate(&mut v.handle, size, prop, 0) }, || format!("cuMemCreate of {size} bytes on device {device}"))?;
        v.progress.handle = true;
        Ok(v)
    }

    /// A peer's allocation from the descriptor it sent (context current).
    fn import(device: i32, size: usize, fd: &OwnedFd, rank: usize) -> Result<Vmm> {
        let mut v = Vmm { device, handle: 0, va: 0, size, progress: VmmProgress::default() };
        // SAFETY: for POSIX descriptors the driver takes the fd's value in
        // the pointer argument; the descriptor stays open during the call.
        check(
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut v.handle,
                    fd.as_raw_fd() as usize as *mut c_void,
                    CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            },
            || format!("cuMemImportFromShareableHandle of the block of rank {rank}"),
        )?;
        v.progress.handle = true;
        Ok(v)
    }

    /// Reserves an address range, maps the handle there and gives `device`
    /// read-write access.
    fn map(&mut self, alignment: usize, what: &str) -> Result<()> {
        let size = self.size;
        // SAFETY: out-pointer ours; no fixed address asked.
        check(unsafe { sys::cuMemAddressReserve(&mut self.va, size, alignment, 0, 0) }, || {
            format!("cuMemAddressReserve of {size} bytes for {what}")
        })?;
        self.progress.reserved = true;
        // SAFETY: range and handle are ours, both of `size` bytes.
        check(unsafe { sys::cuMemMap(self.va, size, 0, self.handle, 0) }, || format!("cuMemMap of {what}"))?;
        self.progress.mapped = true;
        // SAFETY: a plain C struct; every field set.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location.type_ = CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = self.device;
        access.flags = CUmemAccess_flags_enum::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range was mapped above; one descriptor.
        check(unsafe { sys::cuMemSetAccess(self.va, size, &access, 1) }, || format!("cuMemSetAccess of {what}"))
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let steps = plan::undo_steps(self.progress, false);
        let (va, size, handle) = (self.va, self.size, self.handle);
        teardown(self.device, || {
            for step in steps {
                // SAFETY: each step undoes what `progress` says was made.
                unsafe {
                    match step {
                        Undo::Unmap => sys::cuMemUnmap(va, size),
                        Undo::AddressFree => sys::cuMemAddressFree(va, size),
                        Undo::Release => sys::cuMemRelease(handle),
                    };
                }
            }
        });
    }
}

/// One rank's block.
pub struct CudaBlock {
    own: Arc<Vmm>,
    layout: Layout,
    device: i32,
    granularity: usize,
    multicast_capable: bool,
}

// SAFETY: the fields are plain numbers (driver handles and addresses).
unsafe impl Send for Vmm {}
// SAFETY: as above; a Vmm is never changed after construction.
unsafe impl Sync for Vmm {}

impl CudaBlock {
    /// Runs with `device`'s context current.
    fn new(d: &Driver, features: &SymmFeatures, size: usize, device: i32, pad: usize) -> Result<CudaBlock> {
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
                let mut v = Vmm::import(device, layout.block_size, &fd, r)?;
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

/// A small device array of u64 (the pointer arrays kernels take).
struct DeviceArray {
    device: i32,
    ptr: CUdeviceptr,
}

impl DeviceArray {
    fn new(device: i32, values: &[u64], what: &str) -> Result<DeviceArray> {
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

/// The signal kernels loaded in a device's primary context.
struct Module {
    device: i32,
    module: usize,
    functions: [usize; 3],
    /// Each kernel's `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` on the device.
    max_threads: [u32; 3],
}

impl Module {
    fn load(device: i32) -> Result<Module> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // The JIT's error log, so a rejected kernel says why.
        let mut log = vec![0u8; 4096];
        let mut options = [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
        // SAFETY: NUL-terminated PTX; two options whose values are the log
        // buffer and its size (passed by value in the pointer, as the API
        // wants); out-pointer ours.
        let r = unsafe { sys::cuModuleLoadDataEx(&mut module, SIGNAL_PTX.as_ptr().cast(), 2, options.as_mut_ptr(), values.as_mut_ptr()) };
        check(r, || {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
            format!(
                "cuModuleLoadDataEx of the signal kernels (PTX JIT) on device {device}{}",
                if text.is_empty() { String::new() } else { format!(" [JIT log: {text}]") }
            )
        })?;
        let mut m = Module { device, module: module as usize, functions: [0; 3], max_threads: [0; 3] };
        for (i, name) in KERNELS.iter().enumerate() {
            let c = std::ffi::CString::new(*name).expect("kernel names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: live module, NUL-terminated name, out-pointer ours.
            check(unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) }, || format!("cuModuleGetFunction({name})"))?;
            m.functions[i] = f as usize;
            // Asking an attribute finishes loading the kernel now (under lazy
            // loading a handle may be only partly loaded, and a load at the
            // first launch may need the context idle, which it never is
            // while our own wait kernel spins for that launch's signal), and
            // gives the block size limit the barrier launch must respect.
            let mut most = 0;
            // SAFETY: live function, out-pointer ours.
            check(
                unsafe { sys::cuFuncGetAttribute(&mut most, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f) },
                || format!("cuFuncGetAttribute(MAX_THREADS_PER_BLOCK) of {name}"),
            )?;
            m.max_threads[i] = most.max(0) as u32;
        }
        Ok(m)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let module = self.module as sys::CUmodule;
        // SAFETY: our module; no launch of it is pending (synchronised first).
        teardown(self.device, || unsafe {
            sys::cuModuleUnload(module);
        });
    }
}

/// The host-mapped timeout records (see `cuda_signals.ptx`).
struct HostRecords {
    device: i32,
    host: usize,
    dev: CUdeviceptr,
}

impl HostRecords {
    fn new(device: i32) -> Result<HostRecords> {
        let bytes = plan::RECORDS * plan::RECORD_BYTES;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: out-pointer ours.
        check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }, || "cuMemHostAlloc for the timeout records".to_string())?;
        let mut r = HostRecords { device, host: host as usize, dev: 0 };
        // SAFETY: `bytes` of pinned host memory just allocated.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        // SAFETY: mapped pinned memory; out-pointer ours.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut r.dev, host, 0) }, || {
            "cuMemHostGetDevicePointer for the timeout records".to_string()
        })?;
        Ok(r)
    }

    /// The first timeout a kernel recorded, clearing its record.
    fn take(&self) -> Option<plan::DeviceTimeout> {
        // SAFETY: `host` holds RECORDS records of 8 words, mapped while self lives.
        unsafe { take_record(self.host as *mut u32) }
    }
}

/// Scans the records at `base` (RECORDS × 8 u32 words) for one a kernel
/// wrote, clears it and returns it. The device writes the records, so
/// every access is volatile; the state word is written last (release) on
/// the device, and read first here, before an acquire fence.
///
/// # Safety
/// `base` points at RECORDS × 8 readable and writable u32 words.
unsafe fn take_record(base: *mut u32) -> Option<plan::DeviceTimeout> {
    let words_per = plan::RECORD_BYTES / 4;
    for rec in 0..plan::RECORDS {
        // SAFETY: inside the records, per the contract.
        let at = |i: usize| unsafe { base.add(rec * words_per + i) };
        // SAFETY: as above.
        if unsafe { std::ptr::read_volatile(at(0)) } != plan::RECORD_WRITTEN {
            continue;
        }
        fence(Ordering::Acquire);
        let mut words = [0u32; 8];
        for (i, w) in words.iter_mut().enumerate() {
            // SAFETY: as above.
            *w = unsafe { std::ptr::read_volatile(at(i)) };
        }
        // SAFETY: as above; the kernel that wrote this record has ended.
        unsafe { std::ptr::write_volatile(at(0), 0) };
        return plan::parse_record(words);
    }
    None
}

impl Drop for HostRecords {
    fn drop(&mut self) {
        let host = self.host as *mut c_void;
        // SAFETY: our allocation; no kernel uses it any more.
        teardown(self.device, || unsafe {
            sys::cuMemFreeHost(host);
        });
    }
}

/// Every rank's block mapped here, the pointer arrays, the kernels.
struct CudaPeers {
    rank: usize,
    ws: usize,
    device: i32,
    layout: Layout,
    bases: Vec<CUdeviceptr>,
    // Dropped in this order, after `Drop::drop` synchronised the device.
    records: HostRecords,
    module: Module,
    buffer_ptrs: DeviceArray,
    pad_ptrs: DeviceArray,
    /// The multicast mapping (unbound before our block goes).
    multicast: Option<McMapping>,
    peers: Vec<Option<Vmm>>,
    /// Our own block stays mapped while this object lives.
    _own: Arc<Vmm>,
    /// Launches so far: picks each launch's timeout record.
    launches: AtomicU64,
    /// Why there is no multicast (empty when there is).
    multicast_off: String,
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
    fn launch(&self, op: Op, peer: usize, channel: usize, timeout: Timeout, stream: usize) -> Result<()> {
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

/// `CUmulticastObjectProp` (CUDA 12.1; not in cudarc's 12.0 bindings).
#[repr(C)]
struct McProp {
    num_devices: libc::c_uint,
    size: usize,
    handle_types: libc::c_ulonglong,
    flags: libc::c_ulonglong,
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` as the multicast property's bit mask.
const MC_HANDLE_POSIX_FD: libc::c_ulonglong = 1;
/// `CU_MULTICAST_GRANULARITY_MINIMUM`.
const MC_GRANULARITY_MINIMUM: libc::c_int = 0;

type McCreate = unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *const McProp) -> sys::CUresult;
type McAddDevice = unsafe extern "C" fn(CUmemGenericAllocationHandle, sys::CUdevice) -> sys::CUresult;
type McBindMem = unsafe extern "C" fn(
    CUmemGenericAllocationHandle,
    usize,
    CUmemGenericAllocationHandle,
    usize,
    usize,
    libc::c_ulonglong,
) -> sys::CUresult;
type McUnbind = unsafe extern "C" fn(CUmemGenericAllocationHandle, sys::CUdevice, usize, usize) -> sys::CUresult;
type McGranularity = unsafe extern "C" fn(*mut usize, *const McProp, libc::c_int) -> sys::CUresult;

/// The multicast entry points, looked up by name (checked present by
/// `symm_driver` before multicast is ever attempted).
#[derive(Clone, Copy)]
struct McFns {
    create: McCreate,
    add_device: McAddDevice,
    bind_mem: McBindMem,
    unbind: McUnbind,
    granularity: McGranularity,
}

impl McFns {
    fn load(d: &Driver) -> std::result::Result<McFns, String> {
        let get = |name: &str| d.symbol(name).ok_or_else(|| format!("the driver library {} lacks {name}", d.library));
        // SAFETY: each symbol has the C signature of its type alias above
        // (CUDA 12.1+ driver API).
        unsafe {
            Ok(McFns {
                create: std::mem::transmute::<*mut c_void, McCreate>(get("cuMulticastCreate")?),
                add_device: std::mem::transmute::<*mut c_void, McAddDevice>(get("cuMulticastAddDevice")?),
                bind_mem: std::mem::transmute::<*mut c_void, McBindMem>(get("cuMulticastBindMem")?),
                unbind: std::mem::transmute::<*mut c_void, McUnbind>(get("cuMulticastUnbind")?),
                granularity: std::mem::transmute::<*mut c_void, McGranularity>(get("cuMulticastGetGranularity")?),
            })
        }
    }
}

/// This rank's share of the block's multicast object: the handle, the
/// binding of our block to it, and its mapping here.
struct McMapping {
    fns: McFns,
    device: i32,
    cu_device: sys::CUdevice,
    handle: CUmemGenericAllocationHandle,
    va: CUdeviceptr,
    size: usize,
    has_handle: bool,
    bound: bool,
    reserved: bool,
    mapped: bool,
}

// SAFETY: driver handles, addresses and function pointers only.
unsafe impl Send for McMapping {}
// SAFETY: as above; never changed once built.
unsafe impl Sync for McMapping {}

impl Drop for McMapping {
    fn drop(&mut self) {
        let m = &*self;
        // PyTorch's order: unmap, unbind, release.
        teardown(m.device, || {
            // SAFETY: each call undoes a step that succeeded.
            unsafe {
                if m.mapped {
                    sys::cuMemUnmap(m.va, m.size);
                }
                if m.reserved {
                    sys::cuMemAddressFree(m.va, m.size);
                }
                if m.bound {
                    (m.fns.unbind)(m.handle, m.cu_device, 0, m.size);
                }
                if m.has_handle {
                    sys::cuMemRelease(m.handle);
                }
            }
        });
    }
}

impl CudaBlock {
    fn mc_prop(&self, ws: usize) -> McProp {
        McProp { num_devices: ws as libc::c_uint, size: self.layout.block_size, handle_types: MC_HANDLE_POSIX_FD, flags: 0 }
    }

    /// The multicast granularity for this block; its size must be a multiple.
    fn mc_granularity(&self, fns: &McFns, ws: usize) -> Result<usize> {
        let prop = self.mc_prop(ws);
        let mut g = 0usize;
        // SAFETY: out-pointer ours; prop valid.
        check(unsafe { (fns.granularity)(&mut g, &prop, MC_GRANULARITY_MINIMUM) }, || "cuMulticastGetGranularity".to_string())?;
        if g == 0 || self.layout.block_size % g != 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("the block of {} bytes is not a multiple of the multicast granularity {g}", self.layout.block_size),
            ));
        }
        Ok(g)
    }

    /// Rank 0: a multicast object for `ws` devices of the block's size,
    /// exported as a descriptor.
    fn create_multicast(&self, fns: &McFns, ws: usize, mc: &mut McMapping) -> Result<OwnedFd> {
        self.mc_granularity(fns, ws)?;
        let prop = self.mc_prop(ws);
        // SAFETY: out-pointer ours; prop valid.
        check(unsafe { (fns.create)(&mut mc.handle, &prop) }, || "cuMulticastCreate".to_string())?;
        mc.has_handle = true;
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX descriptors the driver writes an int.
        check(
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut libc::c_int).cast(),
                    mc.handle,
                    CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            || "cuMemExportToShareableHandle of the multicast object".to_string(),
        )?;
        if fd < 0 {
            return Err(Error::new(ErrorKind::CudaError, "cuMemExportToShareableHandle gave no descriptor"));
        }
        // SAFETY: the driver handed us this new descriptor.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Step 1 on every rank: have the handle (import it from rank 0's
    /// descriptor) and add our device to it.
    fn join_multicast(&self, fns: &McFns, mc: &mut McMapping, fd: Option<&OwnedFd>) -> Result<()> {
        if let Some(fd) = fd {
            // SAFETY: the fd's value in the pointer argument, as for blocks.
            check(
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut mc.handle,
                        fd.as_raw_fd() as usize as *mut c_void,
                        CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                || "cuMemImportFromShareableHandle of the multicast object".to_string(),
            )?;
            mc.has_handle = true;
        }
        if !mc.has_handle {
            return Err(Error::new(ErrorKind::CudaError, "rank 0 sent no multicast object"));
        }
        // SAFETY: live handle; our device.
        check(unsafe { (fns.add_device)(mc.handle, mc.cu_device) }, || format!("cuMulticastAddDevice(device {})", self.device))
    }

    /// Step 2, once every device was added: bind our block, map the object
    /// here, give our device access.
    fn bind_multicast(&self, fns: &McFns, mc: &mut McMapping, ws: usize) -> Result<()> {
        let g = self.mc_granularity(fns, ws)?;
        let size = mc.size;
        // SAFETY: both handles live; offsets 0, the whole block.
        check(unsafe { (fns.bind_mem)(mc.handle, 0, self.own.handle, 0, size, 0) }, || "cuMulticastBindMem".to_string())?;
        mc.bound = true;
        // SAFETY: out-pointer ours.
        check(unsafe { sys::cuMemAddressReserve(&mut mc.va, size, g, 0, 0) }, || "cuMemAddressReserve for multicast".to_string())?;
        mc.reserved = true;
        // SAFETY: range and handle ours, both of `size` bytes.
        check(unsafe { sys::cuMemMap(mc.va, size, 0, mc.handle, 0) }, || "cuMemMap of the multicast object".to_string())?;
        mc.mapped = true;
        // SAFETY: a plain C struct; every field set.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location.type_ = CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = self.device;
        access.flags = CUmemAccess_flags_enum::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range was mapped above.
        check(unsafe { sys::cuMemSetAccess(mc.va, size, &access, 1) }, || "cuMemSetAccess of the multicast mapping".to_string())
    }

    /// PyTorch's multicast set-up (docs/pytorch-compat.md, multicast), run by every rank when the
    /// gathered requests allow it: rank 0 creates and exports the object,
    /// broadcasts the descriptor, every rank imports it and adds its device,
    /// then (all added) binds its block and maps the object. After each step
    /// the ranks all-gather whether it worked here, so either all have
    /// multicast or none (`Ok(Err(reason))`); only a failing collective
    /// (timeout, dead peer) fails the rendezvous.
    fn setup_multicast(&self, d: &Driver, coll: &dyn Collective, rank: usize, ws: usize) -> Result<std::result::Result<McMapping, String>> {
        let fns = McFns::load(d);
        let mut cu_device = 0;
        // SAFETY: out-pointer ours; the ordinal was checked at allocation.
        check(unsafe { sys::cuDeviceGet(&mut cu_device, self.device) }, || format!("cuDeviceGet({})", self.device))?;
        let mut own_error: Option<String> = fns.as_ref().err().cloned();
        let mut mc = fns.ok().map(|fns| McMapping {
            fns,
            device: self.device,
            cu_device,
            handle: 0,
            va: 0,
            size: self.layout.block_size,
            has_handle: false,
            bound: false,
            reserved: false,
            mapped: false,
        });
        let mut export: Option<OwnedFd> = None;
        if rank == 0 {
            if let Some(m) = mc.as_mut() {
                let fns = m.fns;
                match self.create_multicast(&fns, ws, m) {
                    Ok(fd) => export = Some(fd),
                    Err(e) => own_error = Some(e.message().to_string()),
                }
            }
        }
        // No ring message may still be in flight when the broadcast starts.
        coll.all_gather(&[1])?;
        let got = coll.broadcast_fd(0, export.as_ref().map(|f| f.as_raw_fd()))?;
        drop(export);
        let joined = match (mc.as_mut(), &own_error) {
            (Some(m), None) => {
                let fns = m.fns;
                self.join_multicast(&fns, m, got.as_ref()).map_err(|e| e.message().to_string())
            }
            (_, Some(e)) => Err(e.clone()),
            (None, None) => Err("no multicast entry points".to_string()),
        };
        drop(got);
        let flags = coll.all_gather(&[joined.is_ok() as u8])?;
        if let Some(why) = plan::multicast_step_failed("import", &flags, rank, joined.as_ref().err().map(String::as_str)) {
            return Ok(Err(why));
        }
        let Some(mut m) = mc else {
            return Ok(Err("no multicast entry points".to_string()));
        };
        let fns = m.fns;
        let bound = self.bind_multicast(&fns, &mut m, ws).map_err(|e| e.message().to_string());
        let flags = coll.all_gather(&[bound.is_ok() as u8])?;
        if let Some(why) = plan::multicast_step_failed("bind", &flags, rank, bound.as_ref().err().map(String::as_str)) {
            return Ok(Err(why));
        }
        Ok(Ok(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_taken_one_at_a_time_and_cleared() {
        let mut mem = vec![0u32; plan::RECORDS * plan::RECORD_BYTES / 4];
        // SAFETY: the vector has exactly the records' size.
        assert_eq!(unsafe { take_record(mem.as_mut_ptr()) }, None);
        // Two kernels timed out: records 5 (a barrier) and 63 (a put).
        mem[5 * 8..6 * 8].copy_from_slice(&[2, 3, 2, 0, 1, 4, 7_000_000, 0]);
        mem[63 * 8..64 * 8].copy_from_slice(&[2, 1, 1, 0, 1, 9, 1, 0]);
        // A record still being written (state not 2) is not taken.
        mem[7 * 8] = 1;
        let first = unsafe { take_record(mem.as_mut_ptr()) }.unwrap();
        assert_eq!((first.op, first.send, first.peer, first.channel, first.elapsed_ns), ("barrier", false, 1, 4, 7_000_000));
        assert_eq!(mem[5 * 8], 0, "cleared");
        let second = unsafe { take_record(mem.as_mut_ptr()) }.unwrap();
        assert_eq!((second.op, second.send, second.channel), ("put_signal", true, 9));
        assert_eq!(unsafe { take_record(mem.as_mut_ptr()) }, None);
        assert_eq!(mem[7 * 8], 1, "the unfinished record is left alone");
    }

    #[test]
    fn ptx_is_embedded_with_every_kernel_and_a_nul() {
        assert!(SIGNAL_PTX.ends_with('\0'));
        assert_eq!(SIGNAL_PTX.matches('\0').count(), 1);
        for k in KERNELS {
            assert!(SIGNAL_PTX.contains(&format!(".visible .entry {k}(")), "{k}");
        }
        // The three kernels take the eight parameters `launch` passes.
        assert_eq!(SIGNAL_PTX.matches(".param .u32 p_slot").count(), 3);
        assert_eq!(SIGNAL_PTX.matches(".param .u64 p_pads").count(), 3);
        // Each kernel writes the record as `parse_record` reads it: fields
        // at words 1-5, the elapsed u64 at byte 24, the state (2) last.
        for (field, count) in [("[%rd10+4]", 3), ("[%rd10+8]", 3), ("[%rd10+12], %r1", 3), ("[%rd10+16], %r4", 3), ("[%rd10+20], %r3", 3)] {
            assert_eq!(SIGNAL_PTX.matches(&format!("st.relaxed.sys.global.u32 {field}")).count(), count, "{field}");
        }
        assert_eq!(SIGNAL_PTX.matches("st.relaxed.sys.global.u64 [%rd10+24], %rd9;").count(), 3);
        assert_eq!(SIGNAL_PTX.matches(&format!("st.release.sys.global.u32 [%rd10], {};", plan::RECORD_WRITTEN)).count(), 3);
        assert_eq!(SIGNAL_PTX.matches(&format!("mul.wide.u32 %rd10, %r5, {};", plan::RECORD_BYTES)).count(), 3);
        // The op codes: put 1, wait 2, barrier 3.
        for op in 1..=3 {
            assert_eq!(SIGNAL_PTX.matches(&format!("st.relaxed.sys.global.u32 [%rd10+4], {op};")).count(), 1, "op {op}");
        }
    }
}
