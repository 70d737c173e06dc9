//! One mapped allocation of CUDA virtual-memory-managed (VMM) device memory,
//! ours or another process's, and how far its making got, so a failure
//! half-way undoes exactly that. Used by the symmetric-memory CUDA backend
//! (one block per rank) and by the GPU weights pool (its Vmm-kind
//! segments): memory made with `cuMemCreate`, shareable as a POSIX file
//! descriptor, reserved and mapped with `cuMemAddressReserve`, `cuMemMap`
//! and `cuMemSetAccess`.

use super::driver::{check, driver};
use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccess_flags_enum, CUmemAllocationGranularity_flags_enum, CUmemAllocationHandleType_enum,
    CUmemAllocationType_enum, CUmemGenericAllocationHandle, CUmemLocationType_enum,
};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// How far the driver objects of one mapping were made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmmProgress {
    /// `cuMemCreate` / `cuMemImportFromShareableHandle` gave a handle.
    pub handle: bool,
    /// `cuMemAddressReserve` gave an address range.
    pub reserved: bool,
    /// `cuMemMap` mapped the handle there.
    pub mapped: bool,
}

/// One step of undoing a mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Undo {
    Unmap,
    AddressFree,
    Release,
}

/// The steps that undo `p`, in order: unmap before freeing the range,
/// release the handle last. When the process is finalizing nothing is
/// undone (the driver tears it all down at exit, and teardown code may
/// still read the memory). The steps never involve a peer, so a peer
/// killed meanwhile cannot make them fail: the physical memory of an
/// imported allocation stays alive while this process holds its handle.
pub fn undo_steps(p: VmmProgress, finalizing: bool) -> Vec<Undo> {
    if finalizing {
        return Vec::new();
    }
    let mut steps = Vec::new();
    if p.mapped {
        steps.push(Undo::Unmap);
    }
    if p.reserved {
        steps.push(Undo::AddressFree);
    }
    if p.handle {
        steps.push(Undo::Release);
    }
    steps
}

static FINALIZING: AtomicBool = AtomicBool::new(false);

/// From now on nothing VMM is undone (the process is exiting; set by the
/// symmetric-memory registry's exit hook).
pub fn begin_finalizing() {
    FINALIZING.store(true, Ordering::Release);
}

/// Runs `f` with `device`'s context current, for teardown: errors are
/// dropped (nothing can be done about them in a destructor), and nothing
/// runs while the process is finalizing, nor in a child forked after the
/// driver was initialised (no driver call is defined there; the child's
/// copy of the address space holds none of the driver's mappings anyway).
pub fn teardown(device: i32, f: impl FnOnce()) {
    if FINALIZING.load(Ordering::Acquire) {
        return;
    }
    if let Ok(d) = driver() {
        if d.in_forked_child() {
            return;
        }
        let _ = d.with_device(device, || {
            f();
            Ok(())
        });
    }
}

/// The properties of a pinned device allocation on `device`, shareable as
/// a POSIX file descriptor.
pub fn alloc_prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is valid (enum fields 0 = INVALID)
    // and every field that matters is set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = CUmemAllocationType_enum::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type_ = CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    p
}

/// The recommended granularity of `prop`'s allocations (context current).
pub fn granularity(device: i32, prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: out-pointer ours; prop is a valid property struct.
    check(
        unsafe {
            sys::cuMemGetAllocationGranularity(&mut g, prop, CUmemAllocationGranularity_flags_enum::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        },
        || format!("cuMemGetAllocationGranularity on device {device}"),
    )?;
    if g == 0 || !g.is_power_of_two() {
        return Err(Error::new(ErrorKind::CudaError, format!("cuMemGetAllocationGranularity gave {g}, not a power of two")));
    }
    Ok(g)
}

/// One mapped allocation (ours or a peer's): the handle, its address range
/// and how far they were made, so a failure half-way undoes exactly that.
pub struct Vmm {
    pub device: i32,
    pub handle: CUmemGenericAllocationHandle,
    pub va: CUdeviceptr,
    pub size: usize,
    pub progress: VmmProgress,
}

impl Vmm {
    /// A new allocation of `size` bytes on `device` (context current).
    pub fn create(device: i32, size: usize, prop: &sys::CUmemAllocationProp) -> Result<Vmm> {
        let mut v = Vmm { device, handle: 0, va: 0, size, progress: VmmProgress::default() };
        // SAFETY: out-pointer ours; prop is a valid property struct.
        check(unsafe { sys::cuMemCreate(&mut v.handle, size, prop, 0) }, || format!("cuMemCreate of {size} bytes on device {device}"))?;
        v.progress.handle = true;
        Ok(v)
    }

    /// Another process's allocation of `size` bytes from the descriptor it
    /// sent (context current); `what` names it in errors.
    pub fn import(device: i32, size: usize, fd: &OwnedFd, what: &str) -> Result<Vmm> {
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
            || format!("cuMemImportFromShareableHandle of {what}"),
        )?;
        v.progress.handle = true;
        Ok(v)
    }

    /// A new descriptor for this allocation, to send to another process
    /// (context current).
    pub fn export_fd(&self, what: &str) -> Result<OwnedFd> {
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX descriptors the driver writes an int.
        check(
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut libc::c_int).cast(),
                    self.handle,
                    CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            || format!("cuMemExportToShareableHandle of {what}"),
        )?;
        if fd < 0 {
            return Err(Error::new(ErrorKind::CudaError, format!("cuMemExportToShareableHandle of {what} gave no descriptor")));
        }
        // SAFETY: the driver handed us this new descriptor.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Reserves an address range, maps the handle there and gives `device`
    /// read-write access.
    pub fn map(&mut self, alignment: usize, what: &str) -> Result<()> {
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
        let steps = undo_steps(self.progress, false);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undo_order_and_finalizing() {
        let full = VmmProgress { handle: true, reserved: true, mapped: true };
        assert_eq!(undo_steps(full, false), vec![Undo::Unmap, Undo::AddressFree, Undo::Release]);
        assert_eq!(undo_steps(full, true), vec![]);
        let no_map = VmmProgress { handle: true, reserved: true, mapped: false };
        assert_eq!(undo_steps(no_map, false), vec![Undo::AddressFree, Undo::Release]);
        let handle_only = VmmProgress { handle: true, ..Default::default() };
        assert_eq!(undo_steps(handle_only, false), vec![Undo::Release]);
        assert_eq!(undo_steps(VmmProgress::default(), false), vec![]);
    }
}
