//! C API of the GPU weights pool (`crate::cuda::pool`, docs/cuda-weights.md):
//! a producer places tensors in a pool and exports it once; each consumer
//! process opens it once and reads versions it acquires.

use super::args::{free_handle, handle, handle_mut, null, out_arg, str_arg, write_out};
use super::status::ss_status;
use super::store::timeout_arg;
use crate::content_store::dtype::Dtype;
use crate::cuda::pool::{Pool, PoolDevice, PoolHandle, PoolKind, PoolOptions, TensorSpec, Weights};
use crate::error::{Error, ErrorKind, Result};
use std::ffi::{c_void, CString};
use std::os::raw::c_char;

/// `ss_cuda_pool_options.device_type` of a CUDA pool (the product).
pub const SS_POOL_DEVICE_CUDA: i32 = 0;
/// `ss_cuda_pool_options.device_type` of a host pool (host RAM: the test
/// backend, usable for CPU weights).
pub const SS_POOL_DEVICE_HOST: i32 = 1;
/// Segments exported as file descriptors (CUDA VMM; host: sealed memfds).
pub const SS_POOL_KIND_VMM: i32 = 0;
/// Segments with legacy IPC handles, openable by stock PyTorch (host: named shm).
pub const SS_POOL_KIND_LEGACY: i32 = 1;

/// A producer's pool. Thread safety: every function may be called from
/// several threads at once.
pub struct SsCudaPool {
    pool: Pool,
}

/// A pool opened in this (consumer) process. Thread safety: as for
/// `ss_cuda_pool`; threads share one hold, each acquire needs its release.
pub struct SsCudaWeights {
    weights: Weights,
    /// The tensors' names, NUL-terminated, lent by `ss_cuda_weights_tensor`.
    names: Vec<CString>,
}

/// How `ss_cuda_pool_new` makes a pool. Start from `SS_CUDA_POOL_OPTIONS_INIT`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ss_cuda_pool_options {
    /// `sizeof(ss_cuda_pool_options)` as the caller was built (0 is refused).
    pub struct_size: usize,
    /// `SS_POOL_DEVICE_CUDA` (default) or `SS_POOL_DEVICE_HOST`.
    pub device_type: i32,
    /// CUDA device ordinal (ignored for the host).
    pub device: i32,
    /// `SS_POOL_KIND_VMM` (default) or `SS_POOL_KIND_LEGACY`.
    pub kind: i32,
    /// Bytes of a new segment (default 256 MiB, rounded to the device's granularity).
    pub segment_size: usize,
    /// Most consumer processes connected at once (default 64, at most 4096).
    pub max_consumers: usize,
}

/// One tensor for `ss_cuda_pool_add_tensor`: a view of the storage at
/// `storage_ptr` (inside the pool) of `storage_nbytes` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ss_tensor_desc {
    /// `sizeof(ss_tensor_desc)` as the caller was built (0 is refused).
    pub struct_size: usize,
    pub storage_ptr: *const c_void,
    pub storage_nbytes: usize,
    /// c10::ScalarType number (6 = float32, 15 = bfloat16, ...).
    pub dtype: i32,
    pub ndim: usize,
    /// `ndim` sizes (may be NULL when ndim is 0).
    pub sizes: *const i64,
    /// `ndim` strides, in elements.
    pub strides: *const i64,
    /// In elements.
    pub storage_offset: i64,
}

/// One tensor of an opened pool, lent by the weights object (valid until
/// `ss_cuda_weights_free`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ss_cuda_weights_tensor_info {
    pub name: *const c_char,
    /// The start of its storage in this process (NULL for an empty storage).
    pub data_ptr: *mut c_void,
    pub storage_nbytes: usize,
    pub dtype: i32,
    pub ndim: usize,
    pub sizes: *const i64,
    pub strides: *const i64,
    pub storage_offset: i64,
    /// Tensors with the same index are views of one storage.
    pub storage_index: usize,
}

fn options_from_c(o: &ss_cuda_pool_options) -> Result<PoolOptions> {
    let size = std::mem::size_of::<ss_cuda_pool_options>();
    super::struct_size::check("ss_cuda_pool_options", o.struct_size, size, size)?;
    let kind = match o.kind {
        SS_POOL_KIND_VMM => PoolKind::Vmm,
        SS_POOL_KIND_LEGACY => PoolKind::Legacy,
        k => {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("ss_cuda_pool_options.kind is {k}: SS_POOL_KIND_VMM or SS_POOL_KIND_LEGACY"),
            ))
        }
    };
    let device = PoolDevice::from_code(o.device_type, o.device)?;
    Ok(PoolOptions { device, kind, segment_size: o.segment_size, max_consumers: o.max_consumers })
}

