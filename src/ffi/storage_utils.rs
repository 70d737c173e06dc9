//! C API of ATen's StorageUtils: segment names, fd-backed segments,
//! share_memory.

use super::args::{copy_c_string, null, out_arg, write_out};
use super::map::{plain, SsMap};
use super::status::ss_status;
use crate::shm::{new_process_wide_shm_handle, new_shm_fd_storage, share_memory};
use std::ffi::c_void;
use std::os::raw::c_char;

/// Writes a fresh process-wide segment name (`/torch_<pid>_<rand>_<n>`,
/// at most 46 bytes plus NUL) into `buf` of `len` bytes.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ss_shm_name_new(buf: *mut c_char, len: usize) -> ss_status {
    ffi_status!("ss_shm_name_new", {
        // SAFETY: the caller gives a buffer of len bytes or NULL.
        unsafe { copy_c_string(&new_process_wide_shm_handle(), buf, len, "buf") }
    })
}

/// A new anonymous shared-memory segment of `size` zero bytes whose name is
/// already removed; its descriptor is kept (`ss_map_fd`), flags 86.
///
/// # Safety
/// `out` is NULL or points to a writable `ss_map*`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_new_shm_fd(size: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_status!("ss_map_new_shm_fd", {
        out_arg(out, "out")?;
        let m = new_shm_fd_storage(size)?;
        // SAFETY: checked above.
        unsafe { write_out(out, SsMap::into_raw(plain(m))) };
        Ok(())
    })
}

/// Copies `nbytes` from `src` into a new fd-backed segment (as
/// `ss_map_new_shm_fd`) and returns its map: `share_memory_()`.
/// Fails with `SS_ERR_NO_SPACE` when /dev/shm cannot hold it.
///
/// # Safety
/// `src` is NULL or readable for `nbytes` bytes (any alignment), and no
/// thread writes them during the call; `out` is NULL or points to a writable
/// `ss_map*`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_new_copy(src: *const c_void, nbytes: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_status!("ss_map_new_copy", {
        out_arg(out, "out")?;
        if src.is_null() {
            return Err(null("src"));
        }
        // SAFETY: the caller gives nbytes readable bytes at src.
        let bytes = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), nbytes) };
        let m = share_memory(bytes)?;
        // SAFETY: checked above.
        unsafe { write_out(out, SsMap::into_raw(plain(m))) };
        Ok(())
    })
}
