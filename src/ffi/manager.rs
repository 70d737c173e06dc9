//! C API of the shared-memory manager: which daemon binary to start, and
//! starting one by hand.

use super::args::{copy_c_string, str_arg};
use super::status::ss_status;
use crate::manager::spawn;
use std::os::raw::c_char;

/// Uses the daemon binary at `path` when a manager must be started
/// (libshm's `libshm_init`). Without this call the library looks at the
/// environment variable `SS_SHM_MANAGER`, then for `ss_shm_manager` beside
/// the shared library (and in `../bin` from it), then on `PATH`.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ss_shm_manager_set_binary(path: *const c_char) -> ss_status {
    ffi_status!("ss_shm_manager_set_binary", {
        // SAFETY: a NUL-terminated string or NULL.
        spawn::set_manager_binary(unsafe { str_arg(path, "path") }?)
    })
}

/// Starts a new manager daemon (it exits by itself after 2 s without
/// clients) and writes its socket path, NUL-terminated, into `buf` of
/// `len` bytes (108 always suffice). A daemon that prints no path within
/// 5 s is stopped: `SS_ERR_TIMEOUT`. Connect to it by passing the path as
/// the manager handle of `ss_storage_new_shared_filename`.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ss_shm_manager_spawn(buf: *mut c_char, len: usize) -> ss_status {
    ffi_status!("ss_shm_manager_spawn", {
        if buf.is_null() {
            return Err(super::args::null("buf"));
        }
        let path = spawn::spawn_manager()?;
        // SAFETY: the caller gives a buffer of len bytes.
        unsafe { copy_c_string(&path, buf, len, "buf") }
    })
}
