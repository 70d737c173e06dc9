//! The CUDA driver, loaded at run time through cudarc's dynamic loading.
//!
//! Nothing CUDA is needed to build or link the library. The first CUDA call
//! loads `libcuda.so.1`, checks that every entry point we use is there,
//! that the driver is new enough and that a device is visible; the outcome
//! (success or the reason for `CudaUnavailable`) is kept for the process.

use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use cudarc::driver::sys::{self, CUcontext, CUresult};
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString};

/// Oldest driver API we accept (cudarc's bindings are those of CUDA 12.0).
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// Library names tried, in order (the versioned name is what drivers install).
const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Every driver entry point this crate calls; all are checked at load so a
/// missing one becomes `CudaUnavailable` instead of a panic in cudarc.
const REQUIRED_SYMBOLS: [&str; 23] = [
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
];

/// A loaded, initialised driver.
#[derive(Debug)]
pub struct Driver {
    /// Path or name of the library that was loaded.
    pub library: String,
    /// `cuDriverGetVersion`: 1000 × major + 10 × minor.
    pub version: i32,
    /// Devices visible to this process.
    pub device_count: i32,
    /// The process that loaded and initialised the driver. A child made by
    /// fork() inherits this struct but not the driver's state (its threads,
    /// its channels to the kernel module): CUDA is undefined there.
    pub loaded_by: u32,
    /// The `dlopen` handle of that library (never closed).
    handle: usize,
    /// Primary contexts retained so far, by device ordinal (kept for the
    /// life of the process, as the CUDA runtime does).
    contexts: ForkSafeMutex<HashMap<i32, usize>>,
}

static DRIVER: OnceCell<std::result::Result<Driver, Error>> = OnceCell::new();

/// The driver, loaded on first use; `CudaUnavailable` with the reason when
/// there is no driver library, no device, or the driver is too old.
pub fn driver() -> Result<&'static Driver> {
    let driver = DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)?;
    driver.contexts.register();
    Ok(driver)
}

/// Ok when CUDA can be used; else the `CudaUnavailable` error saying why.
pub fn check_available() -> Result<()> {
    driver().map(|_| ())
}

fn unavailable(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::CudaUnavailable, format!("CUDA is not available: {}", why.into()))
}

fn load() -> std::result::Result<Driver, Error> {
    let (handle, library) = open_library()?;
    for name in REQUIRED_SYMBOLS {
        let c = CString::new(name).expect("symbol names have no NUL");
        // SAFETY: `handle` is a live dlopen handle (never closed).
        if unsafe { libc::dlsym(handle, c.as_ptr()) }.is_null() {
            return Err(unavailable(format!(
                "the driver library {library} lacks {name}: the NVIDIA driver is too old (this library needs one for CUDA 12.0 or newer)"
            )));
        }
    }
    let mut version = 0;
    // SAFETY: all symbols were found above; the out-pointer is ours.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(unavailable(format!("cuDriverGetVersion failed: {}", describe(r))));
    }
    if version < MIN_DRIVER_VERSION {
        return Err(unavailable(format!(
            "the NVIDIA driver is too old: it supports CUDA {}.{}, this library needs {}.{} or newer",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10
        )));
    }
    // SAFETY: plain driver call.
    let r = unsafe { sys::cuInit(0) };
    match r {
        CUresult::CUDA_SUCCESS => {}
        CUresult::CUDA_ERROR_NO_DEVICE => return Err(no_device()),
        CUresult::CUDA_ERROR_STUB_LIBRARY => {
            return Err(unavailable(format!("{library} is the CUDA toolkit's stub library, not a real driver")))
        }
        CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH | CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => {
            return Err(unavailable(format!("the driver does not match the kernel module or device: {}", describe(r))))
        }
        _ => return Err(unavailable(format!("cuInit failed: {}", describe(r)))),
    }
    let mut device_count = 0;
    // SAFETY: plain driver call with our out-pointer.
    let r = unsafe { sys::cuDeviceGetCount(&mut device_count) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(unavailable(format!("cuDeviceGetCount failed: {}", describe(r))));
    }
    if device_count == 0 {
        return Err(no_device());
    }
    Ok(Driver {
        library,
        version,
        device_count,
        loaded_by: std::process::id(),
        handle: handle as usize,
        contexts: ForkSafeMutex::new(HashMap::new()),
    })
}

fn no_device() -> Error {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})")).unwrap_or_default();
    unavailable(format!("the driver is installed but no CUDA device is visible{visible}"))
}

