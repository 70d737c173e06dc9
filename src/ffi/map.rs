//! C API of MapAllocator and RefcountedMapAllocator: the `ss_map` handle.

use super::args::{free_handle, handle, handle_mut, out_arg, str_arg, write_out};
use super::status::ss_status;
use crate::error::Result;
use crate::shm::{registry, MapAllocator, Mapping, RefcountedMapAllocator};
use std::ffi::{c_void, CString};
use std::os::raw::{c_char, c_int};

// Flags of MapAllocator, ATen's values (literals so that the header shows
// them; `tests` below checks them against `shm::flags`).
/// `open(2)` a regular file read-write, MAP_SHARED.
pub const SS_MAPPED_SHARED: c_int = 1;
/// `shm_open(3)` a POSIX shared-memory object read-write, MAP_SHARED.
pub const SS_MAPPED_SHAREDMEM: c_int = 2;
/// Create the object and fail if it exists (O_EXCL).
pub const SS_MAPPED_EXCLUSIVE: c_int = 4;
/// Never create: the object must exist (and be at least the size asked).
pub const SS_MAPPED_NOCREATE: c_int = 8;
/// Keep the descriptor in the map (`ss_map_fd`); closed by `ss_map_close`.
pub const SS_MAPPED_KEEPFD: c_int = 16;
/// Map the descriptor given to `ss_map_open_fd` instead of opening a name.
pub const SS_MAPPED_FROMFD: c_int = 32;
/// Remove the name right after mapping.
pub const SS_MAPPED_UNLINK: c_int = 64;
/// Bytes of the refcount header before a refcounted segment's data.
pub const SS_REFCOUNT_HEADER_SIZE: usize = 64;

/// A mapped file or shared-memory segment, plain or refcounted.
///
/// Thread safety: a `const ss_map*` may be used from several threads at once
/// (accessors, incref, decref, refcount); `ss_map_close` and `ss_map_free`
/// need exclusive access.
pub struct SsMap {
    mapping: Mapping,
    filename: CString,
}

impl SsMap {
    /// Boxes a mapping and records its data range for `ss_map_lookup`.
    pub(crate) fn into_raw(mapping: Mapping) -> *mut SsMap {
        let filename = CString::new(mapping.filename()).unwrap_or_default();
        let raw = Box::into_raw(Box::new(SsMap { mapping, filename }));
        // SAFETY: just created.
        unsafe { &*raw }.mapping.register_owner(raw as usize);
        raw
    }

    fn data(&self) -> *mut u8 {
        self.mapping.data()
    }

    fn size(&self) -> usize {
        self.mapping.len()
    }

    fn refcounted(&self) -> Result<&RefcountedMapAllocator> {
        self.mapping.refcounted()
    }

    fn close(&mut self) -> Result<()> {
        self.mapping.close()
    }
}

pub(crate) fn plain(m: MapAllocator) -> Mapping {
    Mapping::Plain(m)
}

/// Opens `name` with `flags` and maps `size` bytes, as ATen's
/// `MapAllocator(name, flags, size)`. SHAREDMEM names start with '/'.
/// `size` must be > 0. On success `*out` owns the mapping; release it
/// with `ss_map_free`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_map*`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_open(name: *const c_char, flags: c_int, size: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_status!("ss_map_open", {
        out_arg(out, "out")?;
        // SAFETY: the caller passes a NUL-terminated name or NULL.
        let name = unsafe { str_arg(name, "name") }?;
        let m = MapAllocator::open(name, flags, size)?;
        // SAFETY: checked above.
        unsafe { write_out(out, SsMap::into_raw(Mapping::Plain(m))) };
        Ok(())
    })
}

