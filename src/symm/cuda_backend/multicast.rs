//! The multicast object of a block (CUDA 12.1 entry points, looked up by
//! name): creating it, joining it, binding our block to it.

use super::block::CudaBlock;
use super::teardown;
use crate::cuda::driver::{check, Driver};
use crate::error::{Error, ErrorKind, Result};
use crate::symm::backend::Collective;
use crate::symm::cuda_plan as plan;
use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccess_flags_enum, CUmemAllocationHandleType_enum, CUmemGenericAllocationHandle, CUmemLocationType_enum,
};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `CUmulticastObjectProp` (CUDA 12.1; not in cudarc's 12.0 bindings).
#[repr(C)]
pub(super) struct McProp {
    pub(super) num_devices: libc::c_uint,
    pub(super) size: usize,
    pub(super) handle_types: libc::c_ulonglong,
    pub(super) flags: libc::c_ulonglong,
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` as the multicast property's bit mask.
pub(super) const MC_HANDLE_POSIX_FD: libc::c_ulonglong = 1;
/// `CU_MULTICAST_GRANULARITY_MINIMUM`.
pub(super) const MC_GRANULARITY_MINIMUM: libc::c_int = 0;

pub(super) type McCreate = unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *const McProp) -> sys::CUresult;
pub(super) type McAddDevice = unsafe extern "C" fn(CUmemGenericAllocationHandle, sys::CUdevice) -> sys::CUresult;
pub(super) type McBindMem = unsafe extern "C" fn(
    CUmemGenericAllocationHandle,
    usize,
    CUmemGenericAllocationHandle,
    usize,
    usize,
    libc::c_ulonglong,
) -> sys::CUresult;
pub(super) type McUnbind = unsafe extern "C" fn(CUmemGenericAllocationHandle, sys::CUdevice, usize, usize) -> sys::CUresult;
pub(super) type McGranularity = unsafe extern "C" fn(*mut usize, *const McProp, libc::c_int) -> sys::CUresult;

/// The multicast entry points, looked up by name (checked present by
/// `symm_driver` before multicast is ever attempted).
#[derive(Clone, Copy)]
pub(super) struct McFns {
    pub(super) create: McCreate,
    pub(super) add_device: McAddDevice,
    pub(super) bind_mem: McBindMem,
    pub(super) unbind: McUnbind,
    pub(super) granularity: McGranularity,
}

impl McFns {
    pub(super) fn load(d: &Driver) -> std::result::Result<McFns, String> {
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
pub(super) struct McMapping {
    pub(super) fns: McFns,
    pub(super) device: i32,
    pub(super) cu_device: sys::CUdevice,
    pub(super) handle: CUmemGenericAllocationHandle,
    pub(super) va: CUdeviceptr,
    pub(super) size: usize,
    pub(super) has_handle: bool,
    pub(super) bound: bool,
    pub(super) reserved: bool,
    pub(super) mapped: bool,
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
    pub(super) fn mc_prop(&self, ws: usize) -> McProp {
        McProp { num_devices: ws as libc::c_uint, size: self.layout.block_size, handle_types: MC_HANDLE_POSIX_FD, flags: 0 }
    }

    /// The multicast granularity for this block; its size must be a multiple.
    pub(super) fn mc_granularity(&self, fns: &McFns, ws: usize) -> Result<usize> {
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
    pub(super) fn create_multicast(&self, fns: &McFns, ws: usize, mc: &mut McMapping) -> Result<OwnedFd> {
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
    pub(super) fn join_multicast(&self, fns: &McFns, mc: &mut McMapping, fd: Option<&OwnedFd>) -> Result<()> {
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
    pub(super) fn bind_multicast(&self, fns: &McFns, mc: &mut McMapping, ws: usize) -> Result<()> {
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
    pub(super) fn setup_multicast(
        &self,
        d: &Driver,
        coll: &dyn Collective,
        rank: usize,
        ws: usize,
    ) -> Result<std::result::Result<McMapping, String>> {
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
