//! `ss_store_callbacks_open`: a store the host framework provides (say, a
//! C++ framework's own c10d store) through a table of C functions.

use super::args::out_arg;
use super::status::ss_status;
use super::store::{write_store, SsStore};
use crate::error::{Error, ErrorKind, Result};
use crate::store::deadline::timeout_error;
use crate::store::{show_key, Store, StoreRef, Timeout};
use std::ffi::{c_void, CString};
use std::os::raw::{c_char, c_int};
use std::sync::Arc;

/// Sets `key` to the `len` bytes at `value`. Returns an `ss_status` code
/// (`SS_OK` = 0).
pub type ss_store_set_fn = Option<unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, value: *const c_void, len: usize) -> c_int>;

/// Waits for `key` (`timeout_ms` 0: forever; expiry returns
/// `SS_ERR_TIMEOUT`), writes the value's length to `*out_len` and, when it
/// fits in `buf_len`, the value to `buf`. A longer value: write its length,
/// return `SS_ERR_BUFFER_TOO_SMALL`, and the library calls again with a
/// buffer of that size. `buf` may be NULL when `buf_len` is 0.
pub type ss_store_get_fn = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        key: *const c_char,
        timeout_ms: i64,
        buf: *mut c_void,
        buf_len: usize,
        out_len: *mut usize,
    ) -> c_int,
>;

/// Adds `delta` to the integer under `key` (missing = 0, stored as
/// decimal text as c10d does) and writes the new value to `*out_value`.
pub type ss_store_add_fn = Option<unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, delta: i64, out_value: *mut i64) -> c_int>;

/// Waits until all `nkeys` keys are set (`timeout_ms` 0: forever; expiry
/// returns `SS_ERR_TIMEOUT`).
pub type ss_store_wait_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, keys: *const *const c_char, nkeys: usize, timeout_ms: i64) -> c_int>;

/// Releases `ctx`: called once, when the store's last reference goes.
pub type ss_store_free_ctx_fn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// The functions of a host-provided store. `set`, `get`, `add` and `wait`
/// are required, `free_ctx` may be NULL. Keys come as NUL-terminated byte
/// strings, not necessarily UTF-8. They may be called from several
/// threads at once (a rendezvous runs on the caller's thread, a group may
/// live on others), must not unwind (no C++ exception may escape them),
/// and report failures as `ss_status` codes; the library adds the keys to
/// the message. Start from `SS_STORE_CALLBACKS_INIT`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SsStoreCallbacks {
    /// `sizeof(ss_store_callbacks)` as the caller was built (set by
    /// `SS_STORE_CALLBACKS_INIT`): 0 is refused (`SS_ERR_INVALID_ARGUMENT`),
    /// a size larger than this library knows is `SS_ERR_UNSUPPORTED`;
    /// functions past an older, smaller size are absent.
    pub struct_size: usize,
    pub set: ss_store_set_fn,
    pub get: ss_store_get_fn,
    pub add: ss_store_add_fn,
    pub wait: ss_store_wait_fn,
    pub free_ctx: ss_store_free_ctx_fn,
}

type SetFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_void, usize) -> c_int;
type GetFn = unsafe extern "C" fn(*mut c_void, *const c_char, i64, *mut c_void, usize, *mut usize) -> c_int;
type AddFn = unsafe extern "C" fn(*mut c_void, *const c_char, i64, *mut i64) -> c_int;
type WaitFn = unsafe extern "C" fn(*mut c_void, *const *const c_char, usize, i64) -> c_int;

/// The checked table plus the host's context.
struct CallbackStore {
    set: SetFn,
    get: GetFn,
    add: AddFn,
    wait: WaitFn,
    free_ctx: ss_store_free_ctx_fn,
    ctx: *mut c_void,
}

// SAFETY: the host promises (see SsStoreCallbacks) that the functions and
// their context may be used from any thread, concurrently.
unsafe impl Send for CallbackStore {}
// SAFETY: as above.
unsafe impl Sync for CallbackStore {}

