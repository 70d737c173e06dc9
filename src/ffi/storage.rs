//! C API of the storage object and its sharing: `ss_storage`, `ss_weak`.

use super::args::{c_string_fits, copy_c_string, free_handle, handle, out_arg, str_arg, write_out};
use super::status::ss_status;
use crate::error::{Error, ErrorKind};
use crate::storage::{Storage, WeakStorage};
use std::ffi::c_void;
use std::os::raw::{c_char, c_int};

/// A strong reference to a storage: a byte buffer that can be moved into
/// shared memory and opened by other processes. Each handle is one
/// reference; `ss_storage_free` drops it and the bytes go with the last.
///
/// Thread safety: a `const ss_storage*` may be used from several threads
/// at once, including the sharing calls (they lock internally).
/// `ss_storage_share_fd` and `ss_storage_share_filename` move a heap
/// storage's bytes: data pointers taken before then are invalid after.
pub struct SsStorage {
    storage: Storage,
}

/// A weak reference to a storage: does not keep its bytes alive.
///
/// Thread safety: a `const ss_weak*` may be used from several threads.
pub struct SsWeak {
    weak: WeakStorage,
}

/// Checks `out`, then makes a storage and hands a new handle to it out:
/// the body of every function that returns an `ss_storage`.
///
/// # Safety
/// `out` is NULL or writable for one pointer.
unsafe fn new_handle(out: *mut *mut SsStorage, make: impl FnOnce() -> crate::Result<Storage>) -> crate::Result<()> {
    out_arg(out, "out")?;
    let storage = make()?;
    // SAFETY: checked above.
    unsafe { write_out(out, Box::into_raw(Box::new(SsStorage { storage }))) };
    Ok(())
}

impl SsStorage {
    /// A new handle owning `storage` (for other areas' constructors).
    pub(crate) fn wrap(storage: Storage) -> *mut SsStorage {
        Box::into_raw(Box::new(SsStorage { storage }))
    }
}

/// The storage behind a handle argument.
unsafe fn storage<'a>(s: *const SsStorage) -> crate::Result<&'a Storage> {
    // SAFETY: the caller passes NULL or a live handle.
    Ok(&unsafe { handle(s, "storage") }?.storage)
}

/// A new resizable storage of `nbytes` zero bytes on the heap (64-byte
/// aligned). `nbytes` may be 0 (data is then NULL).
///
/// # Safety
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_new(nbytes: usize, out: *mut *mut SsStorage) -> ss_status {
    ffi_status!("ss_storage_new", {
        // SAFETY: out is NULL or writable.
        unsafe { new_handle(out, || Storage::new(nbytes)) }
    })
}

/// A second strong reference to the same storage (free both).
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_ref(s: *const SsStorage, out: *mut *mut SsStorage) -> ss_status {
    ffi_status!("ss_storage_ref", {
        // SAFETY: out is NULL or writable; s is NULL or a live handle.
        unsafe { new_handle(out, || Ok(storage(s)?.clone())) }
    })
}

/// Start of the bytes; NULL for NULL or an empty storage. Changes when a
/// heap storage is moved into shared memory.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile).
/// The pointer is valid while a strong reference lives and the bytes do not
/// move (resize, `ss_storage_share_fd`, `ss_storage_share_filename`).
#[no_mangle]
pub unsafe extern "C" fn ss_storage_data(s: *const SsStorage) -> *mut c_void {
    ffi_value!("ss_storage_data", std::ptr::null_mut(), {
        // SAFETY: NULL or a live handle.
        unsafe { s.as_ref() }.map_or(std::ptr::null_mut(), |s| s.storage.data().cast())
    })
}

/// Size in bytes; 0 for NULL.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_storage_nbytes(s: *const SsStorage) -> usize {
    ffi_value!("ss_storage_nbytes", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { s.as_ref() }.map_or(0, |s| s.storage.nbytes())
    })
}

/// Whether the bytes are in shared memory (fd-backed or managed); false
/// for NULL.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_storage_is_shared(s: *const SsStorage) -> bool {
    ffi_value!("ss_storage_is_shared", false, {
        // SAFETY: NULL or a live handle.
        unsafe { s.as_ref() }.is_some_and(|s| s.storage.is_shared())
    })
}

/// Resizes a heap storage (prefix kept, the rest zero). A shared storage
/// is not resizable: `SS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile).
/// The bytes move: no thread may access them through a pointer from
/// `ss_storage_data` during the call, nor use such a pointer after it.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_resize(s: *const SsStorage, nbytes: usize) -> ss_status {
    ffi_status!("ss_storage_resize", {
        // SAFETY: NULL or a live handle.
        unsafe { storage(s) }?.resize(nbytes)
    })
}