/// dlopens the driver library, keeping it loaded for the process; cudarc
/// then finds the same library already in memory.
fn open_library() -> std::result::Result<(*mut libc::c_void, String), Error> {
    let mut reasons = Vec::new();
    for name in LIBRARY_NAMES {
        let c = CString::new(name).expect("library names have no NUL");
        // SAFETY: dlopen with a valid C string; the handle is never closed.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            return Ok((handle, name.to_string()));
        }
        // SAFETY: dlerror returns NULL or a NUL-terminated message.
        let err = unsafe { libc::dlerror() };
        let text = if err.is_null() { "unknown error".to_string() } else { unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned() };
        reasons.push(text);
    }
    Err(unavailable(format!("the driver library could not be loaded (is the NVIDIA driver installed?): {}", reasons.join("; "))))
}

/// "CUDA_ERROR_X (text)" for a driver result.
pub fn describe(r: CUresult) -> String {
    let mut name: *const libc::c_char = std::ptr::null();
    let mut text: *const libc::c_char = std::ptr::null();
    // SAFETY: the driver writes pointers to static strings (or leaves NULL).
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
    }
    let show = |p: *const libc::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: static NUL-terminated string from the driver.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (show(name), show(text)) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("CUDA error {}", r as i32),
    }
}

/// Turns a driver result into `Ok` or an error saying `what` failed.
pub fn check(r: CUresult, what: impl FnOnce() -> String) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let kind = match r {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => ErrorKind::NoSpace,
        CUresult::CUDA_ERROR_INVALID_VALUE => ErrorKind::InvalidArgument,
        _ => ErrorKind::CudaError,
    };
    Err(Error::new(kind, format!("{}: {}", what(), describe(r))))
}

impl Driver {
    /// Runs `f` with device `device`'s primary context current on this
    /// thread, restoring the caller's context afterwards.
    pub fn with_device<T>(&self, device: i32, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let ctx = self.primary_context(device)?;
        // SAFETY: ctx is a retained primary context.
        check(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, || format!("cuCtxPushCurrent for device {device}"))?;
        let out = f();
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: pops exactly the context pushed above.
        let pop = check(unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }, || format!("cuCtxPopCurrent for device {device}"));
        let value = out?;
        pop.map(|_| value)
    }

    fn primary_context(&self, device: i32) -> Result<CUcontext> {
        if device < 0 || device >= self.device_count {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("CUDA device {device} does not exist: {} device(s) visible", self.device_count),
            ));
        }
        let mut contexts = self.contexts.lock();
        if let Some(ctx) = contexts.get(&device) {
            return Ok(*ctx as CUcontext);
        }
        let mut dev = 0;
        // SAFETY: ordinal checked above; out-pointers are ours.
        check(unsafe { sys::cuDeviceGet(&mut dev, device) }, || format!("cuDeviceGet({device})"))?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: as above; the retained context is never released.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, || format!("cuDevicePrimaryCtxRetain({device})"))?;
        contexts.insert(device, ctx as usize);
        Ok(ctx)
    }
}

/// The driver entry points the CUDA symmetric-memory backend calls beyond
/// `REQUIRED_SYMBOLS`: virtual memory management (CUDA 10.2+), modules
/// and launches, host-mapped memory. Checked on the first symmetric-memory
/// use, so a driver without them fails that use with `CudaUnavailable`
/// (cudarc would panic on a missing one) and CUDA IPC is unaffected.
pub const SYMM_SYMBOLS: [&str; 22] = [
    "cuMemCreate",
    "cuMemRelease",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuModuleLoadDataEx",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuFuncGetAttribute",
    "cuLaunchKernel",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuDeviceGetAttribute",
    "cuCtxSynchronize",
    "cuMemsetD8_v2",
    "cuMemcpyHtoD_v2",
];

/// Multicast entry points (CUDA 12.1+): optional. Without them multicast
/// is reported as unsupported, with the missing name as the reason.
pub const MULTICAST_SYMBOLS: [&str; 5] =
    ["cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem", "cuMulticastUnbind", "cuMulticastGetGranularity"];

/// What the loaded driver offers symmetric memory.
#[derive(Debug, Clone)]
pub struct SymmFeatures {
    /// `None` when every multicast entry point is there, else the reason.
    pub multicast_missing: Option<String>,
}

static SYMM_FEATURES: OnceCell<std::result::Result<SymmFeatures, Error>> = OnceCell::new();