/// `n` values at `p` (NULL allowed when n is 0).
///
/// # Safety
/// `p` is NULL or readable for `n` values.
unsafe fn int_array(p: *const i64, n: usize, what: &str) -> Result<Vec<i64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(null(what));
    }
    if n > crate::cuda::pool::manifest::MAX_NDIM {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("ndim {n} is above {}", crate::cuda::pool::manifest::MAX_NDIM)));
    }
    // SAFETY: per the contract above.
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

/// A new pool with `options` (NULL: CUDA device 0, VMM, 256 MiB segments,
/// 64 consumers); no memory is taken until the first allocation. Without
/// a CUDA driver or device, a CUDA pool is `SS_ERR_CUDA_UNAVAILABLE` with
/// the reason. Release with `ss_cuda_pool_free`.
///
/// # Safety
/// `options` is NULL or readable; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_new(options: *const ss_cuda_pool_options, out: *mut *mut SsCudaPool) -> ss_status {
    ffi_status!("ss_cuda_pool_new", {
        out_arg(out, "out")?;
        // SAFETY: NULL or readable options.
        let opts = match unsafe { options.as_ref() } {
            Some(o) => options_from_c(o)?,
            None => PoolOptions::default(),
        };
        let pool = Pool::new(opts)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsCudaPool { pool }))) };
        Ok(())
    })
}

/// A block of at least `nbytes` bytes in the pool, 512-aligned, in
/// `*out_ptr` (device memory for a CUDA pool). The pool grows by a segment
/// when none has room, until it is exported (then `SS_ERR_NO_SPACE`).
///
/// # Safety
/// `pool` is NULL or a live pool; `out_ptr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_alloc(pool: *mut SsCudaPool, nbytes: usize, out_ptr: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_cuda_pool_alloc", {
        out_arg(out_ptr, "out_ptr")?;
        // SAFETY: NULL or a live pool.
        let p = unsafe { handle(pool, "pool") }?;
        let addr = p.pool.alloc(nbytes)?;
        // SAFETY: checked above.
        unsafe { write_out(out_ptr, addr as *mut c_void) };
        Ok(())
    })
}

/// Frees a block from `ss_cuda_pool_alloc` (anything else is `SS_ERR_INVALID_ARGUMENT`).
///
/// # Safety
/// `pool` is NULL or a live pool.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_dealloc(pool: *mut SsCudaPool, ptr: *mut c_void) -> ss_status {
    ffi_status!("ss_cuda_pool_dealloc", {
        // SAFETY: NULL or a live pool.
        let p = unsafe { handle(pool, "pool") }?;
        p.pool.free_block(ptr as u64)
    })
}

/// Adds tensor `name` (unique, UTF-8) to the manifest: its storage must lie
/// in the pool and the view inside its storage. After export:
/// `SS_ERR_INVALID_ARGUMENT` ("the manifest is frozen after export").
///
/// # Safety
/// `pool` is NULL or a live pool; `name` NULL or NUL-terminated; `desc`
/// NULL or readable, its `sizes`/`strides` readable for `ndim` values.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_add_tensor(pool: *mut SsCudaPool, name: *const c_char, desc: *const ss_tensor_desc) -> ss_status {
    ffi_status!("ss_cuda_pool_add_tensor", {
        // SAFETY: NULL or a live pool.
        let p = unsafe { handle(pool, "pool") }?;
        // SAFETY: NULL or NUL-terminated.
        let name = unsafe { str_arg(name, "name") }?;
        // SAFETY: NULL or readable.
        let d = unsafe { handle(desc, "desc") }?;
        let size = std::mem::size_of::<ss_tensor_desc>();
        super::struct_size::check("ss_tensor_desc", d.struct_size, size, size)?;
        let spec = TensorSpec {
            storage_ptr: d.storage_ptr as u64,
            storage_nbytes: d.storage_nbytes,
            dtype: Dtype::from_code(d.dtype)?,
            // SAFETY: readable for ndim values (the caller's contract).
            sizes: unsafe { int_array(d.sizes, d.ndim, "desc.sizes") }?,
            // SAFETY: as above.
            strides: unsafe { int_array(d.strides, d.ndim, "desc.strides") }?,
            storage_offset: d.storage_offset,
        };
        p.pool.add_tensor(name, &spec)
    })
}

