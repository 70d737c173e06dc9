//! C API of the key-value stores: `ss_store`.

use super::args::{free_handle, handle, out_arg, str_arg, write_out};
use super::status::ss_status;
use crate::error::{Error, ErrorKind, Result};
use crate::store::show_key;
use crate::store::{FileStore, StoreRef, TcpStore, Timeout, TorchFileStore};
use std::ffi::{c_void, CStr};
use std::os::raw::c_char;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::Duration;

/// A reference to a key-value store (c10d's "Store"), the medium of a
/// symmetric-memory rendezvous. Each handle is one reference:
/// `ss_store_free` drops it, and whoever else took a reference (a group,
/// `ss_store_ref`) keeps the store alive.
///
/// Thread safety: a `const ss_store*` may be used from several threads at
/// once; every operation may run concurrently with the others, each caller
/// gets the answer to its own request, and the calls one thread makes
/// take effect in the order it made them (a `get` after a `set` of the
/// same key returns that value or a later one).
///
/// Fork: a child made by fork() may go on using a TCPStore handle it
/// inherited: its first call opens the child's own connection (validated
/// as any new client), and it never reads a reply meant for its parent.
/// A master's server keeps running in the parent only; freeing the handle
/// in the child leaves it alone. A file store handle needs nothing of the
/// kind, and a host-callback store is as fork-safe as its callbacks.
///
/// Keys: a key is any bytes but NUL (a C string carries it), UTF-8 or not,
/// as PyTorch's stores allow.
pub struct SsStore {
    store: StoreRef,
}

/// The store behind a handle, as a new shared reference (what a symmetric
/// memory group keeps).
///
/// # Safety
/// `p` is NULL or a live `ss_store` handle.
pub unsafe fn store_ref(p: *const SsStore) -> Result<StoreRef> {
    // SAFETY: per the contract above.
    Ok(unsafe { handle(p, "store") }?.store.clone())
}

/// Hands a new handle to `store` out through `out` (checked by the caller).
///
/// # Safety
/// `out` passed `out_arg` and is writable for one pointer.
pub unsafe fn write_store(out: *mut *mut SsStore, store: StoreRef) {
    // SAFETY: per the contract above.
    unsafe { write_out(out, Box::into_raw(Box::new(SsStore { store }))) };
}

/// A `timeout_ms` argument: 0 waits forever, negative is invalid.
pub fn timeout_arg(timeout_ms: i64) -> Result<Timeout> {
    match timeout_ms {
        0 => Ok(None),
        t if t < 0 => Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("timeout_ms is {t}: must be 0 (wait forever) or a positive number of milliseconds"),
        )),
        t => Ok(Some(Duration::from_millis(t as u64))),
    }
}

/// A key argument: the bytes of a NUL-terminated string, UTF-8 or not.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that outlives `'a`.
unsafe fn key_arg<'a>(p: *const c_char, what: &str) -> Result<&'a [u8]> {
    if p.is_null() {
        return Err(super::args::null(what));
    }
    // SAFETY: per the contract above.
    Ok(unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// Reads `n` bytes at `p` (NULL allowed when `n` is 0).
///
/// # Safety
/// `p` is NULL or readable for `n` bytes.
unsafe fn bytes_arg<'a>(p: *const c_void, n: usize, what: &str) -> Result<&'a [u8]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(super::args::null(what));
    }
    // SAFETY: per the contract above.
    Ok(unsafe { std::slice::from_raw_parts(p.cast(), n) })
}

/// Opens the store in folder `path` (created with its parents if missing),
/// shared by the processes of one host that open the same path. Each key
/// is a file written atomically (temporary file + rename), so a process
/// killed mid-write never leaves half a value; `add` runs under `flock`.
/// A path that is an existing regular file: `SS_ERR_INVALID_ARGUMENT`.
/// Waits share one inotify watch per store and poll when inotify or
/// descriptors run out; a FIFO or device at a key's path is
/// `SS_ERR_CORRUPT`, never a hang.
/// Keys left by an earlier job stay: use a fresh folder per job.
/// The lock file `<path>/.lock` is created mode 0600; one that another user
/// owns, a link or a non-regular file there is `SS_ERR_PERMISSION` (or
/// `SS_ERR_CORRUPT`). A write waits for the lock at most 300 s, then
/// returns `SS_ERR_TIMEOUT`.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_store*`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_file_open(path: *const c_char, out: *mut *mut SsStore) -> ss_status {
    ffi_status!("ss_store_file_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a NUL-terminated string.
        let path = unsafe { str_arg(path, "path") }?;
        let store: StoreRef = Arc::new(FileStore::open(path)?);
        // SAFETY: checked above.
        unsafe { write_store(out, store) };
        Ok(())
    })
}

