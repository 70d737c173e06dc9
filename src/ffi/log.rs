//! C API of the log hook: where the library's own messages go.

use crate::log::{self, Level};
use std::ffi::{c_void, CString};
use std::os::raw::{c_char, c_int};
use std::sync::Arc;

/// Level of a warning: something the host should act on (say, CUDA memory
/// that consumer processes still hold when the producer exits).
pub const SS_LOG_WARNING: c_int = 1;
/// Level of an informational message (the manager daemon's log, when on).
pub const SS_LOG_INFO: c_int = 2;

/// Receives one message of the library: its level (`SS_LOG_WARNING`,
/// `SS_LOG_INFO`), the text (NUL-terminated, valid only during the call, no
/// trailing newline) and the `user_data` given to `ss_log_set_callback`.
pub type ss_log_fn = Option<unsafe extern "C" fn(level: c_int, message: *const c_char, user_data: *mut c_void)>;

/// The callback and its `user_data`, as given by the host.
struct HostSink {
    callback: unsafe extern "C" fn(c_int, *const c_char, *mut c_void),
    user_data: *mut c_void,
}

// SAFETY: `ss_log_set_callback` requires a callback that may be called from
// any thread with this `user_data`.
unsafe impl Send for HostSink {}
// SAFETY: as above; the sink only passes `user_data` back to the callback.
unsafe impl Sync for HostSink {}

impl HostSink {
    fn call(&self, level: Level, message: &str) {
        let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the host promised a callback that accepts these arguments
        // from any thread; `text` lives until the call returns.
        unsafe { (self.callback)(level as c_int, text.as_ptr(), self.user_data) }
    }
}

/// Sends the library's messages (warnings, and the manager daemon's log)
/// to `cb` instead of stderr. By default, and after a call with `cb` NULL,
/// they go to stderr. To silence them, install a callback that does nothing.
/// Applies to the whole process; the last call wins.
///
/// # Safety
/// `cb` is NULL or a function that may be called from any thread, at any
/// time until it is replaced (also during process exit), with `user_data`;
/// it must not unwind and must not call into this library. `user_data` must
/// stay valid for as long as `cb` is installed.
#[no_mangle]
pub unsafe extern "C" fn ss_log_set_callback(cb: ss_log_fn, user_data: *mut c_void) {
    ffi_value!("ss_log_set_callback", (), {
        log::set_sink(cb.map(|callback| {
            let sink = HostSink { callback, user_data };
            Arc::new(move |level: Level, message: &str| sink.call(level, message)) as log::Sink
        }));
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_levels_match_core() {
        assert_eq!([SS_LOG_WARNING, SS_LOG_INFO], [Level::Warning as c_int, Level::Info as c_int]);
    }
}
