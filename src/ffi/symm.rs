//! C API of symmetric memory: groups, the allocator registry, allocation,
//! rendezvous and the `ss_symm_mem` object.

use super::args::{handle, null, out_arg, str_arg, write_out};
use super::status::ss_status;
use super::store::{store_ref, timeout_arg, SsStore};
use crate::error::Result;
use crate::symm::{self, group, registry, DeviceType, SymmetricMemory};
use std::ffi::c_void;
use std::os::raw::{c_char, c_int};

/// Device type of a CPU block (the library's own multi-process backend).
pub const SS_DEVICE_CPU: c_int = 0;
/// Device type of a CUDA block (driver VMM memory; without a driver or
/// device, allocations fail with `SS_ERR_CUDA_UNAVAILABLE` and the reason).
pub const SS_DEVICE_CUDA: c_int = 1;

/// A rendezvoused symmetric block: every rank's buffer and signal pad, and
/// the synchronisation calls. Owned by its allocation: valid until
/// `ss_symm_free` of the block; never freed by the caller.
///
/// Thread safety: a `const ss_symm_mem*` may be used from several threads,
/// but each (peer, channel) pair of put/wait/barrier must be used by one
/// thread at a time, as the signal slots have one writer per side.
pub struct SsSymmMem {
    _opaque: [u8; 0],
}

/// The object behind a handle.
///
/// # Safety
/// `h` is NULL or a handle from `ss_symm_mem_rendezvous` whose block is live.
unsafe fn symm_mem<'a>(h: *const SsSymmMem) -> Result<&'a SymmetricMemory> {
    // SAFETY: per the contract above; handles are SymmetricMemory addresses.
    unsafe { handle(h.cast::<SymmetricMemory>(), "symm_mem") }
}

/// An optional group name (NULL: none).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn opt_group<'a>(p: *const c_char) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: per the contract above.
    unsafe { str_arg(p, "group") }.map(Some)
}

/// Registers group `group`: this process is `rank` of `world_size`, and the
/// ranks meet through `store`. The group keeps its own reference to the
/// store (free yours whenever you like). A second call for the same name is
/// `SS_ERR_ALREADY_EXISTS`, as in PyTorch. `world_size` is 1 to 4096 (every
/// rank of symmetric memory runs on one host; 4096 is far beyond the GPUs
/// or cores of any host), `rank` in [0, world_size); anything else is
/// `SS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `group` is NULL or a NUL-terminated string; `store` is NULL or a live
/// `ss_store` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_symm_set_group_info(group: *const c_char, rank: c_int, world_size: c_int, store: *const SsStore) -> ss_status {
    ffi_status!("ss_symm_set_group_info", {
        // SAFETY: NULL or a NUL-terminated string.
        let name = unsafe { str_arg(group, "group") }?;
        // SAFETY: NULL or a live store handle.
        let store = unsafe { store_ref(store) }?;
        group::set_group_info(name, rank.into(), world_size.into(), store)
    })
}

/// This process's rank and the world size of group `group`; an unknown
/// group is `SS_ERR_NOT_FOUND`.
///
/// # Safety
/// `group` is NULL or a NUL-terminated string; `out_rank` and
/// `out_world_size` are NULL or point to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_get_group_info(group: *const c_char, out_rank: *mut c_int, out_world_size: *mut c_int) -> ss_status {
    ffi_status!("ss_symm_get_group_info", {
        out_arg(out_rank, "out_rank")?;
        out_arg(out_world_size, "out_world_size")?;
        // SAFETY: NULL or a NUL-terminated string.
        let name = unsafe { str_arg(group, "group") }?;
        let info = group::get_group_info(name)?;
        // SAFETY: both checked above.
        unsafe {
            write_out(out_rank, info.rank as c_int);
            write_out(out_world_size, info.world_size as c_int);
        }
        Ok(())
    })
}