impl Drop for CallbackStore {
    fn drop(&mut self) {
        if let Some(free) = self.free_ctx {
            // SAFETY: the host's release function, called once with its context.
            unsafe { free(self.ctx) };
        }
    }
}

fn c_key(key: &[u8]) -> Result<CString> {
    CString::new(key).map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("key {} contains a NUL byte", show_key(key))))
}

fn timeout_ms(timeout: Timeout) -> i64 {
    // 0 means forever to the host; a real timeout is at least 1 ms.
    timeout.map_or(0, |t| i64::try_from(t.as_millis()).unwrap_or(i64::MAX).max(1))
}

impl CallbackStore {
    /// Turns a callback's status into a result; `what` says which call.
    fn status(&self, code: c_int, what: impl FnOnce() -> String) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        match ss_status::from_raw(code) {
            Some(s) => {
                let kind = kind_of_status(s);
                let text = s.text().to_string_lossy();
                Err(Error::new(kind, format!("{} failed in {}: {text}", what(), self.describe())))
            }
            None => {
                Err(Error::new(ErrorKind::Io, format!("{} failed in {}: callback returned unknown status {code}", what(), self.describe())))
            }
        }
    }
}

/// The kind behind a status code (inverse of `ss_status::from`).
fn kind_of_status(s: ss_status) -> ErrorKind {
    use ss_status::*;
    match s {
        SS_OK | SS_ERR_IO => ErrorKind::Io,
        SS_ERR_INVALID_ARGUMENT => ErrorKind::InvalidArgument,
        SS_ERR_NULL_POINTER => ErrorKind::NullPointer,
        SS_ERR_NOT_FOUND => ErrorKind::NotFound,
        SS_ERR_ALREADY_EXISTS => ErrorKind::AlreadyExists,
        SS_ERR_NO_SPACE => ErrorKind::NoSpace,
        SS_ERR_PERMISSION => ErrorKind::Permission,
        SS_ERR_SIZE_MISMATCH => ErrorKind::SizeMismatch,
        SS_ERR_UNSUPPORTED => ErrorKind::Unsupported,
        SS_ERR_CUDA_UNAVAILABLE => ErrorKind::CudaUnavailable,
        SS_ERR_CUDA => ErrorKind::CudaError,
        SS_ERR_TIMEOUT => ErrorKind::Timeout,
        SS_ERR_PROTOCOL => ErrorKind::Protocol,
        SS_ERR_PANIC => ErrorKind::Panic,
        SS_ERR_NAME_TOO_LONG => ErrorKind::NameTooLong,
        SS_ERR_BAD_REFCOUNT => ErrorKind::BadRefcount,
        SS_ERR_TOO_MANY_FILES => ErrorKind::TooManyFiles,
        SS_ERR_CLOSED => ErrorKind::Closed,
        SS_ERR_BUFFER_TOO_SMALL => ErrorKind::BufferTooSmall,
        SS_ERR_PEER_GONE => ErrorKind::PeerGone,
        SS_ERR_BUSY => ErrorKind::Busy,
        SS_ERR_CORRUPT => ErrorKind::Corrupt,
    }
}

/// How often `get` asks again when the value keeps growing between calls.
const GET_TRIES: usize = 4;