/// As [`ss_store_file_open`], with the longest a write (`set`, `add`,
/// `compare_set`, `delete`) waits for the folder's lock: `timeout_ms`
/// milliseconds, then `SS_ERR_TIMEOUT` naming the lock (0: as long as the
/// holder keeps it; negative: `SS_ERR_INVALID_ARGUMENT`). A lock is held
/// for one write at a time, so a wait longer than a few milliseconds means
/// a holder is stuck; `ss_store_file_open` waits 300 s.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_store*`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_file_open_with_lock_timeout(path: *const c_char, timeout_ms: i64, out: *mut *mut SsStore) -> ss_status {
    ffi_status!("ss_store_file_open_with_lock_timeout", {
        out_arg(out, "out")?;
        let lock_timeout = timeout_arg(timeout_ms)?;
        // SAFETY: NULL or a NUL-terminated string.
        let path = unsafe { str_arg(path, "path") }?;
        let store: StoreRef = Arc::new(FileStore::open_with_lock_timeout(path, lock_timeout)?);
        // SAFETY: checked above.
        unsafe { write_store(out, store) };
        Ok(())
    })
}

/// Opens (creating if missing) the file `path` in PyTorch's own FileStore
/// format, as `torch.distributed.FileStore(path, world_size)`: ranks using
/// PyTorch's FileStore (or `init_process_group` with `file://path`) and
/// ranks using this store see each other's keys, both ways. The store
/// counts itself in the file's `refcount/` key; when it closes, it counts
/// itself out, and the last store to close removes the file once
/// `world_size` stores have closed (`world_size` -1: never removed).
/// `timeout_ms` (0: forever) bounds each wait for the file's lock. Waits
/// poll the file (at most 10 ms apart). `num_keys` counts PyTorch's
/// bookkeeping keys `refcount/` and `cleanup/` too, as PyTorch's does.
/// Errors: a folder at `path` or `world_size` < -1
/// `SS_ERR_INVALID_ARGUMENT`; a file that is not a valid FileStore log
/// (or was cut by a writer killed mid-record) `SS_ERR_CORRUPT`, naming the
/// offset of the bad record. A FIFO, device, symbolic link or another
/// user's file at `path` is `SS_ERR_PERMISSION` at once (never followed,
/// never a hang), here and in every later call.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` is NULL or writable for
/// one pointer.
#[no_mangle]
pub unsafe extern "C" fn ss_store_torch_file_open(
    path: *const c_char,
    world_size: c_int,
    timeout_ms: i64,
    out: *mut *mut SsStore,
) -> ss_status {
    ffi_status!("ss_store_torch_file_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a NUL-terminated string.
        let path = unsafe { str_arg(path, "path") }?;
        let timeout = timeout_arg(timeout_ms)?;
        let store: StoreRef = Arc::new(TorchFileStore::open(path, i64::from(world_size), timeout)?);
        // SAFETY: checked above.
        unsafe { write_store(out, store) };
        Ok(())
    })
}