/// Chooses the allocation backend by name ("CPU" here; PyTorch's are
/// "CUDA", "NVSHMEM", "NCCL"). After the first allocation it fails with
/// "Backend can not be changed after use." (`SS_ERR_BUSY`); an unknown name
/// is `SS_ERR_NOT_FOUND`. Without it, CUDA allocations use the backend named
/// by `TORCH_SYMMMEM` (default CUDA).
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_set_backend(name: *const c_char) -> ss_status {
    ffi_status!("ss_symm_set_backend", {
        // SAFETY: NULL or a NUL-terminated string.
        let name = unsafe { str_arg(name, "name") }?;
        registry::set_backend(name)
    })
}

/// The signal pad size, in bytes, of the blocks allocated from now on
/// (PyTorch's `get_signal_pad_size`; default 9216 = 32 channels x 72 ranks
/// x 4 bytes).
///
/// # Safety
/// `out` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_get_signal_pad_size(out: *mut usize) -> ss_status {
    ffi_status!("ss_symm_get_signal_pad_size", {
        out_arg(out, "out")?;
        // SAFETY: checked above.
        unsafe { write_out(out, registry::signal_pad_size()) };
        Ok(())
    })
}

/// Sets the signal pad size of the blocks to come (PyTorch's newest
/// `set_signal_pad_size`): a positive multiple of 4 bytes, at most 1 GiB
/// (else `SS_ERR_INVALID_ARGUMENT`), before the process's first allocation
/// (after it: `SS_ERR_BUSY`). Every rank of a group must set the same size.
/// Barrier/put/wait take channels below `size / 4 / world_size`.
#[no_mangle]
pub extern "C" fn ss_symm_set_signal_pad_size(size: usize) -> ss_status {
    ffi_status!("ss_symm_set_signal_pad_size", { registry::set_signal_pad_size(size) })
}

/// Allocates a symmetric block whose buffer holds `size` bytes on device
/// `device_type` (`SS_DEVICE_CPU`, `SS_DEVICE_CUDA`) `device_idx`;
/// `group` (may be NULL) is the default group of its rendezvous.
/// CPU: `device_idx` is 0 or -1 (both mean the one CPU device, -1 as in
/// PyTorch's "no index"); any other value is `SS_ERR_INVALID_ARGUMENT`.
/// Writes the buffer's address to `*out`. Free it with `ss_symm_free`.
/// CUDA: `device_idx` is the device ordinal; the buffer is device memory
/// (`SS_ERR_CUDA_UNAVAILABLE` with the reason where there is no driver or
/// device).
///
/// # Safety
/// `group` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `void*`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_alloc(
    device_type: c_int,
    device_idx: i32,
    size: usize,
    group: *const c_char,
    out: *mut *mut c_void,
) -> ss_status {
    ffi_status!("ss_symm_alloc", {
        out_arg(out, "out")?;
        let dt = DeviceType::from_code(device_type)?;
        // SAFETY: NULL or a NUL-terminated string.
        let group = unsafe { opt_group(group) }?;
        let p = symm::alloc(dt, device_idx, size, group)?;
        // SAFETY: checked above.
        unsafe { write_out(out, p.cast()) };
        Ok(())
    })
}

/// Like `ss_symm_alloc`, for the persistent block `alloc_id`: the first
/// call makes it; once it was freed with `ss_symm_free`, a later call gives
/// the same block (and its rendezvous objects) back. While the previous use
/// is not freed: `SS_ERR_BUSY`; with another size: `SS_ERR_SIZE_MISMATCH`.
/// A persistent block stays mapped until the process ends.
///
/// # Safety
/// `group` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `void*`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_alloc_persistent(
    device_type: c_int,
    device_idx: i32,
    size: usize,
    group: *const c_char,
    alloc_id: u64,
    out: *mut *mut c_void,
) -> ss_status {
    ffi_status!("ss_symm_alloc_persistent", {
        out_arg(out, "out")?;
        let dt = DeviceType::from_code(device_type)?;
        // SAFETY: NULL or a NUL-terminated string.
        let group = unsafe { opt_group(group) }?;
        let p = symm::alloc_persistent(dt, device_idx, size, group, alloc_id)?;
        // SAFETY: checked above.
        unsafe { write_out(out, p.cast()) };
        Ok(())
    })
}

