//! The product's [`IpcBackend`]: CUDA driver calls, each made with the
//! device's primary context current (the one the CUDA runtime and PyTorch
//! use), so handles and events are compatible with theirs.

use super::backend::{IpcBackend, RawHandle};
use super::driver::{check, check_available, driver};
use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys::{self, CUevent_flags, CUipcMem_flags, CUpointer_attribute, CUresult};
use cudarc::driver::sys::{CUevent, CUipcEventHandle, CUipcMemHandle, CUstream};

/// Flags of the events a producer records: no timing (cheaper), usable by
/// other processes, and a host wait that sleeps instead of spinning.
const EVENT_FLAGS: u32 = CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
    | CUevent_flags::CU_EVENT_INTERPROCESS as u32
    | CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;

/// CUDA driver implementation of the device calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaBackend;

fn to_raw(bytes: &[libc::c_char; 64]) -> RawHandle {
    bytes.map(|b| b as u8)
}

fn from_raw(raw: &RawHandle) -> [libc::c_char; 64] {
    raw.map(|b| b as libc::c_char)
}

impl CudaBackend {
    /// `cuMemAlloc` of `nbytes` on `device`.
    pub fn alloc(&self, device: i32, nbytes: usize) -> Result<u64> {
        if nbytes == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "cannot allocate 0 bytes of device memory"));
        }
        driver()?.with_device(device, || {
            let mut ptr = 0;
            // SAFETY: out-pointer is ours; a context is current.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, nbytes) }, || format!("cuMemAlloc of {nbytes} bytes on device {device}"))?;
            Ok(ptr)
        })
    }

    /// `cuMemFree` of memory from [`CudaBackend::alloc`] (or cudaMalloc).
    pub fn free(&self, device: i32, ptr: u64) -> Result<()> {
        driver()?.with_device(device, || {
            // SAFETY: the caller hands over an allocation it owns.
            check(unsafe { sys::cuMemFree_v2(ptr) }, || format!("cuMemFree of 0x{ptr:x} on device {device}"))
        })
    }
}

impl IpcBackend for CudaBackend {
    fn check_available(&self) -> Result<()> {
        check_available()
    }

    fn allocation_range(&self, device: i32, ptr: u64) -> Result<(u64, usize)> {
        driver()?.with_device(device, || {
            let mut ordinal: i32 = -1;
            // SAFETY: the attribute is an int written into our variable.
            let r = unsafe {
                sys::cuPointerGetAttribute((&mut ordinal as *mut i32).cast(), CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
            };
            if r != CUresult::CUDA_SUCCESS {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("0x{ptr:x} is not CUDA device memory: {}", super::driver::describe(r)),
                ));
            }
            if ordinal != device {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("0x{ptr:x} is memory of CUDA device {ordinal}, not of device {device}"),
                ));
            }
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers are ours.
            check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }, || {
                format!("cuMemGetAddressRange of 0x{ptr:x} on device {device}")
            })?;
            Ok((base, size))
        })
    }

    fn export_memory(&self, device: i32, base: u64) -> Result<RawHandle> {
        driver()?.with_device(device, || {
            let mut h = CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: out-pointer is ours; base is an allocation's start.
            check(unsafe { sys::cuIpcGetMemHandle(&mut h, base) }, || {
                format!("cuIpcGetMemHandle of the allocation at 0x{base:x} on device {device} (memory from cudaMallocAsync pools or cuMemCreate cannot be shared this way)")
            })?;
            Ok(to_raw(&h.reserved))
        })
    }

    fn record_event(&self, device: i32, stream: u64) -> Result<(u64, RawHandle)> {
        driver()?.with_device(device, || {
            let mut ev: CUevent = std::ptr::null_mut();
            // SAFETY: out-pointer is ours.
            check(unsafe { sys::cuEventCreate(&mut ev, EVENT_FLAGS) }, || format!("cuEventCreate on device {device}"))?;
            let mut h = CUipcEventHandle { reserved: [0; 64] };
            // SAFETY: ev is the live event made above; the stream is the caller's.
            let recorded = check(unsafe { sys::cuEventRecord(ev, stream as CUstream) }, || {
                format!("cuEventRecord on stream 0x{stream:x} of device {device}")
            })
            .and_then(|_| {
                // SAFETY: as above.
                check(unsafe { sys::cuIpcGetEventHandle(&mut h, ev) }, || format!("cuIpcGetEventHandle on device {device}"))
            });
            if let Err(e) = recorded {
                // SAFETY: destroying the event we made; nothing else has it.
                unsafe { sys::cuEventDestroy_v2(ev) };
                return Err(e);
            }
            Ok((ev as u64, to_raw(&h.reserved)))
        })
    }

    fn destroy_event(&self, device: i32, event: u64) -> Result<()> {
        driver()?.with_device(device, || {
            // SAFETY: an event from record_event, destroyed once.
            check(unsafe { sys::cuEventDestroy_v2(event as CUevent) }, || format!("cuEventDestroy on device {device}"))
        })
    }

    fn sync_stream(&self, device: i32, stream: u64) -> Result<()> {
        driver()?.with_device(device, || {
            // SAFETY: the caller's stream (0 = the legacy default stream).
            check(unsafe { sys::cuStreamSynchronize(stream as CUstream) }, || {
                format!("cuStreamSynchronize of stream 0x{stream:x} on device {device}")
            })
        })
    }

    fn open_memory(&self, device: i32, handle: &RawHandle) -> Result<(u64, usize)> {
        driver()?.with_device(device, || {
            let mut base = 0u64;
            let h = CUipcMemHandle { reserved: from_raw(handle) };
            let flags = CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: out-pointer is ours; the handle is 64 plain bytes.
            check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, flags) }, || {
                format!(
                    "cuIpcOpenMemHandle on device {device} (the producer may have exited or freed the memory, or it is this same process)"
                )
            })?;
            let (mut start, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers are ours.
            let range = check(unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) }, || {
                format!("cuMemGetAddressRange of opened memory 0x{base:x}")
            });
            if let Err(e) = range {
                // SAFETY: closing the mapping we just opened.
                unsafe { sys::cuIpcCloseMemHandle(base) };
                return Err(e);
            }
            Ok((base, size))
        })
    }

    fn close_memory(&self, device: i32, base: u64) -> Result<()> {
        driver()?.with_device(device, || {
            // SAFETY: a base from open_memory, closed once.
            check(unsafe { sys::cuIpcCloseMemHandle(base) }, || format!("cuIpcCloseMemHandle of 0x{base:x} on device {device}"))
        })
    }

    fn wait_event(&self, device: i32, handle: &RawHandle, stream: u64) -> Result<()> {
        driver()?.with_device(device, || {
            let mut ev: CUevent = std::ptr::null_mut();
            let h = CUipcEventHandle { reserved: from_raw(handle) };
            // SAFETY: out-pointer is ours.
            check(unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) }, || {
                format!("cuIpcOpenEventHandle on device {device} (has the producer exited?)")
            })?;
            // SAFETY: ev is live; the stream is the caller's.
            let waited = check(unsafe { sys::cuStreamWaitEvent(stream as CUstream, ev, 0) }, || {
                format!("cuStreamWaitEvent on stream 0x{stream:x} of device {device}")
            });
            // The wait is queued with the event's state captured, so the
            // opened copy can go now (PyTorch leaks it).
            // SAFETY: destroying the event we opened.
            unsafe { sys::cuEventDestroy_v2(ev) };
            waited
        })
    }
}
