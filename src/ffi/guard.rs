//! The one mechanism every export runs its body through: panics become
//! `SS_ERR_PANIC`, errors become a status plus the thread's last message.
//! `tests/api/exports_run_through_the_guard.rs` checks mechanically that every export uses it.

use super::status::ss_status;
use crate::error::{Error, ErrorKind, Result};
use std::cell::RefCell;
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `e` as this thread's last error.
pub fn set_last_error(e: &Error) {
    let text = CString::new(e.message().replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = text);
}

/// Pointer to this thread's last error text, valid until the next failing
/// call on this thread.
pub fn last_error_ptr() -> *const libc::c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

fn panic_error(payload: Box<dyn std::any::Any + Send>, func: &str) -> Error {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    Error::new(ErrorKind::Panic, format!("internal panic in {func}: {what}"))
}

/// Runs a fallible body; used by `ffi_status!`.
pub fn run_status(func: &str, body: impl FnOnce() -> Result<()>) -> ss_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ss_status::SS_OK,
        Ok(Err(e)) => {
            set_last_error(&e);
            e.kind().into()
        }
        Err(p) => {
            set_last_error(&panic_error(p, func));
            ss_status::SS_ERR_PANIC
        }
    }
}

/// Runs an infallible body that returns a value, `fallback` on panic; used
/// by `ffi_value!`.
pub fn run_value<T>(func: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(p) => {
            set_last_error(&panic_error(p, func));
            fallback
        }
    }
}

/// Body of an export that returns `ss_status`; the block yields `Result<()>`.
macro_rules! ffi_status {
    ($func:literal, $body:block) => {
        $crate::ffi::guard::run_status($func, || $body)
    };
}

/// Body of an export that returns a plain value; `$fallback` on panic.
macro_rules! ffi_value {
    ($func:literal, $fallback:expr, $body:block) => {
        $crate::ffi::guard::run_value($func, $fallback, || $body)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_becomes_status_and_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let status = run_status("ss_test_fn", || panic!("boom {}", 7));
        let value = run_value("ss_test_value", 42, || -> i32 { panic!("static boom") });
        std::panic::set_hook(prev);
        assert_eq!(status, ss_status::SS_ERR_PANIC);
        assert_eq!(value, 42);
        // SAFETY: the pointer is this thread's NUL-terminated last error.
        let msg = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }.to_str().unwrap();
        assert_eq!(msg, "internal panic in ss_test_value: static boom");
    }

    #[test]
    fn error_sets_message_and_status() {
        let status = run_status("ss_test_fn", || Err(Error::new(ErrorKind::NoSpace, "full </x>")));
        assert_eq!(status, ss_status::SS_ERR_NO_SPACE);
        // SAFETY: as above.
        assert_eq!(unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }.to_str().unwrap(), "full </x>");
    }
}