/// Exports the pool (the first call freezes the manifest, starts the
/// server and publishes version 1) and writes its handle, a few dozen
/// bytes to give consumers by any channel, into `buf`; `*out_len` is its
/// length. A `cap` too small is `SS_ERR_BUFFER_TOO_SMALL` with `*out_len`
/// set to the length needed.
///
/// # Safety
/// `pool` is NULL or a live pool; `buf` NULL or writable for `cap` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_export(pool: *mut SsCudaPool, buf: *mut u8, cap: usize, out_len: *mut usize) -> ss_status {
    ffi_status!("ss_cuda_pool_export", {
        out_arg(out_len, "out_len")?;
        // SAFETY: NULL or a live pool.
        let p = unsafe { handle(pool, "pool") }?;
        let bytes = p.pool.export()?.to_bytes();
        // SAFETY: checked above.
        unsafe { write_out(out_len, bytes.len()) };
        if bytes.len() > cap {
            return Err(Error::new(ErrorKind::BufferTooSmall, format!("the pool handle needs {} bytes, buf has {cap}", bytes.len())));
        }
        if buf.is_null() {
            return Err(null("buf"));
        }
        // SAFETY: buf is writable for cap >= len bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
        Ok(())
    })
}

/// Opens an update: consumers are kept from acquiring, and this waits
/// until none holds a version (`timeout_ms`: 0 forever; on timeout
/// `SS_ERR_TIMEOUT` naming the holders' pids, and readers go on). Write the
/// new weights, then `ss_cuda_pool_publish`. A second open is `SS_ERR_BUSY`.
///
/// # Safety
/// `pool` is NULL or a live pool.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_begin_update(pool: *mut SsCudaPool, timeout_ms: i64) -> ss_status {
    ffi_status!("ss_cuda_pool_begin_update", {
        // SAFETY: NULL or a live pool.
        let p = unsafe { handle(pool, "pool") }?;
        p.pool.start_update(timeout_arg(timeout_ms)?)
    })
}

/// Publishes the open update: records an event on `stream` (a `CUstream`;
/// 0 the default stream; ignored by the host) for consumers to wait on,
/// bumps the version (in `*out_version`) and lets readers in.
///
/// # Safety
/// `pool` is NULL or a live pool; `out_version` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_publish(pool: *mut SsCudaPool, stream: usize, out_version: *mut u64) -> ss_status {
    ffi_status!("ss_cuda_pool_publish", {
        out_arg(out_version, "out_version")?;
        // SAFETY: NULL or a live pool.
        let p = unsafe { handle(pool, "pool") }?;
        let v = p.pool.publish_update(stream as u64)?;
        // SAFETY: checked above.
        unsafe { write_out(out_version, v) };
        Ok(())
    })
}

/// Releases the pool: its server stops (consumers get `SS_ERR_PEER_GONE`
/// at their next acquire) and its memory goes once no consumer maps it
/// (VMM and host memory are refcounted by the driver and kernel). An
/// update left open is abandoned. NULL is a no-op.
///
/// # Safety
/// `pool` is NULL or a live pool, not used after this call.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_free(pool: *mut SsCudaPool) {
    ffi_value!("ss_cuda_pool_free", (), {
        // SAFETY: NULL or a pool from ss_cuda_pool_new, not used after.
        unsafe { free_handle(pool) }
    })
}

/// Opens the pool named by handle bytes from `ss_cuda_pool_export` (in
/// another process): one connection, one exchange, whatever the number of
/// tensors. Errors: `SS_ERR_PEER_GONE` (no producer), `SS_ERR_PERMISSION`
/// (someone else answers there), `SS_ERR_TOO_MANY_FILES`, `SS_ERR_PROTOCOL`
/// (malformed manifest), `SS_ERR_INVALID_ARGUMENT` (malformed handle),
/// `SS_ERR_TIMEOUT`. Nothing is mapped on error.
///
/// # Safety
/// `handle_bytes` is NULL or readable for `len` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_open(
    handle_bytes: *const u8,
    len: usize,
    timeout_ms: i64,
    out: *mut *mut SsCudaWeights,
) -> ss_status {
    ffi_status!("ss_cuda_weights_open", {
        out_arg(out, "out")?;
        if handle_bytes.is_null() {
            return Err(null("handle"));
        }
        // SAFETY: readable for len bytes (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(handle_bytes, len) };
        let h = PoolHandle::from_bytes(bytes)?;
        let weights = Weights::open(&h, timeout_arg(timeout_ms)?)?;
        let names = weights.tensors().iter().map(|t| CString::new(t.name.as_str()).expect("names have no NUL (validated)")).collect();
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsCudaWeights { weights, names }))) };
        Ok(())
    })
}

/// The number of tensors.
///
/// # Safety
/// `w` is NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_count(w: *const SsCudaWeights, out: *mut usize) -> ss_status {
    ffi_status!("ss_cuda_weights_count", {
        out_arg(out, "out")?;
        // SAFETY: NULL or live.
        let w = unsafe { handle(w, "weights") }?;
        // SAFETY: checked above.
        unsafe { write_out(out, w.weights.tensors().len()) };
        Ok(())
    })
}

