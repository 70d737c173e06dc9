//! Driver helpers shared by the GPU tests and the CUDA benches (included
//! with `#[path]`, so binaries without a GPU part do not carry them).

use cudarc::driver::sys::{self, CUresult};

/// Panics naming `what` unless the driver call succeeded.
pub fn ok(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

/// Makes device 0's primary context current on this thread.
pub fn make_primary_current() {
    // SAFETY: the caller loaded the driver; out-pointers are ours.
    unsafe {
        let mut dev = 0;
        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        let mut ctx = std::ptr::null_mut();
        ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain");
        ok(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    }
}