/// Joins (or, with `is_master`, serves) a PyTorch c10d `TCPStore` at
/// `host:port`, speaking its wire protocol: the client sees the keys of
/// `torch.distributed` ranks of the same job (PyTorch's `/` key prefix is
/// added), and PyTorch clients can use our server. As
/// `TCPStore(host, port, world_size, is_master, timeout)`: the master
/// listens on `host:port` (port 0: a free port, see `ss_store_tcp_port`);
/// with `world_size` > 0 every rank adds itself to the `init/` counter and
/// the master returns once `world_size` ranks joined. `timeout_ms` (0:
/// forever) bounds connecting (a client retries while nobody listens),
/// the join and every reply. Errors name `host:port`: port in use
/// `SS_ERR_BUSY`, no server in time `SS_ERR_TIMEOUT`, server gone
/// `SS_ERR_PEER_GONE`, bad reply `SS_ERR_PROTOCOL`.
///
/// # Safety
/// `host` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_store*`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_tcp_open(
    host: *const c_char,
    port: c_int,
    is_master: bool,
    world_size: c_int,
    timeout_ms: i64,
    out: *mut *mut SsStore,
) -> ss_status {
    ffi_status!("ss_store_tcp_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a NUL-terminated string.
        let host = unsafe { str_arg(host, "host") }?;
        let port = u16::try_from(port).map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("port is {port}: must be 0..65535")))?;
        if port == 0 && !is_master {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("port 0 needs is_master (a client must name the server's port on {host})"),
            ));
        }
        let world = u32::try_from(world_size).map_err(|_| {
            Error::new(ErrorKind::InvalidArgument, format!("world_size is {world_size}: must be >= 0 (0: do not wait for ranks)"))
        })?;
        let store: StoreRef = Arc::new(TcpStore::open(host, port, is_master, world, timeout_arg(timeout_ms)?)?);
        // SAFETY: checked above.
        unsafe { write_store(out, store) };
        Ok(())
    })
}

/// The TCP port of a TCPStore (the one its server picked when opened with
/// port 0). Another kind of store: `SS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `out_port` is NULL or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_tcp_port(s: *const SsStore, out_port: *mut c_int) -> ss_status {
    ffi_status!("ss_store_tcp_port", {
        out_arg(out_port, "out_port")?;
        // SAFETY: NULL or a live handle.
        let store = unsafe { handle(s, "store") }?;
        let port = store
            .store
            .tcp_port()
            .ok_or_else(|| Error::new(ErrorKind::Unsupported, format!("{} is not a TCPStore: it has no port", store.store.describe())))?;
        // SAFETY: checked above.
        unsafe { write_out(out_port, c_int::from(port)) };
        Ok(())
    })
}

/// A second reference to the same store (free both).
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `ss_store*`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_ref(s: *const SsStore, out: *mut *mut SsStore) -> ss_status {
    ffi_status!("ss_store_ref", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let store = unsafe { store_ref(s) }?;
        // SAFETY: checked above.
        unsafe { write_store(out, store) };
        Ok(())
    })
}

/// Sets `key` to the `len` bytes at `value` (NULL allowed when `len` is 0),
/// replacing an earlier value and waking its waiters.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `key` is NULL or a NUL-terminated string; `value` is NULL or readable for
/// `len` bytes, not written by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn ss_store_set(s: *const SsStore, key: *const c_char, value: *const c_void, len: usize) -> ss_status {
    ffi_status!("ss_store_set", {
        // SAFETY: NULL or a live handle / a NUL-terminated string / readable bytes.
        let store = unsafe { handle(s, "store") }?;
        let key = unsafe { key_arg(key, "key") }?;
        let value = unsafe { bytes_arg(value, len, "value") }?;
        store.store.set(key, value)
    })
}

/// Waits until `key` is set (`timeout_ms` 0 waits forever; expiry is
/// `SS_ERR_TIMEOUT` naming the key) and copies its value into `buf` of
/// `buf_len` bytes, its length to `out_len`. A value longer than `buf_len`:
/// `SS_ERR_BUFFER_TOO_SMALL`, with the needed length written to `out_len`
/// (call again with a larger buffer; `buf` may be NULL when `buf_len` is 0).
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `key` is NULL or a NUL-terminated string; `buf` is NULL or writable for
/// `buf_len` bytes, which no other thread accesses during the call; `out_len`
/// is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_get(
    s: *const SsStore,
    key: *const c_char,
    timeout_ms: i64,
    buf: *mut c_void,
    buf_len: usize,
    out_len: *mut usize,
) -> ss_status {
    ffi_status!("ss_store_get", {
        out_arg(out_len, "out_len")?;
        if buf.is_null() && buf_len > 0 {
            return Err(super::args::null("buf"));
        }
        // SAFETY: NULL or a live handle / a NUL-terminated string.
        let store = unsafe { handle(s, "store") }?;
        let key = unsafe { key_arg(key, "key") }?;
        let timeout = timeout_arg(timeout_ms)?;
        let value = store.store.get(key, timeout)?;
        // SAFETY: checked above.
        unsafe { copy_value_out(key, &value, buf, buf_len, out_len) }
    })
}

