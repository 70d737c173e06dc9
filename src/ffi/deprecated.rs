//! The old names of the functions renamed in 0.2.0, kept for one minor
//! release as deprecated aliases (the header marks them so compilers warn).
//! Each calls its replacement; docs/c-api.md has the table and the policy.
//! Delete this file in 0.3.0.
#![allow(deprecated)]

use super::arena::{ss_arena_handle, SsArena, SsArenaView};
use super::content_store::{SsContentList, SsContentReader, SsContentStorage, SsContentTensor, SsContentWriter};
use super::cuda::{SsCudaIpcHandle, SsCudaReceived};
use super::map::SsMap;
use super::status::ss_status;
use super::store::SsStore;
use super::store_callbacks::SsStoreCallbacks;
use super::symm::SsSymmMem;
use super::*;
use std::ffi::c_void;
use std::os::raw::{c_char, c_int};

/// Deprecated alias of `ss_arena_dealloc` (the old name, kept for one release).
///
/// # Safety
/// As `ss_arena_dealloc`.
#[deprecated(note = "renamed to ss_arena_dealloc")]
#[no_mangle]
pub unsafe extern "C" fn ss_arena_free(a: *const SsArena, ptr: *mut c_void) -> ss_status {
    ffi_value!("ss_arena_free", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { arena::ss_arena_dealloc(a, ptr) }
    })
}

/// Deprecated alias of `ss_arena_view_open` (the old name, kept for one release).
///
/// # Safety
/// As `ss_arena_view_open`.
#[deprecated(note = "renamed to ss_arena_view_open")]
#[no_mangle]
pub unsafe extern "C" fn ss_arena_open_remote(h: *const ss_arena_handle, out: *mut *mut SsArenaView) -> ss_status {
    ffi_value!("ss_arena_open_remote", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { arena::ss_arena_view_open(h, out) }
    })
}

/// Deprecated alias of `ss_arena_remote_cache_trim` (the old name, kept for one release).
///
/// # Safety
/// As `ss_arena_remote_cache_trim`.
#[deprecated(note = "renamed to ss_arena_remote_cache_trim")]
#[no_mangle]
pub unsafe extern "C" fn ss_arena_trim_remote_cache(out_released: *mut usize) -> ss_status {
    ffi_value!("ss_arena_trim_remote_cache", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { arena::ss_arena_remote_cache_trim(out_released) }
    })
}

/// Deprecated alias of `ss_content_writer_write_storage` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_writer_write_storage`.
#[deprecated(note = "renamed to ss_content_writer_write_storage")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_write_storage(
    w: *const SsContentWriter,
    data: *const c_void,
    nbytes: usize,
    buf: *mut c_char,
    buf_len: usize,
) -> ss_status {
    ffi_value!("ss_content_write_storage", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_writer_write_storage(w, data, nbytes, buf, buf_len) }
    })
}

/// Deprecated alias of `ss_content_writer_write_tensor` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_writer_write_tensor`.
#[deprecated(note = "renamed to ss_content_writer_write_tensor")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_write_tensor(
    w: *const SsContentWriter,
    name: *const c_char,
    data: *const c_void,
    nbytes: usize,
    dtype: c_int,
    offset: i64,
    ndim: usize,
    shape: *const i64,
    stride: *const i64,
) -> ss_status {
    ffi_value!("ss_content_write_tensor", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_writer_write_tensor(w, name, data, nbytes, dtype, offset, ndim, shape, stride) }
    })
}

/// Deprecated alias of `ss_content_reader_read_tensor` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_reader_read_tensor`.
#[deprecated(note = "renamed to ss_content_reader_read_tensor")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_read_tensor(
    r: *const SsContentReader,
    name: *const c_char,
    out: *mut *mut SsContentTensor,
) -> ss_status {
    ffi_value!("ss_content_read_tensor", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_reader_read_tensor(r, name, out) }
    })
}

/// Deprecated alias of `ss_content_reader_read_storage` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_reader_read_storage`.
#[deprecated(note = "renamed to ss_content_reader_read_storage")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_read_storage(
    r: *const SsContentReader,
    hash: *const c_char,
    out: *mut *mut SsContentStorage,
) -> ss_status {
    ffi_value!("ss_content_read_storage", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_reader_read_storage(r, hash, out) }
    })
}

/// Deprecated alias of `ss_content_reader_list_tensors` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_reader_list_tensors`.
#[deprecated(note = "renamed to ss_content_reader_list_tensors")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_list_tensors(r: *const SsContentReader, out: *mut *mut SsContentList) -> ss_status {
    ffi_value!("ss_content_list_tensors", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_reader_list_tensors(r, out) }
    })
}

/// Deprecated alias of `ss_content_reader_list_storages` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_reader_list_storages`.
#[deprecated(note = "renamed to ss_content_reader_list_storages")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_list_storages(r: *const SsContentReader, out: *mut *mut SsContentList) -> ss_status {
    ffi_value!("ss_content_list_storages", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_reader_list_storages(r, out) }
    })
}