impl Store for CallbackStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let k = c_key(key)?;
        // SAFETY: the host's function, with a valid string and value bytes.
        let code = unsafe { (self.set)(self.ctx, k.as_ptr(), value.as_ptr().cast(), value.len()) };
        self.status(code, || format!("set of key {}", show_key(key)))
    }

    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        let k = c_key(key)?;
        let mut buf = vec![0u8; 256];
        let ms = timeout_ms(timeout);
        for _ in 0..GET_TRIES {
            let mut len = usize::MAX;
            // SAFETY: the host's function; buf is writable for buf.len() bytes.
            let code = unsafe { (self.get)(self.ctx, k.as_ptr(), ms, buf.as_mut_ptr().cast(), buf.len(), &mut len) };
            let too_small = ss_status::SS_ERR_BUFFER_TOO_SMALL as c_int;
            if (code == 0 || code == too_small) && len != usize::MAX && len > buf.len() {
                if len > crate::store::tcp::protocol::MAX_FIELD as usize {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("get of key {} in {} reported {len} bytes", show_key(key), self.describe()),
                    ));
                }
                buf.resize(len, 0);
                continue;
            }
            if code == ss_status::SS_ERR_TIMEOUT as c_int {
                return Err(timeout_error(timeout, &[key], &self.describe()));
            }
            self.status(code, || format!("get of key {}", show_key(key)))?;
            if len == usize::MAX {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("get of key {} in {} returned no length", show_key(key), self.describe()),
                ));
            }
            buf.truncate(len);
            return Ok(buf);
        }
        Err(Error::new(
            ErrorKind::Protocol,
            format!("get of key {} in {}: the value grew on each of {GET_TRIES} tries", show_key(key), self.describe()),
        ))
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        let k = c_key(key)?;
        let mut v = 0i64;
        // SAFETY: the host's function, with a valid string and out-pointer.
        let code = unsafe { (self.add)(self.ctx, k.as_ptr(), delta, &mut v) };
        self.status(code, || format!("add to key {}", show_key(key)))?;
        Ok(v)
    }

    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        let owned = keys.iter().map(|k| c_key(k)).collect::<Result<Vec<_>>>()?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
        // SAFETY: the host's function, with `ptrs.len()` valid strings.
        let code = unsafe { (self.wait)(self.ctx, ptrs.as_ptr(), ptrs.len(), timeout_ms(timeout)) };
        if code == ss_status::SS_ERR_TIMEOUT as c_int {
            // The host does not say which keys are missing: name them all.
            return Err(timeout_error(timeout, keys, &self.describe()));
        }
        self.status(code, || format!("wait for keys {}", keys.iter().map(|k| show_key(k)).collect::<Vec<_>>().join(", ")))
    }

    fn describe(&self) -> String {
        format!("host store (callbacks, ctx {:p})", self.ctx)
    }
}

/// A store whose operations call the host's functions in `cb` with `ctx`
/// (the table is copied; `ctx` is the host's). `free_ctx(ctx)` runs once,
/// when the last reference goes. A required function missing:
/// `SS_ERR_NULL_POINTER`, a bad `cb->struct_size` as that field says; in
/// both cases `ctx` stays the caller's to release.
///
/// # Safety
/// `cb` is NULL or points to a readable `ss_store_callbacks` whose functions,
/// with `ctx`, keep that type's contract (callable from any thread at once,
/// never unwinding) for as long as the store lives; `out` is NULL or points
/// to a writable `ss_store*`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_callbacks_open(cb: *const SsStoreCallbacks, ctx: *mut c_void, out: *mut *mut SsStore) -> ss_status {
    ffi_status!("ss_store_callbacks_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a readable table.
        let cb = *unsafe { super::args::handle(cb, "cb") }?;
        let size = std::mem::size_of::<SsStoreCallbacks>();
        super::struct_size::check("ss_store_callbacks", cb.struct_size, size, size)?;
        let need = |present: bool, name: &str| if present { Ok(()) } else { Err(super::args::null(&format!("cb->{name}"))) };
        need(cb.set.is_some(), "set")?;
        need(cb.get.is_some(), "get")?;
        need(cb.add.is_some(), "add")?;
        need(cb.wait.is_some(), "wait")?;
        let (Some(set), Some(get), Some(add), Some(wait)) = (cb.set, cb.get, cb.add, cb.wait) else { unreachable!() };
        let store: StoreRef = Arc::new(CallbackStore { set, get, add, wait, free_ctx: cb.free_ctx, ctx });
        // SAFETY: checked above.
        unsafe { write_store(out, store) };
        Ok(())
    })
}
