//! The process's one [`CudaIpc`] over the CUDA driver, with a teardown at
//! exit, and device allocation that collects limbo before giving up.

use super::cuda_backend::CudaBackend;
use super::ipc::CudaIpc;
use crate::error::{ErrorKind, Result};
use once_cell::sync::Lazy;

/// The process that made the state: a child made by fork() inherits the
/// state but owns none of its counter files, so its exit must not remove them.
static OWNER_PID: Lazy<u32> = Lazy::new(std::process::id);

static GLOBAL: Lazy<CudaIpc<CudaBackend>> = Lazy::new(|| {
    extern "C" fn at_exit() {
        // Statics are never dropped: report held blocks and remove counter
        // file names here.
        if std::process::id() == *OWNER_PID {
            GLOBAL.teardown();
        }
    }
    Lazy::force(&OWNER_PID);
    // SAFETY: registers a plain function; failure only loses the teardown.
    unsafe { libc::atexit(at_exit) };
    CudaIpc::new(CudaBackend)
});

/// This process's CUDA IPC state.
pub fn global() -> &'static CudaIpc<CudaBackend> {
    &GLOBAL
}

/// Allocates device memory; when the device is out of memory, collects
/// limbo (blocks consumers released) and tries once more.
pub fn device_alloc(device: i32, nbytes: usize) -> Result<u64> {
    let ipc = global();
    match ipc.backend().alloc(device, nbytes) {
        Err(e) if e.kind() == ErrorKind::NoSpace && ipc.collect() > 0 => ipc.backend().alloc(device, nbytes),
        other => other,
    }
}

/// Frees memory from [`device_alloc`].
pub fn device_free(device: i32, ptr: u64) -> Result<()> {
    global().backend().free(device, ptr)
}