/// The size asked for when `ptr` (a buffer address from `ss_symm_alloc`)
/// was allocated.
///
/// # Safety
/// `ptr` may be any value (it is only looked up); `out` is NULL or points to
/// a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_get_alloc_size(ptr: *const c_void, out: *mut usize) -> ss_status {
    ffi_status!("ss_symm_get_alloc_size", {
        out_arg(out, "out")?;
        if ptr.is_null() {
            return Err(null("ptr"));
        }
        let n = symm::get_alloc_size(ptr as *mut u8)?;
        // SAFETY: checked above.
        unsafe { write_out(out, n) };
        Ok(())
    })
}

/// Frees the block at `ptr` and its `ss_symm_mem` objects (a persistent
/// block is kept for reuse). NULL is a no-op; an address that is not a live
/// block is `SS_ERR_NOT_FOUND`.
///
/// # Safety
/// `ptr` may be any value (it is only looked up). No thread may use the
/// block's buffer or its `ss_symm_mem` objects during the call or after it.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_free(ptr: *mut c_void) -> ss_status {
    ffi_status!("ss_symm_free", {
        if ptr.is_null() {
            return Ok(());
        }
        symm::free(ptr.cast())
    })
}

/// Rendezvous of the block at `ptr` with the other ranks of `group` (NULL:
/// the group given at allocation): every rank must call it with a block of
/// the same size and signal pad size (a different pad is
/// `SS_ERR_SIZE_MISMATCH` naming both pads and ranks). `timeout_ms` 0 waits
/// forever; ranks that do not arrive in time give `SS_ERR_TIMEOUT` naming
/// the first 8 of them and counting the rest. Block descriptors travel over
/// Linux abstract-namespace sockets that vanish with their process (nothing
/// in TMPDIR), checked with `SO_PEERCRED` to be the peer ranks' processes
/// (pid from their rendezvous requests, same uid): ranks must share a pid
/// and network namespace. A second call for the same block and group
/// returns the same object. `*out` is borrowed (hence `const`): the block
/// owns it, and `ss_symm_free` of the block releases it.
///
/// # Safety
/// `ptr` may be any value (it is only looked up); `group` is NULL or a
/// NUL-terminated string; `out` is NULL or points to a writable
/// `const ss_symm_mem*`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_rendezvous(
    ptr: *mut c_void,
    group: *const c_char,
    timeout_ms: i64,
    out: *mut *const SsSymmMem,
) -> ss_status {
    ffi_status!("ss_symm_mem_rendezvous", {
        out_arg(out, "out")?;
        if ptr.is_null() {
            return Err(null("ptr"));
        }
        // SAFETY: NULL or a NUL-terminated string.
        let group = unsafe { opt_group(group) }?;
        let timeout = timeout_arg(timeout_ms)?;
        let h = symm::rendezvous(ptr.cast(), group, timeout)?;
        // The allocation keeps the Arc, so the address stays valid until
        // ss_symm_free.
        let p = std::sync::Arc::as_ptr(&h) as *const SsSymmMem;
        // SAFETY: checked above.
        unsafe { write_out(out, p) };
        Ok(())
    })
}

/// This process's rank in the object's group; -1 for NULL.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_rank(h: *const SsSymmMem) -> c_int {
    ffi_value!("ss_symm_mem_rank", -1, {
        // SAFETY: NULL or a live handle.
        unsafe { symm_mem(h) }.map_or(-1, |m| m.rank() as c_int)
    })
}

/// The number of ranks of the object's group; -1 for NULL.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_world_size(h: *const SsSymmMem) -> c_int {
    ffi_value!("ss_symm_mem_world_size", -1, {
        // SAFETY: NULL or a live handle.
        unsafe { symm_mem(h) }.map_or(-1, |m| m.world_size() as c_int)
    })
}

