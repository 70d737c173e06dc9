//! The two C functions of PyTorch's `CUDAPluggableAllocator` under
//! `storage_sharing.cuda.Pool.allocating()`: PyTorch's caching allocator
//! asks them for whole segments, which are placed in the process's current
//! pool, so the tensors it carves from them are born in the pool.
//!
//! A block PyTorch holds keeps its pool alive: the user may drop the
//! `Pool` and keep the model, whose parameters are such blocks; the pool
//! (its memory, and its server for consumers) goes after PyTorch frees the
//! last of them. Nothing may unwind into PyTorch: a failure is NULL (an
//! out-of-memory error there), its reason kept for `take_alloc_error`.

use pyo3::prelude::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use storage_sharing::cuda::pool::{self, Pool};
use storage_sharing::log::{log, Level};
use storage_sharing::{Error, ErrorKind};

/// Why the last `ss_pool_torch_malloc` of this process failed (PyTorch
/// only sees NULL and reports out of memory).
static LAST_ALLOC_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Blocks PyTorch holds, by address, with the pool that made each.
static BORN: Mutex<Option<HashMap<u64, Arc<Pool>>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The message of the last failed `ss_pool_torch_malloc`, taken (None
/// when none failed since the last call).
#[pyfunction]
pub fn take_alloc_error() -> Option<String> {
    lock(&LAST_ALLOC_ERROR).take()
}

fn alloc(size: isize, device: i32, stream: u64) -> Result<u64, Error> {
    let nbytes = usize::try_from(size).map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("negative allocation size {size}")))?;
    let owner = pool::current::current();
    let ptr = pool::alloc_in_current(nbytes, device, stream)?;
    // alloc_in_current placed it in the pool that was current then: the
    // one read just before, unless another thread switched pools between.
    let made_by = owner.filter(|p| p.segments().iter().any(|&(base, n)| base <= ptr && ptr < base + n as u64));
    match made_by {
        Some(p) => {
            lock(&BORN).get_or_insert_with(HashMap::new).insert(ptr, p);
            Ok(ptr)
        }
        None => {
            let _ = pool::free_anywhere(ptr);
            Err(Error::new(ErrorKind::Busy, "the current pool changed during an allocation (one allocating() context at a time)"))
        }
    }
}

/// PyTorch's `alloc_fn`: `size` bytes in the current pool, or NULL.
#[no_mangle]
pub extern "C" fn ss_pool_torch_malloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
    let stream = stream as u64;
    match std::panic::catch_unwind(move || alloc(size, device, stream)) {
        Ok(Ok(ptr)) => ptr as *mut c_void,
        Ok(Err(e)) => {
            *lock(&LAST_ALLOC_ERROR) = Some(e.message().to_string());
            std::ptr::null_mut()
        }
        Err(_) => {
            *lock(&LAST_ALLOC_ERROR) = Some("ss_pool_torch_malloc panicked".to_string());
            std::ptr::null_mut()
        }
    }
}

/// PyTorch's `free_fn`: gives `ptr` back to its pool, then lets go of the
/// pool (which goes with its last block once the `Pool` is dropped).
#[no_mangle]
pub extern "C" fn ss_pool_torch_free(ptr: *mut c_void, _size: usize, _device: i32, _stream: *mut c_void) {
    let ptr = ptr as u64;
    let result = std::panic::catch_unwind(move || {
        let freed = pool::free_anywhere(ptr);
        let owner = lock(&BORN).as_mut().and_then(|m| m.remove(&ptr));
        drop(owner);
        freed
    });
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => log(Level::Warning, &format!("ss_pool_torch_free(0x{ptr:x}): {}", e.message())),
        Err(_) => log(Level::Warning, &format!("ss_pool_torch_free(0x{ptr:x}) panicked")),
    }
}