/// The first of `names` that `lib`'s handle lacks, if any.
fn first_missing(handle: usize, names: &[&'static str]) -> Option<&'static str> {
    names.iter().copied().find(|name| {
        let c = CString::new(*name).expect("symbol names have no NUL");
        // SAFETY: `handle` is a live dlopen handle (never closed).
        unsafe { libc::dlsym(handle as *mut libc::c_void, c.as_ptr()) }.is_null()
    })
}

/// The driver, checked for the symmetric-memory entry points (once per
/// process): `CudaUnavailable` naming the first one missing.
pub fn symm_driver() -> Result<(&'static Driver, &'static SymmFeatures)> {
    let d = driver()?;
    if let Some(why) = forked_child(d.loaded_by, std::process::id()) {
        return Err(unavailable(why));
    }
    let features = SYMM_FEATURES
        .get_or_init(|| {
            if let Some(name) = first_missing(d.handle, &SYMM_SYMBOLS) {
                return Err(unavailable(format!(
                    "the driver library {} lacks {name}, which CUDA symmetric memory needs (virtual memory management)",
                    d.library
                )));
            }
            let multicast_missing = first_missing(d.handle, &MULTICAST_SYMBOLS)
                .map(|name| format!("the driver library {} lacks {name} (multicast needs CUDA 12.1 or newer)", d.library));
            Ok(SymmFeatures { multicast_missing })
        })
        .as_ref()
        .map_err(Clone::clone)?;
    Ok((d, features))
}

/// Why CUDA cannot be used in this process, when it is a child forked from
/// the process `loaded_by` that initialised the driver (`now` is this
/// process's id): the driver's state did not survive the fork, and any
/// driver call here is undefined (it may fail, or hang on a lock held by a
/// thread of the parent that the child does not have).
pub fn forked_child(loaded_by: u32, now: u32) -> Option<String> {
    (loaded_by != now).then(|| {
        format!(
            "this process ({now}) was forked from process {loaded_by} after that one initialised CUDA, and CUDA \
             cannot be used in a forked child; start the child with exec (e.g. multiprocessing's \"spawn\")"
        )
    })
}

impl Driver {
    /// Whether this process is a fork() child of the one that loaded the
    /// driver (where no driver call may be made).
    pub fn in_forked_child(&self) -> bool {
        forked_child(self.loaded_by, std::process::id()).is_some()
    }

    /// The address of driver entry point `name`, if the library has it.
    pub fn symbol(&self, name: &str) -> Option<*mut libc::c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: live dlopen handle (never closed).
        let p = unsafe { libc::dlsym(self.handle as *mut libc::c_void, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// `cuDeviceGetAttribute` by the attribute's number, so attributes newer
    /// than cudarc's CUDA 12.0 bindings (multicast: 132) can be asked too; a
    /// driver that does not know the attribute gives an error, not a panic.
    /// Only after [`symm_driver`] succeeded (the symbol is checked there).
    pub fn device_attribute(&self, device: i32, attribute: i32) -> Result<i32> {
        type GetAttr = unsafe extern "C" fn(*mut libc::c_int, libc::c_int, sys::CUdevice) -> CUresult;
        let c = CString::new("cuDeviceGetAttribute").expect("no NUL");
        // SAFETY: live handle; the symbol was checked by symm_driver.
        let f = unsafe { libc::dlsym(self.handle as *mut libc::c_void, c.as_ptr()) };
        if f.is_null() {
            return Err(unavailable(format!("the driver library {} lacks cuDeviceGetAttribute", self.library)));
        }
        // SAFETY: the symbol has this C signature in every CUDA driver.
        let f: GetAttr = unsafe { std::mem::transmute::<*mut libc::c_void, GetAttr>(f) };
        let mut dev = 0;
        // SAFETY: out-pointers are ours; an out-of-range ordinal is an error.
        check(unsafe { sys::cuDeviceGet(&mut dev, device) }, || format!("cuDeviceGet({device})"))?;
        let mut value = 0;
        // SAFETY: as above.
        check(unsafe { f(&mut value, attribute, dev) }, || format!("cuDeviceGetAttribute({attribute}) of device {device}"))?;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_is_told_why_cuda_is_off_there() {
        assert_eq!(forked_child(42, 42), None);
        let why = forked_child(42, 43).unwrap();
        assert!(why.contains("this process (43) was forked from process 42"), "{why}");
        assert!(why.contains("exec"), "{why}");
        // The real process: a driver loaded here is not a forked child's.
        assert_eq!(forked_child(std::process::id(), std::process::id()), None);
    }
}