/// Moves the storage into an fd-backed shared segment (a copy, unless it
/// is fd-backed already) and returns its descriptor and size. The fd
/// stays owned by the storage: send it (`ss_fds_send`) or dup it, never
/// close it. A 0-byte storage cannot be shared: `SS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile);
/// `out_fd` and `out_nbytes` are NULL or point to a writable `int` and
/// `size_t`. The bytes may move (a copy into shared memory): no thread may
/// access them through an earlier `ss_storage_data` pointer during the
/// call, nor after it.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_share_fd(s: *const SsStorage, out_fd: *mut c_int, out_nbytes: *mut usize) -> ss_status {
    ffi_status!("ss_storage_share_fd", {
        out_arg(out_fd, "out_fd")?;
        out_arg(out_nbytes, "out_nbytes")?;
        // SAFETY: NULL or a live handle.
        let (fd, n) = unsafe { storage(s) }?.share_fd()?;
        // SAFETY: checked above.
        unsafe {
            write_out(out_fd, fd);
            write_out(out_nbytes, n);
        }
        Ok(())
    })
}

/// Opens a storage shared by fd: maps `nbytes` of a duplicate of `fd`
/// (ATen flags 58). The caller keeps `fd` and closes it when done.
///
/// # Safety
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_new_shared_fd(fd: c_int, nbytes: usize, out: *mut *mut SsStorage) -> ss_status {
    ffi_status!("ss_storage_new_shared_fd", {
        // SAFETY: out is NULL or writable.
        unsafe { new_handle(out, || Storage::new_shared_fd(fd, nbytes)) }
    })
}

/// A new fd-backed shared storage of `nbytes` zero bytes (ATen flags 86).
///
/// # Safety
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_new_using_fd(nbytes: usize, out: *mut *mut SsStorage) -> ss_status {
    ffi_status!("ss_storage_new_using_fd", {
        // SAFETY: out is NULL or writable.
        unsafe { new_handle(out, || Storage::new_using_fd(nbytes)) }
    })
}

/// The descriptor of an fd-backed storage (owned by it);
/// `SS_ERR_NOT_FOUND` for other storages.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile);
/// `out_fd` is NULL or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_get_shared_fd(s: *const SsStorage, out_fd: *mut c_int) -> ss_status {
    ffi_status!("ss_storage_get_shared_fd", {
        out_arg(out_fd, "out_fd")?;
        // SAFETY: NULL or a live handle.
        let fd = unsafe { storage(s) }?.get_shared_fd()?;
        // SAFETY: checked above.
        unsafe { write_out(out_fd, fd) };
        Ok(())
    })
}

/// Moves the storage into a managed refcounted segment (a copy, unless it
/// is one already; registered with this process's manager, which is
/// started on first use) and writes the manager's socket path and the
/// segment name, NUL-terminated, into the two buffers, and the size into
/// `out_nbytes`. These three values are what `ss_storage_new_shared_filename`
/// takes in another process; an empty storage gets a segment of the 64-byte
/// header alone and size 0, as ATen's. Buffers of 108 and 64 bytes always
/// suffice; a smaller one gives `SS_ERR_BUFFER_TOO_SMALL` and writes neither buffer
/// (the storage is shared anyway; call again with room).
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile);
/// `manager_buf` and `name_buf` are NULL or writable for `manager_len` and
/// `name_len` bytes; `out_nbytes` is NULL or points to a writable `size_t`.
/// The bytes may move (a copy into shared memory): no thread may access
/// them through an earlier `ss_storage_data` pointer during the call, nor
/// after it.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_share_filename(
    s: *const SsStorage,
    manager_buf: *mut c_char,
    manager_len: usize,
    name_buf: *mut c_char,
    name_len: usize,
    out_nbytes: *mut usize,
) -> ss_status {
    ffi_status!("ss_storage_share_filename", {
        out_arg(manager_buf, "manager_buf")?;
        out_arg(name_buf, "name_buf")?;
        out_arg(out_nbytes, "out_nbytes")?;
        // SAFETY: NULL or a live handle.
        let h = unsafe { storage(s) }?.share_filename()?;
        // Both sizes first: neither buffer is written unless both fit.
        c_string_fits(&h.manager_handle, manager_len, "manager_buf")?;
        c_string_fits(&h.filename, name_len, "name_buf")?;
        // SAFETY: the caller gives buffers of the stated lengths.
        unsafe {
            copy_c_string(&h.manager_handle, manager_buf, manager_len, "manager_buf")?;
            copy_c_string(&h.filename, name_buf, name_len, "name_buf")?;
            write_out(out_nbytes, h.nbytes);
        }
        Ok(())
    })
}