/// Maps `size` bytes of the descriptor `fd`; `flags` must hold
/// `SS_MAPPED_FROMFD`. `name` may be NULL or "" (then the filename reads
/// "filename not specified"). On success the map owns `fd`: it is kept
/// with `SS_MAPPED_KEEPFD` (and closed by `ss_map_close`) or closed at once
/// otherwise. On failure the caller still owns `fd`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_map*`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_open_fd(name: *const c_char, fd: c_int, flags: c_int, size: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_status!("ss_map_open_fd", {
        out_arg(out, "out")?;
        // SAFETY: the caller passes a NUL-terminated name or NULL.
        let name = if name.is_null() { "" } else { unsafe { str_arg(name, "name") }? };
        let m = MapAllocator::open_fd(name, fd, flags, size)?;
        // SAFETY: checked above.
        unsafe { write_out(out, SsMap::into_raw(Mapping::Plain(m))) };
        Ok(())
    })
}

/// Creates (`SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE`: count = 1) or opens
/// (`SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE`: count + 1) a refcounted
/// segment with `size` bytes of data after a 64-byte header, as ATen's
/// `RefcountedMapAllocator`. The last holder to close removes the name.
/// Opening a segment whose count is not positive fails with
/// `SS_ERR_BAD_REFCOUNT`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_map*`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_open_refcounted(name: *const c_char, flags: c_int, size: usize, out: *mut *mut SsMap) -> ss_status {
    ffi_status!("ss_map_open_refcounted", {
        out_arg(out, "out")?;
        // SAFETY: the caller passes a NUL-terminated name or NULL.
        let name = unsafe { str_arg(name, "name") }?;
        let m = RefcountedMapAllocator::open(name, flags, size)?;
        // SAFETY: checked above.
        unsafe { write_out(out, SsMap::into_raw(Mapping::Refcounted(m))) };
        Ok(())
    })
}

/// Start of the user data (after the header for refcounted maps); NULL
/// when `map` is NULL or closed.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile). The
/// pointer is valid until the map is closed or freed.
#[no_mangle]
pub unsafe extern "C" fn ss_map_data(map: *const SsMap) -> *mut c_void {
    ffi_value!("ss_map_data", std::ptr::null_mut(), {
        // SAFETY: NULL or a live handle.
        unsafe { map.as_ref() }.map_or(std::ptr::null_mut(), |m| m.data().cast())
    })
}

/// Bytes of user data (a refcounted map's header not counted); 0 for NULL.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_map_size(map: *const SsMap) -> usize {
    ffi_value!("ss_map_size", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { map.as_ref() }.map_or(0, |m| m.size())
    })
}

/// The descriptor kept with `SS_MAPPED_KEEPFD`, else -1 (also for NULL and
/// after close).
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_map_fd(map: *const SsMap) -> c_int {
    ffi_value!("ss_map_fd", -1, {
        // SAFETY: NULL or a live handle.
        match unsafe { map.as_ref() }.map(|m| &m.mapping) {
            Some(Mapping::Plain(m)) => m.fd(),
            _ => -1,
        }
    })
}

/// The name the map was opened with, owned by the map; NULL for NULL.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile). The
/// string is valid until the map is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_map_filename(map: *const SsMap) -> *const c_char {
    ffi_value!("ss_map_filename", std::ptr::null(), {
        // SAFETY: NULL or a live handle.
        unsafe { map.as_ref() }.map_or(std::ptr::null(), |m| m.filename.as_ptr())
    })
}

/// The flags in effect (NOCREATE is dropped for read-only opens, as in
/// ATen); 0 for NULL.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_map_flags(map: *const SsMap) -> c_int {
    ffi_value!("ss_map_flags", 0, {
        // SAFETY: NULL or a live handle.
        match unsafe { map.as_ref() }.map(|m| &m.mapping) {
            Some(Mapping::Plain(m)) => m.flags(),
            Some(Mapping::Refcounted(m)) => m.flags(),
            None => 0,
        }
    })
}

/// Whether `map` was opened with `ss_map_open_refcounted`.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_map_is_refcounted(map: *const SsMap) -> bool {
    ffi_value!("ss_map_is_refcounted", false, {
        // SAFETY: NULL or a live handle.
        matches!(unsafe { map.as_ref() }.map(|m| &m.mapping), Some(Mapping::Refcounted(_)))
    })
}