/// Tensor `index` (0 to count - 1): its name, storage address here, sizes
/// and strides, lent until `ss_cuda_weights_free`.
///
/// # Safety
/// `w` is NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_tensor(w: *const SsCudaWeights, index: usize, out: *mut ss_cuda_weights_tensor_info) -> ss_status {
    ffi_status!("ss_cuda_weights_tensor", {
        out_arg(out, "out")?;
        // SAFETY: NULL or live.
        let w = unsafe { handle(w, "weights") }?;
        let tensors = w.weights.tensors();
        let t = tensors.get(index).ok_or_else(|| {
            Error::new(ErrorKind::InvalidArgument, format!("tensor index {index} is out of range: the pool has {} tensors", tensors.len()))
        })?;
        let info = ss_cuda_weights_tensor_info {
            name: w.names[index].as_ptr(),
            data_ptr: t.storage_ptr as *mut c_void,
            storage_nbytes: t.storage_nbytes,
            dtype: t.dtype.code(),
            ndim: t.sizes.len(),
            sizes: t.sizes.as_ptr(),
            strides: t.strides.as_ptr(),
            storage_offset: t.storage_offset,
            storage_index: t.storage_index,
        };
        // SAFETY: checked above.
        unsafe { write_out(out, info) };
        Ok(())
    })
}

/// The index of tensor `name` (`SS_ERR_NOT_FOUND` when there is none).
///
/// # Safety
/// `w` is NULL or live; `name` NULL or NUL-terminated; `out_index` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_find(w: *const SsCudaWeights, name: *const c_char, out_index: *mut usize) -> ss_status {
    ffi_status!("ss_cuda_weights_find", {
        out_arg(out_index, "out_index")?;
        // SAFETY: NULL or live.
        let w = unsafe { handle(w, "weights") }?;
        // SAFETY: NULL or NUL-terminated.
        let name = unsafe { str_arg(name, "name") }?;
        let i = w
            .weights
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("the pool has no tensor named {name:?}")))?;
        // SAFETY: checked above.
        unsafe { write_out(out_index, i) };
        Ok(())
    })
}

/// Holds the current version for reading (in `*out_version`): waits while
/// an update is written (`timeout_ms`: 0 forever), and makes `stream` wait
/// for the publish event. Threads of a process share its hold: a call
/// while the process holds a version joins that hold (a thread with a read
/// open at once; another after at most 10 ms while an update waits), so
/// nested and cross-thread reads never wait behind the producer. `SS_ERR_PEER_GONE` once the producer is gone;
/// `SS_ERR_BUSY` while the pool is torn (an update abandoned).
///
/// # Safety
/// `w` is NULL or live; `out_version` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_acquire(
    w: *mut SsCudaWeights,
    stream: usize,
    timeout_ms: i64,
    out_version: *mut u64,
) -> ss_status {
    ffi_status!("ss_cuda_weights_acquire", {
        out_arg(out_version, "out_version")?;
        // SAFETY: NULL or live.
        let w = unsafe { handle(w, "weights") }?;
        let v = w.weights.acquire(stream as u64, timeout_arg(timeout_ms)?)?;
        // SAFETY: checked above.
        unsafe { write_out(out_version, v) };
        Ok(())
    })
}

/// Whether the producer waits to write, or writes, an update now
/// (`*out`): new reads wait for its publish, except those joining a read
/// this process has open, which enter at once.
///
/// # Safety
/// `w` is NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_is_update_pending(w: *const SsCudaWeights, out: *mut bool) -> ss_status {
    ffi_status!("ss_cuda_weights_is_update_pending", {
        out_arg(out, "out")?;
        // SAFETY: NULL or live.
        let w = unsafe { handle(w, "weights") }?;
        // SAFETY: checked above.
        unsafe { write_out(out, w.weights.update_pending()) };
        Ok(())
    })
}

/// Ends a read: synchronizes `stream` (kernels reading the weights finish)
/// and lets go of the hold once this process's last reader releases.
///
/// # Safety
/// `w` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_release(w: *mut SsCudaWeights, stream: usize) -> ss_status {
    ffi_status!("ss_cuda_weights_release", {
        // SAFETY: NULL or live.
        let w = unsafe { handle_mut(w, "weights") }?;
        w.weights.release(stream as u64)
    })
}

/// Unmaps the weights and closes the connection (the producer frees this
/// consumer's slot). Tensor pointers must not be used after. NULL is a no-op.
///
/// # Safety
/// `w` is NULL or live, not used after this call.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_weights_free(w: *mut SsCudaWeights) {
    ffi_value!("ss_cuda_weights_free", (), {
        // SAFETY: NULL or from ss_cuda_weights_open, not used after.
        unsafe { free_handle(w) }
    })
}