/// Opens a storage shared by name: registers with the manager at
/// `manager` (its socket path; "" = this process's own manager), then maps
/// the segment `name` of `nbytes` bytes (ATen flags 10; header count + 1).
/// A segment that is gone gives `SS_ERR_NOT_FOUND`; an unreachable manager
/// `SS_ERR_NOT_FOUND`/`SS_ERR_PEER_GONE`/`SS_ERR_TIMEOUT`.
///
/// # Safety
/// `manager` and `name` are NULL or NUL-terminated strings; `out` is NULL or
/// points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_new_shared_filename(
    manager: *const c_char,
    name: *const c_char,
    nbytes: usize,
    out: *mut *mut SsStorage,
) -> ss_status {
    ffi_status!("ss_storage_new_shared_filename", {
        // SAFETY: out is NULL or writable; the strings NUL-terminated or NULL.
        unsafe { new_handle(out, || Storage::new_shared_filename(str_arg(manager, "manager")?, str_arg(name, "name")?, nbytes)) }
    })
}

/// A new managed shared storage of `nbytes` zero bytes (ATen flags 6).
///
/// # Safety
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_new_using_filename(nbytes: usize, out: *mut *mut SsStorage) -> ss_status {
    ffi_status!("ss_storage_new_using_filename", {
        // SAFETY: out is NULL or writable.
        unsafe { new_handle(out, || Storage::new_using_filename(nbytes)) }
    })
}

/// Adds one to a storage shared by name's header count: the sender's
/// reference "in flight", taken before the handle is sent.
/// `SS_ERR_UNSUPPORTED` for storages not shared by name.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_storage_shared_incref(s: *const SsStorage) -> ss_status {
    ffi_status!("ss_storage_shared_incref", {
        // SAFETY: NULL or a live handle.
        unsafe { storage(s) }?.shared_incref()
    })
}

/// Subtracts one from the header count: the receiver cancels the sender's
/// in-flight reference after opening. The name is never removed here.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_storage_shared_decref(s: *const SsStorage) -> ss_status {
    ffi_status!("ss_storage_shared_decref", {
        // SAFETY: NULL or a live handle.
        unsafe { storage(s) }?.shared_decref()
    })
}

/// Reads the header count of a storage shared by name.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_shared_refcount(s: *const SsStorage, out: *mut i32) -> ss_status {
    ffi_status!("ss_storage_shared_refcount", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let n = unsafe { storage(s) }?.shared_refcount()?;
        // SAFETY: checked above.
        unsafe { write_out(out, n) };
        Ok(())
    })
}

/// Drops this strong reference. NULL is a no-op.
///
/// # Safety
/// `s` is NULL or a live `ss_storage` that no other thread is using; it must
/// not be used after the call (other references to the storage stay valid).
#[no_mangle]
pub unsafe extern "C" fn ss_storage_free(s: *mut SsStorage) {
    ffi_value!("ss_storage_free", (), {
        // SAFETY: NULL or a handle from this library, not used after this call.
        unsafe { free_handle(s) }
    })
}

/// A weak reference to `s` (free it with `ss_weak_free`).
///
/// # Safety
/// `s` is NULL or a live `ss_storage` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `ss_weak*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_weak_ref(s: *const SsStorage, out: *mut *mut SsWeak) -> ss_status {
    ffi_status!("ss_storage_weak_ref", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let weak = unsafe { storage(s) }?.downgrade();
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsWeak { weak }))) };
        Ok(())
    })
}

/// A new strong reference if the storage is still alive;
/// `SS_ERR_NOT_FOUND` once every strong reference is gone.
///
/// # Safety
/// `w` is NULL or a live `ss_weak` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_weak_upgrade(w: *const SsWeak, out: *mut *mut SsStorage) -> ss_status {
    ffi_status!("ss_weak_upgrade", {
        // SAFETY: out is NULL or writable; w is NULL or a live handle.
        unsafe {
            new_handle(out, || {
                handle(w, "weak")?
                    .weak
                    .upgrade()
                    .ok_or_else(|| Error::new(ErrorKind::NotFound, "weak reference expired: the storage is gone"))
            })
        }
    })
}

/// Whether no strong reference is left (true for NULL).
///
/// # Safety
/// `w` is NULL or a live `ss_weak` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_weak_expired(w: *const SsWeak) -> bool {
    ffi_value!("ss_weak_expired", true, {
        // SAFETY: NULL or a live handle.
        unsafe { w.as_ref() }.map_or(true, |w| w.weak.expired())
    })
}

/// Frees a weak reference. NULL is a no-op.
///
/// # Safety
/// `w` is NULL or a live `ss_weak` that no other thread is using; it must not
/// be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_weak_free(w: *mut SsWeak) {
    ffi_value!("ss_weak_free", (), {
        // SAFETY: NULL or a handle from this library, not used after this call.
        unsafe { free_handle(w) }
    })
}