/// Usable bytes of each rank's buffer; 0 for NULL.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_buffer_size(h: *const SsSymmMem) -> usize {
    ffi_value!("ss_symm_mem_buffer_size", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { symm_mem(h) }.map_or(0, |m| m.buffer_size())
    })
}

/// Bytes of each rank's signal pad; 0 for NULL.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_signal_pad_size(h: *const SsSymmMem) -> usize {
    ffi_value!("ss_symm_mem_signal_pad_size", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { symm_mem(h) }.map_or(0, |m| m.signal_pad_size())
    })
}

/// Runs `f` on a live handle and writes the pointer it gives to `out`.
///
/// # Safety
/// `h` is NULL or a live handle; `out` NULL or writable.
unsafe fn ptr_out(h: *const SsSymmMem, out: *mut *mut c_void, f: impl FnOnce(&SymmetricMemory) -> Result<*mut u8>) -> Result<()> {
    out_arg(out, "out")?;
    // SAFETY: per the contract above.
    let m = unsafe { symm_mem(h) }?;
    let p = f(m)?;
    // SAFETY: checked above.
    unsafe { write_out(out, p.cast()) };
    Ok(())
}

/// The address, in this process, of rank `rank`'s buffer.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `void*`. The address is valid until
/// the block is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_buffer_ptr(h: *const SsSymmMem, rank: c_int, out: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_symm_mem_buffer_ptr", {
        // SAFETY: NULL or a live handle; out NULL or writable.
        unsafe { ptr_out(h, out, |m| m.buffer_ptr(rank.into())) }
    })
}

/// The address, in this process, of rank `rank`'s signal pad (uint32
/// slots; keep them zero after your own use, as barrier/put/wait do).
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `void*`. The address is valid until
/// the block is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_signal_pad_ptr(h: *const SsSymmMem, rank: c_int, out: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_symm_mem_signal_pad_ptr", {
        // SAFETY: NULL or a live handle; out NULL or writable.
        unsafe { ptr_out(h, out, |m| m.signal_pad_ptr(rank.into())) }
    })
}

/// A device-readable array of `world_size` pointers: every rank's buffer as
/// mapped here (PyTorch's `get_buffer_ptrs_dev`), for kernels. CUDA: device
/// memory; CPU: host memory. Owned by the object.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `void*`. The array is valid until
/// the block is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_buffer_ptrs_dev(h: *const SsSymmMem, out: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_symm_mem_buffer_ptrs_dev", {
        // SAFETY: NULL or a live handle; out NULL or writable.
        unsafe { ptr_out(h, out, |m| m.buffer_ptrs_dev()) }
    })
}

/// The same array for the signal pads (PyTorch's `get_signal_pad_ptrs_dev`).
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `void*`. The array is valid until
/// the block is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_signal_pad_ptrs_dev(h: *const SsSymmMem, out: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_symm_mem_signal_pad_ptrs_dev", {
        // SAFETY: NULL or a live handle; out NULL or writable.
        unsafe { ptr_out(h, out, |m| m.signal_pad_ptrs_dev()) }
    })
}

/// Whether the block has a multicast address (false for NULL, for CPU
/// blocks, and where `ss_symm_mem_multicast_ptr` says why not).
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_has_multicast(h: *const SsSymmMem) -> bool {
    ffi_value!("ss_symm_mem_has_multicast", false, {
        // SAFETY: NULL or a live handle.
        unsafe { symm_mem(h) }.is_ok_and(|m| m.has_multicast())
    })
}

/// The buffer's address in the block's multicast mapping; without one
/// `SS_ERR_UNSUPPORTED` with the reason (`TORCH_SYMM_MEM_DISABLE_MULTICAST`, ranks sharing a device,
/// a device or driver without multicast, …).
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `void*`.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_multicast_ptr(h: *const SsSymmMem, out: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_symm_mem_multicast_ptr", {
        // SAFETY: NULL or a live handle; out NULL or writable.
        unsafe { ptr_out(h, out, |m| m.multicast_ptr()) }
    })
}