/// Deprecated alias of `ss_content_reader_verify` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_reader_verify`.
#[deprecated(note = "renamed to ss_content_reader_verify")]
#[no_mangle]
pub unsafe extern "C" fn ss_content_verify(
    r: *const SsContentReader,
    out_checked: *mut u64,
    out_problems: *mut *mut SsContentList,
) -> ss_status {
    ffi_value!("ss_content_verify", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_reader_verify(r, out_checked, out_problems) }
    })
}

/// Deprecated alias of `ss_content_hash_bytes` (the old name, kept for one release).
///
/// # Safety
/// As `ss_content_hash_bytes`.
#[deprecated(note = "renamed to ss_content_hash_bytes")]
#[no_mangle]
pub unsafe extern "C" fn ss_hash_bytes(data: *const c_void, nbytes: usize, mode: c_int, buf: *mut c_char, buf_len: usize) -> ss_status {
    ffi_value!("ss_hash_bytes", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { content_store::ss_content_hash_bytes(data, nbytes, mode, buf, buf_len) }
    })
}

/// Deprecated alias of `ss_cuda_received_open` (the old name, kept for one release).
///
/// # Safety
/// As `ss_cuda_received_open`.
#[deprecated(note = "renamed to ss_cuda_received_open")]
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_open(ipc_handle: *const SsCudaIpcHandle, stream: *mut c_void, out: *mut *mut SsCudaReceived) -> ss_status {
    ffi_value!("ss_cuda_open", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { cuda::ss_cuda_received_open(ipc_handle, stream, out) }
    })
}

/// Deprecated alias of `ss_cuda_ipc_counter_release` (the old name, kept for one release).
///
/// # Safety
/// As `ss_cuda_ipc_counter_release`.
#[deprecated(note = "renamed to ss_cuda_ipc_counter_release")]
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_release_ipc_counter(counter_name: *const c_char, slot: u64) -> ss_status {
    ffi_value!("ss_cuda_release_ipc_counter", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { cuda::ss_cuda_ipc_counter_release(counter_name, slot) }
    })
}

/// Deprecated alias of `ss_cuda_alloc` (the old name, kept for one release).
///
/// # Safety
/// As `ss_cuda_alloc`.
#[deprecated(note = "renamed to ss_cuda_alloc")]
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_malloc(device: i32, nbytes: usize, out: *mut *mut c_void) -> ss_status {
    ffi_value!("ss_cuda_malloc", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { cuda::ss_cuda_alloc(device, nbytes, out) }
    })
}

/// Deprecated alias of `ss_fds_send` (the old name, kept for one release).
///
/// # Safety
/// As `ss_fds_send`.
#[deprecated(note = "renamed to ss_fds_send")]
#[no_mangle]
pub unsafe extern "C" fn ss_send_fds(sock: c_int, payload: *const c_void, len: usize, fds: *const c_int, nfds: usize) -> ss_status {
    ffi_value!("ss_send_fds", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { fd_passing::ss_fds_send(sock, payload, len, fds, nfds) }
    })
}

/// Deprecated alias of `ss_fds_recv` (the old name, kept for one release).
///
/// # Safety
/// As `ss_fds_recv`.
#[deprecated(note = "renamed to ss_fds_recv")]
#[no_mangle]
pub unsafe extern "C" fn ss_recv_fds(
    sock: c_int,
    buf: *mut c_void,
    len: usize,
    out_len: *mut usize,
    fds: *mut c_int,
    max_fds: usize,
    out_nfds: *mut usize,
) -> ss_status {
    ffi_value!("ss_recv_fds", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { fd_passing::ss_fds_recv(sock, buf, len, out_len, fds, max_fds, out_nfds) }
    })
}

/// Deprecated alias of `ss_map_open_refcounted` (the old name, kept for one release).
///
/// # Safety
/// As `ss_map_open_refcounted`.
#[deprecated(note = "renamed to ss_map_open_refcounted")]
#[no_mangle]
pub unsafe extern "C" fn ss_refcounted_map_open(name: *const c_char, flags: c_int, size: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_value!("ss_refcounted_map_open", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { map::ss_map_open_refcounted(name, flags, size, out) }
    })
}

/// Deprecated alias of `ss_shm_name_new` (the old name, kept for one release).
///
/// # Safety
/// As `ss_shm_name_new`.
#[deprecated(note = "renamed to ss_shm_name_new")]
#[no_mangle]
pub unsafe extern "C" fn ss_new_process_wide_shm_handle(buf: *mut c_char, len: usize) -> ss_status {
    ffi_value!("ss_new_process_wide_shm_handle", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { storage_utils::ss_shm_name_new(buf, len) }
    })
}

/// Deprecated alias of `ss_map_new_shm_fd` (the old name, kept for one release).
///
/// # Safety
/// As `ss_map_new_shm_fd`.
#[deprecated(note = "renamed to ss_map_new_shm_fd")]
#[no_mangle]
pub unsafe extern "C" fn ss_new_shm_fd_storage(size: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_value!("ss_new_shm_fd_storage", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { storage_utils::ss_map_new_shm_fd(size, out) }
    })
}

