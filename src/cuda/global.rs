//! The process's one [`CudaIpc`] over the CUDA driver, its end-of-process
//! teardown, and device allocation that collects limbo before giving up.

use super::cuda_backend::CudaBackend;
use super::ipc::{CudaIpc, TeardownReport};
use crate::error::{ErrorKind, Result};
use once_cell::sync::Lazy;
use std::sync::Once;

/// The process that made the state: a child made by fork() inherits the
/// state but owns none of its counter files, so it must not remove them.
static OWNER_PID: Lazy<u32> = Lazy::new(std::process::id);

static GLOBAL: Lazy<CudaIpc<CudaBackend>> = Lazy::new(|| {
    Lazy::force(&OWNER_PID);
    // Statics are never dropped: have `teardown` run at exit instead.
    register_teardown_at_exit();
    CudaIpc::new(CudaBackend)
});

/// The end-of-process teardown of the state (see [`CudaIpc::teardown`]),
/// skipped in a forked child and when the state was never used. Runs by
/// itself at exit once the state exists; calling it earlier is allowed.
pub fn teardown() -> Option<TeardownReport> {
    let ipc = Lazy::get(&GLOBAL)?;
    (std::process::id() == *OWNER_PID).then(|| ipc.teardown())
}

/// The atexit callback: runs [`teardown`]. A panic is caught here because
/// it must not unwind into the C runtime that calls this.
extern "C" fn teardown_at_exit() {
    let _ = std::panic::catch_unwind(teardown);
}

/// Registers [`teardown_at_exit`] with atexit, once per process.
fn register_teardown_at_exit() {
    static REGISTER: Once = Once::new();
    // SAFETY: atexit only stores the pointer to a function that takes and
    // returns nothing and never unwinds.
    REGISTER.call_once(|| unsafe {
        libc::atexit(teardown_at_exit);
    });
}

/// This process's CUDA IPC state.
pub fn global() -> &'static CudaIpc<CudaBackend> {
    let ipc: &'static CudaIpc<CudaBackend> = &GLOBAL;
    ipc.register_fork_locks();
    ipc
}

/// Allocates device memory; when the device is out of memory, collects
/// limbo (blocks consumers released) and, if that freed any, tries once more.
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