/// Writes `value`'s length to `out_len` and copies it into `buf`, or says
/// `SS_ERR_BUFFER_TOO_SMALL` (the length written all the same).
///
/// # Safety
/// `out_len` passed `out_arg`; `buf` is writable for `buf_len` bytes and
/// non-NULL when `buf_len` > 0.
unsafe fn copy_value_out(key: &[u8], value: &[u8], buf: *mut c_void, buf_len: usize, out_len: *mut usize) -> Result<()> {
    // SAFETY: per the contract above.
    unsafe { write_out(out_len, value.len()) };
    if value.len() > buf_len {
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!("value of key {} is {} bytes but buf_len is {buf_len}", show_key(key), value.len()),
        ));
    }
    // SAFETY: buf is writable for buf_len >= value.len() bytes (non-NULL when value is non-empty).
    unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), buf.cast::<u8>(), value.len()) };
    Ok(())
}

/// Adds `delta` to the integer under `key` (missing counts as 0; stored as
/// decimal text, as c10d does) and writes the new value to `out_value`.
/// Every store wraps in two's complement past either end of `int64_t`
/// (`INT64_MAX + 1` gives `INT64_MIN`), as PyTorch's TCPStore servers do.
/// A key holding something else: `SS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `key` is NULL or a NUL-terminated string; `out_value` is NULL or points to
/// a writable `int64_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_add(s: *const SsStore, key: *const c_char, delta: i64, out_value: *mut i64) -> ss_status {
    ffi_status!("ss_store_add", {
        out_arg(out_value, "out_value")?;
        // SAFETY: NULL or a live handle / a NUL-terminated string.
        let store = unsafe { handle(s, "store") }?;
        let key = unsafe { key_arg(key, "key") }?;
        let v = store.store.add(key, delta)?;
        // SAFETY: checked above.
        unsafe { write_out(out_value, v) };
        Ok(())
    })
}

/// Waits until all `nkeys` keys are set (`timeout_ms` 0 waits forever;
/// expiry is `SS_ERR_TIMEOUT` naming the keys still missing).
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `keys` is NULL or readable for `nkeys` pointers, each NULL or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ss_store_wait(s: *const SsStore, keys: *const *const c_char, nkeys: usize, timeout_ms: i64) -> ss_status {
    ffi_status!("ss_store_wait", {
        // SAFETY: NULL or a live handle / readable key pointers.
        let store = unsafe { handle(s, "store") }?;
        let list = unsafe { keys_arg(keys, nkeys) }?;
        let timeout = timeout_arg(timeout_ms)?;
        store.store.wait(&list, timeout)
    })
}

/// The `nkeys` strings at `keys` (NULL allowed when `nkeys` is 0).
///
/// # Safety
/// `keys` is NULL or readable for `nkeys` pointers, each NULL or a string.
unsafe fn keys_arg<'a>(keys: *const *const c_char, nkeys: usize) -> Result<Vec<&'a [u8]>> {
    if keys.is_null() && nkeys > 0 {
        return Err(super::args::null("keys"));
    }
    let mut list = Vec::with_capacity(nkeys);
    for i in 0..nkeys {
        // SAFETY: per the contract above.
        list.push(unsafe { key_arg(*keys.add(i), &format!("keys[{i}]")) }?);
    }
    Ok(list)
}

/// Writes to `out_all_set` whether all `nkeys` keys are set now (no
/// waiting; no keys: true). A host-callback store: `SS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `keys` is NULL or readable for `nkeys` pointers, each NULL or a
/// NUL-terminated string; `out_all_set` is NULL or points to a writable
/// `bool`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_check(s: *const SsStore, keys: *const *const c_char, nkeys: usize, out_all_set: *mut bool) -> ss_status {
    ffi_status!("ss_store_check", {
        out_arg(out_all_set, "out_all_set")?;
        // SAFETY: NULL or a live handle / readable key pointers.
        let store = unsafe { handle(s, "store") }?;
        let list = unsafe { keys_arg(keys, nkeys) }?;
        let all = store.store.check(&list)?;
        // SAFETY: checked above.
        unsafe { write_out(out_all_set, all) };
        Ok(())
    })
}