/// Adds one to a refcounted segment's shared count.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_map_incref(map: *const SsMap) -> ss_status {
    ffi_status!("ss_map_incref", {
        // SAFETY: NULL or a live handle.
        unsafe { handle(map, "map") }?.refcounted()?.incref()
    })
}

/// Subtracts one from a refcounted segment's shared count; `*out_now_zero`
/// (may be NULL) tells whether it reached 0. The name is not removed here.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile);
/// `out_now_zero` is NULL or points to a writable `bool`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_decref(map: *const SsMap, out_now_zero: *mut bool) -> ss_status {
    ffi_status!("ss_map_decref", {
        // SAFETY: NULL or a live handle.
        let zero = unsafe { handle(map, "map") }?.refcounted()?.decref()?;
        if !out_now_zero.is_null() {
            // SAFETY: non-NULL out-parameter given by the caller.
            unsafe { write_out(out_now_zero, zero) };
        }
        Ok(())
    })
}

/// Reads a refcounted segment's shared count.
///
/// # Safety
/// `map` is NULL or a live `ss_map` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_map_refcount(map: *const SsMap, out: *mut i32) -> ss_status {
    ffi_status!("ss_map_refcount", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let n = unsafe { handle(map, "map") }?.refcounted()?.refcount()?;
        // SAFETY: checked above.
        unsafe { write_out(out, n) };
        Ok(())
    })
}

/// Unmaps, closes a kept descriptor and removes the name where ATen would
/// (plain SHAREDMEM without FROMFD/UNLINK; refcounted when the count
/// reaches 0). The handle stays valid (data NULL) until `ss_map_free`.
/// Closing twice is allowed and does nothing.
///
/// # Safety
/// `map` is NULL or a live `ss_map` that no other thread is using. No thread
/// may access the mapped bytes during the call or after it.
#[no_mangle]
pub unsafe extern "C" fn ss_map_close(map: *mut SsMap) -> ss_status {
    ffi_status!("ss_map_close", {
        // SAFETY: NULL or a live handle used by no one else.
        unsafe { handle_mut(map, "map") }?.close()
    })
}

/// Closes (if still open) and frees the handle. NULL is a no-op.
///
/// # Safety
/// `map` is NULL or a live `ss_map` that no other thread is using; neither it
/// nor its mapped bytes may be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_map_free(map: *mut SsMap) {
    ffi_value!("ss_map_free", (), {
        // SAFETY: NULL or a handle from this library, not used after this call.
        unsafe { free_handle(map) }
    })
}

/// The live map whose data holds `ptr` (its start or any byte inside), or
/// NULL: ATen's `fromDataPtr`. The handle is borrowed, hence `const`: read
/// it with the accessors; never pass it to `ss_map_free` or `ss_map_close`.
///
/// # Safety
/// Any `ptr` is allowed (it is only looked up, never read). The handle
/// returned is borrowed: valid until its owner frees it.
#[no_mangle]
pub unsafe extern "C" fn ss_map_lookup(ptr: *const c_void) -> *const SsMap {
    ffi_value!("ss_map_lookup", std::ptr::null(), {
        if ptr.is_null() {
            return std::ptr::null();
        }
        registry::lookup(ptr as usize).map_or(std::ptr::null(), |t| t as *const SsMap)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::flags;

    #[test]
    fn c_constants_match_core() {
        assert_eq!(
            [SS_MAPPED_SHARED, SS_MAPPED_SHAREDMEM, SS_MAPPED_EXCLUSIVE, SS_MAPPED_NOCREATE],
            [flags::SHARED, flags::SHAREDMEM, flags::EXCLUSIVE, flags::NOCREATE]
        );
        assert_eq!([SS_MAPPED_KEEPFD, SS_MAPPED_FROMFD, SS_MAPPED_UNLINK], [flags::KEEPFD, flags::FROMFD, flags::UNLINK]);
        assert_eq!(SS_REFCOUNT_HEADER_SIZE, crate::shm::HEADER_SIZE);
    }
}