/// The address of `nbytes` at `offset` in rank `rank`'s buffer, after
/// PyTorch's checks: a bad rank ("Invalid peer rank") or a range past the
/// buffer ("the requested size (N bytes) exceeds the allocated size (M
/// bytes)") is `SS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `void*`. The address is valid until
/// the block is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_get_buffer(
    h: *const SsSymmMem,
    rank: c_int,
    nbytes: usize,
    offset: usize,
    out: *mut *mut c_void,
) -> ss_status {
    ffi_status!("ss_symm_mem_get_buffer", {
        // SAFETY: NULL or a live handle; out NULL or writable.
        unsafe { ptr_out(h, out, |m| m.get_buffer(rank.into(), nbytes, offset)) }
    })
}

/// Signals every other rank on `channel`, then waits for each of them.
/// `timeout_ms` 0 waits forever; expiry is `SS_ERR_TIMEOUT` naming the
/// rank, the peer and the channel. `stream` is a CUDA stream (ignored by
/// the CPU backend; may be NULL). CUDA: the call enqueues a kernel on
/// `stream` and returns; a kernel that times out records it in host-mapped
/// memory and ends (the stream goes on), and the next barrier/put/wait on
/// this object returns that `SS_ERR_TIMEOUT` without enqueuing anything.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem`; no other thread may run a barrier,
/// put or wait on `channel` of it meanwhile. `stream` is NULL or, for a CUDA
/// block, a live `cudaStream_t` of the block's device.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_barrier(h: *const SsSymmMem, channel: c_int, timeout_ms: i64, stream: *mut c_void) -> ss_status {
    ffi_status!("ss_symm_mem_barrier", {
        // SAFETY: NULL or a live handle.
        let m = unsafe { symm_mem(h) }?;
        m.barrier(channel.into(), timeout_arg(timeout_ms)?, stream as usize)
    })
}

/// Signals rank `dst_rank` on `channel` (waits while its previous signal
/// from us is unconsumed). Timeout and stream as for the barrier.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem`; no other thread may use the pair
/// (`dst_rank`, `channel`) of it meanwhile (put, wait or barrier). `stream`
/// is NULL or, for a CUDA block, a live `cudaStream_t` of the block's device.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_put_signal(
    h: *const SsSymmMem,
    dst_rank: c_int,
    channel: c_int,
    timeout_ms: i64,
    stream: *mut c_void,
) -> ss_status {
    ffi_status!("ss_symm_mem_put_signal", {
        // SAFETY: NULL or a live handle.
        let m = unsafe { symm_mem(h) }?;
        m.put_signal(dst_rank.into(), channel.into(), timeout_arg(timeout_ms)?, stream as usize)
    })
}

/// Waits for the signal of rank `src_rank` on `channel` and consumes it.
/// Timeout and stream as for the barrier.
///
/// # Safety
/// `h` is NULL or a live `ss_symm_mem`; no other thread may use the pair
/// (`src_rank`, `channel`) of it meanwhile (put, wait or barrier). `stream`
/// is NULL or, for a CUDA block, a live `cudaStream_t` of the block's device.
#[no_mangle]
pub unsafe extern "C" fn ss_symm_mem_wait_signal(
    h: *const SsSymmMem,
    src_rank: c_int,
    channel: c_int,
    timeout_ms: i64,
    stream: *mut c_void,
) -> ss_status {
    ffi_status!("ss_symm_mem_wait_signal", {
        // SAFETY: NULL or a live handle.
        let m = unsafe { symm_mem(h) }?;
        m.wait_signal(src_rank.into(), channel.into(), timeout_arg(timeout_ms)?, stream as usize)
    })
}

/// Marks symmetric memory as finalizing (PyTorch's `is_finalizing`): later
/// frees leave mappings in place for teardown code that still reads them.
/// Runs by itself at exit once the symmetric-memory registry was used.
#[no_mangle]
pub extern "C" fn ss_symm_finalize() {
    ffi_value!("ss_symm_finalize", (), {
        registry::begin_finalizing();
    })
}
