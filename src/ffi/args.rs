//! Checks on what C callers pass: NULL pointers, strings, out-parameters.

use crate::error::{Error, ErrorKind, Result};
use std::ffi::CStr;
use std::os::raw::c_char;

/// A NUL-terminated UTF-8 string argument called `what`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that outlives `'a`.
pub unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: per the contract above.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("{what} is not valid UTF-8")))
}

/// A reference to a handle argument called `what`.
///
/// # Safety
/// `p` is NULL or a live handle created by this library.
pub unsafe fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    // SAFETY: per the contract above.
    unsafe { p.as_ref() }.ok_or_else(|| null(what))
}

/// A mutable reference to a handle argument called `what`.
///
/// # Safety
/// `p` is NULL or a live handle created by this library, used by no one else.
pub unsafe fn handle_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: per the contract above.
    unsafe { p.as_mut() }.ok_or_else(|| null(what))
}

/// Checks that an out-parameter is not NULL before any work is done.
pub fn out_arg<T>(p: *mut T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(null(what));
    }
    Ok(())
}

/// Writes `value` to a checked out-parameter.
///
/// # Safety
/// `p` passed [`out_arg`] and points to writable memory for a `T`.
pub unsafe fn write_out<T>(p: *mut T, value: T) {
    // SAFETY: per the contract above; `write` skips dropping old contents.
    unsafe { p.write(value) };
}

/// Copies `text` plus a NUL into `buf` of `len` bytes.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes.
pub unsafe fn copy_c_string(text: &str, buf: *mut c_char, len: usize, what: &str) -> Result<()> {
    if buf.is_null() {
        return Err(null(what));
    }
    c_string_fits(text, len, what)?;
    // SAFETY: checked above that len > text.len().
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast(), text.len());
        buf.add(text.len()).write(0);
    }
    Ok(())
}

/// Checks that `text` plus a NUL fits in `len` bytes (lets a function with
/// several string out-parameters check them all before writing any).
pub fn c_string_fits(text: &str, len: usize, what: &str) -> Result<()> {
    if text.len() + 1 > len {
        return Err(Error::new(ErrorKind::BufferTooSmall, format!("{what} needs {} bytes (with the NUL) but has {len}", text.len() + 1)));
    }
    Ok(())
}

/// Drops a handle made with `Box::into_raw`; NULL is a no-op (every
/// `ss_<thing>_free`).
///
/// # Safety
/// `p` is NULL or a handle from this library, not used after this call.
pub unsafe fn free_handle<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: per the contract above.
        drop(unsafe { Box::from_raw(p) });
    }
}

pub fn null(what: &str) -> Error {
    Error::new(ErrorKind::NullPointer, format!("{what} is NULL"))
}