/// c10d's compare-and-set, atomic against every other writer: when `key`
/// holds the `expected_len` bytes at `expected` (or is missing and
/// `expected_len` is 0) it becomes the `desired_len` bytes at `desired`.
/// The answer (`desired` after a swap, else the current value, or
/// `expected` when the key is missing) is copied into `buf` as by
/// `ss_store_get`. On `SS_ERR_BUFFER_TOO_SMALL` the swap has happened all
/// the same; calling again with a larger buffer gives the same answer
/// without changing anything (unless another process wrote meanwhile).
/// A host-callback store: `SS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `key` is NULL or a NUL-terminated string; `expected` and `desired` are
/// NULL or readable for `expected_len` and `desired_len` bytes, not written
/// during the call; `buf` is NULL or writable for `buf_len` bytes, which no
/// other thread accesses during the call; `out_len` is NULL or points to a
/// writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_compare_set(
    s: *const SsStore,
    key: *const c_char,
    expected: *const c_void,
    expected_len: usize,
    desired: *const c_void,
    desired_len: usize,
    buf: *mut c_void,
    buf_len: usize,
    out_len: *mut usize,
) -> ss_status {
    ffi_status!("ss_store_compare_set", {
        out_arg(out_len, "out_len")?;
        if buf.is_null() && buf_len > 0 {
            return Err(super::args::null("buf"));
        }
        // SAFETY: NULL or a live handle / a string / readable bytes.
        let store = unsafe { handle(s, "store") }?;
        let key = unsafe { key_arg(key, "key") }?;
        let expected = unsafe { bytes_arg(expected, expected_len, "expected") }?;
        let desired = unsafe { bytes_arg(desired, desired_len, "desired") }?;
        let answer = store.store.compare_set(key, expected, desired)?;
        // SAFETY: checked above.
        unsafe { copy_value_out(key, &answer, buf, buf_len, out_len) }
    })
}

/// Deletes `key`; writes to `out_existed` whether it was set (NULL: not
/// wanted). A host-callback store: `SS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `key` is NULL or a NUL-terminated string; `out_existed` is NULL or points
/// to a writable `bool`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_delete_key(s: *const SsStore, key: *const c_char, out_existed: *mut bool) -> ss_status {
    ffi_status!("ss_store_delete_key", {
        // SAFETY: NULL or a live handle / a NUL-terminated string.
        let store = unsafe { handle(s, "store") }?;
        let key = unsafe { key_arg(key, "key") }?;
        let existed = store.store.delete_key(key)?;
        if !out_existed.is_null() {
            // SAFETY: non-NULL, the caller's pointer to one bool.
            unsafe { write_out(out_existed, existed) };
        }
        Ok(())
    })
}

/// Writes the number of keys set to `out_count` (a TCPStore counts its
/// join counter `init/` too, as PyTorch's does). A host-callback store:
/// `SS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `s` is NULL or a live `ss_store` (other threads may use it meanwhile);
/// `out_count` is NULL or points to a writable `int64_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_store_num_keys(s: *const SsStore, out_count: *mut i64) -> ss_status {
    ffi_status!("ss_store_num_keys", {
        out_arg(out_count, "out_count")?;
        // SAFETY: NULL or a live handle.
        let store = unsafe { handle(s, "store") }?;
        let n = store.store.num_keys()?;
        // SAFETY: checked above.
        unsafe { write_out(out_count, n) };
        Ok(())
    })
}

/// Drops this reference; the store closes with its last one. NULL is a
/// no-op.
///
/// # Safety
/// `s` is NULL or a live `ss_store` that no other thread is using; it must
/// not be used after the call (other references to the store stay valid).
#[no_mangle]
pub unsafe extern "C" fn ss_store_free(s: *mut SsStore) {
    ffi_value!("ss_store_free", (), {
        // SAFETY: NULL or a handle of this library, not used afterwards.
        unsafe { free_handle(s) }
    })
}