/// Deprecated alias of `ss_map_new_copy` (the old name, kept for one release).
///
/// # Safety
/// As `ss_map_new_copy`.
#[deprecated(note = "renamed to ss_map_new_copy")]
#[no_mangle]
pub unsafe extern "C" fn ss_share_memory(src: *const c_void, nbytes: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_value!("ss_share_memory", ss_status::SS_ERR_PANIC, {
        // SAFETY: the caller keeps the contract of the replacement.
        unsafe { storage_utils::ss_map_new_copy(src, nbytes, out) }
    })
}

/// Deprecated alias of `ss_map_lookup`, which returns the same borrowed
/// handle as `const` (this one's non-const result must never reach
/// `ss_map_free`).
///
/// # Safety
/// As `ss_map_lookup`.
#[deprecated(note = "renamed to ss_map_lookup, which returns a const (borrowed) ss_map")]
#[no_mangle]
pub unsafe extern "C" fn ss_map_from_data(ptr: *const c_void) -> *mut SsMap {
    ffi_value!("ss_map_from_data", std::ptr::null_mut(), {
        // SAFETY: any pointer is allowed.
        unsafe { map::ss_map_lookup(ptr) }.cast_mut()
    })
}

/// Deprecated alias of `ss_store_callbacks_open`, with one more refusal:
/// a table laid out as in 0.1.0 (five function pointers, no leading
/// `struct_size`) is named as such. Only its first word is read before
/// that check, so the old, shorter table is never read past its end.
///
/// # Safety
/// As `ss_store_callbacks_open`, except that `cb` may point to 0.1.0's
/// smaller table (at least one readable pointer-sized word).
#[deprecated(note = "renamed to ss_store_callbacks_open (initialize the table with SS_STORE_CALLBACKS_INIT)")]
#[no_mangle]
pub unsafe extern "C" fn ss_store_from_callbacks(cb: *const SsStoreCallbacks, ctx: *mut c_void, out: *mut *mut SsStore) -> ss_status {
    ffi_value!("ss_store_from_callbacks", ss_status::SS_ERR_PANIC, {
        if !cb.is_null() {
            // SAFETY: a non-NULL table has at least its first word, in
            // either layout.
            let first_word = unsafe { cb.cast::<usize>().read_unaligned() };
            if let Err(e) = check_not_a_0_1_table(first_word) {
                super::guard::set_last_error(&e);
                return e.kind().into();
            }
        }
        // SAFETY: NULL, or a table whose first word is a plausible
        // struct_size: the current layout, which the replacement checks.
        unsafe { store_callbacks::ss_store_callbacks_open(cb, ctx, out) }
    })
}

/// Refuses the first word of an `ss_store_callbacks` that cannot be a
/// `struct_size`: 0 (never initialized: a zeroed table filled by hand) or
/// more than any version's size (0.1.0's table, whose first word is the
/// `set` function).
fn check_not_a_0_1_table(first_word: usize) -> crate::Result<()> {
    use crate::{Error, ErrorKind};
    let size = std::mem::size_of::<SsStoreCallbacks>();
    let fix = "rebuild the caller against this header and initialize the table with SS_STORE_CALLBACKS_INIT \
               (the 0.1.0 layout, without struct_size, is no longer accepted)";
    if first_word == 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("ss_store_callbacks.struct_size is 0: {fix}")));
    }
    if first_word > size {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "ss_store_callbacks.struct_size is {first_word:#x}, not a size ({size} bytes in this library): \
                 the table looks built against storage-sharing 0.1.0, which had no struct_size field; {fix}"
            ),
        ));
    }
    Ok(())
}

/// Deprecated alias of `ss_symm_mem_rendezvous`, which writes the same
/// borrowed object through a `const` out-parameter.
///
/// # Safety
/// As `ss_symm_mem_rendezvous`; `out` is NULL or points to a writable
/// `ss_symm_mem*`.
#[deprecated(note = "renamed to ss_symm_mem_rendezvous, whose out-parameter is const (the block owns the object)")]
#[no_mangle]
pub unsafe extern "C" fn ss_symm_rendezvous(
    ptr: *mut c_void,
    group: *const c_char,
    timeout_ms: i64,
    out: *mut *mut SsSymmMem,
) -> ss_status {
    ffi_value!("ss_symm_rendezvous", ss_status::SS_ERR_PANIC, {
        // SAFETY: a `*mut SsSymmMem` slot holds a `*const SsSymmMem` alike.
        unsafe { symm::ss_symm_mem_rendezvous(ptr, group, timeout_ms, out.cast()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_a_function_pointer_are_not_sizes() {
        let zero = check_not_a_0_1_table(0).unwrap_err();
        assert!(zero.message().contains("SS_STORE_CALLBACKS_INIT"), "{}", zero.message());
        let old = check_not_a_0_1_table(0x5555_5555_1234).unwrap_err();
        assert!(old.message().contains("0.1.0") && old.message().contains("struct_size"), "{}", old.message());
        assert!(check_not_a_0_1_table(std::mem::size_of::<SsStoreCallbacks>()).is_ok());
    }
}
