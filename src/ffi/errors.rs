//! C API of the error model and the library version.

use super::guard::last_error_ptr;
use super::status::ss_status;
use std::os::raw::{c_char, c_int};

/// The detail of the last failure on the calling thread ("" if none yet):
/// what was being done, the name and size involved, the OS error. Valid
/// until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn ss_last_error_message() -> *const c_char {
    ffi_value!("ss_last_error_message", c"".as_ptr(), { last_error_ptr() })
}

/// A fixed text for a status code ("unknown status" for values that are
/// not codes).
#[no_mangle]
pub extern "C" fn ss_status_str(code: c_int) -> *const c_char {
    ffi_value!("ss_status_str", c"unknown status".as_ptr(), {
        // Taken as an int: a C caller may pass any value.
        ss_status::from_raw(code).map_or(c"unknown status".as_ptr(), |s| s.text().as_ptr())
    })
}

/// The library's version, "MAJOR.MINOR.PATCH".
#[no_mangle]
pub extern "C" fn ss_version() -> *const c_char {
    ffi_value!("ss_version", c"".as_ptr(), { concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast() })
}
