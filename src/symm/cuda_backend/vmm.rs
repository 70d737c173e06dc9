//! One mapped allocation of device memory (ours or a peer's) and how far
//! its making got, so a failure half-way undoes exactly that.

use super::teardown;
use crate::cuda::driver::check;
use crate::error::Result;
use crate::symm::cuda_plan::{self as plan, Undo, VmmProgress};
use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccess_flags_enum, CUmemAllocationHandleType_enum, CUmemGenericAllocationHandle, CUmemLocationType_enum,
};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};

/// One mapped allocation (ours or a peer's): the handle, its address range
/// and how far they were made, so a failure half-way undoes exactly that.
pub(super) struct Vmm {
    pub(super) device: i32,
    pub(super) handle: CUmemGenericAllocationHandle,
    pub(super) va: CUdeviceptr,
    pub(super) size: usize,
    pub(super) progress: VmmProgress,
}

impl Vmm {
    /// A new allocation of `size` bytes on `device` (context current).
    pub(super) fn create(device: i32, size: usize, prop: &sys::CUmemAllocationProp) -> Result<Vmm> {
        let mut v = Vmm { device, handle: 0, va: 0, size, progress: VmmProgress::default() };
        // SAFETY: out-pointer ours; prop is a valid property struct.
        check(unsafe { sys::cuMemCreate(&mut v.handle, size, prop, 0) }, || format!("cuMemCreate of {size} bytes on device {device}"))?;
        v.progress.handle = true;
        Ok(v)
    }

    /// A peer's allocation from the descriptor it sent (context current).
    pub(super) fn import(device: i32, size: usize, fd: &OwnedFd, rank: usize) -> Result<Vmm> {
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
    pub(super) fn map(&mut self, alignment: usize, what: &str) -> Result<()> {
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

// SAFETY: the fields are plain numbers (driver handles and addresses).
unsafe impl Send for Vmm {}
// SAFETY: as above; a Vmm is never changed after construction.
unsafe impl Sync for Vmm {}
