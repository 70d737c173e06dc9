//! C API of the content store: hashing, `ss_content_writer`,
//! `ss_content_reader`, and what a reader hands out (`ss_content_tensor`,
//! `ss_content_storage`, `ss_content_list`).

use super::args::{c_string_fits, copy_c_string, free_handle, handle, out_arg, str_arg, write_out};
use super::status::ss_status;
use crate::content_store::{self, Dtype, Format, HashMode, Reader, StorageBytes, Tensor, Writer};
use crate::error::{Error, ErrorKind, Result};
use std::ffi::{c_void, CString};
use std::os::raw::{c_char, c_int};
use std::path::Path;
use std::sync::Arc;

/// Fast hash: XXH3-128 tree of 1 MiB chunks, 32 hex characters (the
/// native format's names; definition in the README).
pub const SS_HASH_FAST: c_int = 0;
/// Stable hash: SHA-1, 40 hex characters (PyTorch's `stable_hash=True`).
pub const SS_HASH_STABLE: c_int = 1;
/// Longest digest `ss_content_hash_bytes` writes, with its NUL.
pub const SS_HASH_HEX_MAX: usize = 41;
/// This library's format: raw storage bytes, binary tensor records.
pub const SS_CONTENT_FORMAT_NATIVE: c_int = 0;
/// PyTorch's format (`torch.utils._content_store`), SHA-1 names.
pub const SS_CONTENT_FORMAT_TORCH: c_int = 1;

// Element types: c10::ScalarType's values.
pub const SS_DTYPE_UINT8: c_int = 0;
pub const SS_DTYPE_INT8: c_int = 1;
pub const SS_DTYPE_INT16: c_int = 2;
pub const SS_DTYPE_INT32: c_int = 3;
pub const SS_DTYPE_INT64: c_int = 4;
pub const SS_DTYPE_FLOAT16: c_int = 5;
pub const SS_DTYPE_FLOAT32: c_int = 6;
pub const SS_DTYPE_FLOAT64: c_int = 7;
pub const SS_DTYPE_COMPLEX32: c_int = 8;
pub const SS_DTYPE_COMPLEX64: c_int = 9;
pub const SS_DTYPE_COMPLEX128: c_int = 10;
pub const SS_DTYPE_BOOL: c_int = 11;
pub const SS_DTYPE_BFLOAT16: c_int = 15;
pub const SS_DTYPE_FLOAT8_E5M2: c_int = 23;
pub const SS_DTYPE_FLOAT8_E4M3FN: c_int = 24;
pub const SS_DTYPE_UINT16: c_int = 27;
pub const SS_DTYPE_UINT32: c_int = 28;
pub const SS_DTYPE_UINT64: c_int = 29;

/// A writer of a content store.
///
/// Thread safety: a `const ss_content_writer*` may be used from several
/// threads at once; `ss_content_writer_free` needs exclusive access.
pub struct SsContentWriter {
    writer: Writer,
}

/// A reader of a content store.
///
/// Thread safety: a `const ss_content_reader*` may be used from several
/// threads at once; `ss_content_reader_free` needs exclusive access.
/// Tensors and storages it handed out stay valid after it is freed.
pub struct SsContentReader {
    reader: Reader,
}

/// A tensor read from a store: its view and its storage, read-only.
/// Immutable; may be shared between threads.
pub struct SsContentTensor {
    tensor: Tensor,
    hash: CString,
}

/// A storage read from a store, read-only. Immutable.
pub struct SsContentStorage {
    storage: Arc<StorageBytes>,
}

/// A list of strings (tensor names, storage hashes, problems). Immutable.
pub struct SsContentList {
    items: Vec<CString>,
}

/// A byte-slice argument: NULL is allowed only for 0 bytes.
///
/// # Safety
/// `data` is NULL or readable for `nbytes` bytes for `'a`.
unsafe fn bytes_arg<'a>(data: *const c_void, nbytes: usize, what: &str) -> Result<&'a [u8]> {
    if nbytes == 0 {
        return Ok(&[]);
    }
    if data.is_null() {
        return Err(super::args::null(what));
    }
    // SAFETY: per the contract above.
    Ok(unsafe { std::slice::from_raw_parts(data.cast(), nbytes) })
}

/// An `int64_t[ndim]` argument.
///
/// # Safety
/// `p` is NULL or readable for `ndim` elements.
unsafe fn dims_arg<'a>(p: *const i64, ndim: usize, what: &str) -> Result<&'a [i64]> {
    if ndim > content_store::bounds::MAX_NDIM {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("ndim {ndim} is more than {}", content_store::bounds::MAX_NDIM)));
    }
    if ndim == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(super::args::null(what));
    }
    // SAFETY: per the contract above.
    Ok(unsafe { std::slice::from_raw_parts(p, ndim) })
}

fn c_string(s: String) -> CString {
    CString::new(s).unwrap_or_default()
}

/// Writes the lowercase hex digest of `nbytes` bytes at `data` (NULL is
/// allowed for 0 bytes) into `buf` of `buf_len` bytes, NUL-terminated.
/// `mode` is `SS_HASH_FAST` (32 characters) or `SS_HASH_STABLE` (40);
/// `SS_HASH_HEX_MAX` bytes always suffice.
///
/// # Safety
/// `data` is NULL or readable for `nbytes` bytes, not written by another
/// thread during the call; `buf` is NULL or writable for `buf_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ss_content_hash_bytes(
    data: *const c_void,
    nbytes: usize,
    mode: c_int,
    buf: *mut c_char,
    buf_len: usize,
) -> ss_status {
    ffi_status!("ss_content_hash_bytes", {
        let mode = HashMode::from_code(mode)?;
        // SAFETY: the caller passes NULL or nbytes readable bytes.
        let bytes = unsafe { bytes_arg(data, nbytes, "data") }?;
        let hex = content_store::hash_hex(bytes, mode);
        // SAFETY: buf is NULL or writable for buf_len bytes.
        unsafe { copy_c_string(&hex, buf, buf_len, "buf") }
    })
}

/// Opens (creating if needed) the store in folder `path` for writing, in
/// `format` (`SS_CONTENT_FORMAT_NATIVE` or `SS_CONTENT_FORMAT_TORCH`). A
/// store already there is added to; it must have the same format.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_content_writer*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_writer_open(path: *const c_char, format: c_int, out: *mut *mut SsContentWriter) -> ss_status {
    ffi_status!("ss_content_writer_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a NUL-terminated string.
        let path = unsafe { str_arg(path, "path") }?;
        let writer = Writer::open(Path::new(path), Format::from_code(format)?)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsContentWriter { writer }))) };
        Ok(())
    })
}

/// Stores `nbytes` bytes at `data` as a storage (once per distinct
/// content) and writes its hash, NUL-terminated, into `buf` of `buf_len`
/// bytes (`SS_HASH_HEX_MAX` suffice; `buf` may be NULL when `buf_len` is 0).
/// A `buf_len` from 1 up to the hash's length is `SS_ERR_BUFFER_TOO_SMALL`
/// before anything is written: the store is left as it was.
///
/// # Safety
/// `w` is NULL or a live `ss_content_writer` (other threads may use it
/// meanwhile); `data` is NULL or readable for `nbytes` bytes, not written by
/// another thread during the call; `buf` is NULL or writable for `buf_len`
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn ss_content_writer_write_storage(
    w: *const SsContentWriter,
    data: *const c_void,
    nbytes: usize,
    buf: *mut c_char,
    buf_len: usize,
) -> ss_status {
    ffi_status!("ss_content_writer_write_storage", {
        // SAFETY: NULL or a live handle.
        let w = unsafe { handle(w, "writer") }?;
        if buf.is_null() && buf_len != 0 {
            return Err(super::args::null("buf"));
        }
        if buf_len != 0 {
            // Checked before writing, so a refused call changes nothing.
            c_string_fits(&"0".repeat(w.writer.hash_mode().hex_len()), buf_len, "buf")?;
        }
        // SAFETY: NULL or nbytes readable bytes.
        let bytes = unsafe { bytes_arg(data, nbytes, "data") }?;
        let hash = w.writer.write_storage(bytes)?;
        if buf_len != 0 {
            // SAFETY: buf is writable for buf_len bytes.
            unsafe { copy_c_string(&hash, buf, buf_len, "buf") }?;
        }
        Ok(())
    })
}

/// Stores the storage `data` (`nbytes` bytes) and a tensor entry `name`
/// viewing it as `dtype` (an `SS_DTYPE_*` code) with `offset`, `shape`
/// and `stride` of `ndim` elements each (counted in elements, as in
/// PyTorch). The view must lie inside the storage. `/` in `name` makes
/// folders; `..`, absolute names, empty parts and NUL are refused. An
/// entry of the same name is replaced.
///
/// # Safety
/// `w` is NULL or a live `ss_content_writer` (other threads may use it
/// meanwhile); `name` is NULL or a NUL-terminated string; `data` is NULL or
/// readable for `nbytes` bytes, not written by another thread during the
/// call; `shape` and `stride` are NULL or readable for `ndim` `int64_t`s.
#[no_mangle]
pub unsafe extern "C" fn ss_content_writer_write_tensor(
    w: *const SsContentWriter,
    name: *const c_char,
    data: *const c_void,
    nbytes: usize,
    dtype: c_int,
    offset: i64,
    ndim: usize,
    shape: *const i64,
    stride: *const i64,
) -> ss_status {
    ffi_status!("ss_content_writer_write_tensor", {
        // SAFETY: NULL or a live handle.
        let w = unsafe { handle(w, "writer") }?;
        // SAFETY: NULL or a NUL-terminated string.
        let name = unsafe { str_arg(name, "name") }?;
        let dtype = Dtype::from_code(dtype)?;
        // SAFETY: the caller passes arrays of ndim elements.
        let (shape, stride) = unsafe { (dims_arg(shape, ndim, "shape")?, dims_arg(stride, ndim, "stride")?) };
        // SAFETY: NULL or nbytes readable bytes.
        let bytes = unsafe { bytes_arg(data, nbytes, "data") }?;
        w.writer.write_tensor(name, bytes, dtype, offset, shape, stride)?;
        Ok(())
    })
}

/// What the writer did: storages written to new files, storages whose
/// content was already stored (deduplicated), tensor entries written.
/// Any out-parameter may be NULL.
///
/// # Safety
/// `w` is NULL or a live `ss_content_writer` (other threads may use it
/// meanwhile); each out-parameter is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_writer_counts(
    w: *const SsContentWriter,
    out_storages_written: *mut u64,
    out_storages_deduplicated: *mut u64,
    out_tensors_written: *mut u64,
) -> ss_status {
    ffi_status!("ss_content_writer_counts", {
        // SAFETY: NULL or a live handle.
        let s = unsafe { handle(w, "writer") }?.writer.stats();
        for (p, v) in [
            (out_storages_written, s.storages_written),
            (out_storages_deduplicated, s.storages_deduplicated),
            (out_tensors_written, s.tensors_written),
        ] {
            if !p.is_null() {
                // SAFETY: a non-NULL out-parameter is writable.
                unsafe { write_out(p, v) };
            }
        }
        Ok(())
    })
}

/// Whether each file is fsynced, with its folder, around the rename that
/// publishes it (on by default). Off, writing is several times faster and
/// a killed process still leaves no partial file, but a power loss may
/// (PyTorch's writer never fsyncs).
///
/// # Safety
/// `w` is NULL or a live `ss_content_writer` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_writer_set_durable(w: *const SsContentWriter, durable: bool) -> ss_status {
    ffi_status!("ss_content_writer_set_durable", {
        // SAFETY: NULL or a live handle.
        unsafe { handle(w, "writer") }?.writer.set_durable(durable);
        Ok(())
    })
}

/// Closes a writer (with durability on, every file it wrote is already
/// on disk). NULL is a no-op.
///
/// # Safety
/// `w` is NULL or a live `ss_content_writer` that no other thread is using;
/// it must not be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_content_writer_free(w: *mut SsContentWriter) {
    ffi_value!("ss_content_writer_free", (), {
        // SAFETY: NULL or a handle from ss_content_writer_open, not used after.
        unsafe { free_handle(w) }
    })
}

/// Opens the store in folder `path` for reading; the format (ours or
/// PyTorch's) is detected. The folder may be untrusted: links below it
/// are not followed and every record is checked.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_content_reader*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_open(path: *const c_char, out: *mut *mut SsContentReader) -> ss_status {
    ffi_status!("ss_content_reader_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a NUL-terminated string.
        let path = unsafe { str_arg(path, "path") }?;
        let reader = Reader::open(Path::new(path))?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsContentReader { reader }))) };
        Ok(())
    })
}

/// The store's format (`SS_CONTENT_FORMAT_*`); -1 for NULL.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_format(r: *const SsContentReader) -> c_int {
    ffi_value!("ss_content_reader_format", -1, {
        // SAFETY: NULL or a live handle.
        unsafe { r.as_ref() }.map_or(-1, |r| r.reader.format().code())
    })
}

/// Whether storages are hashed and compared with their names before they
/// are handed out (once per mapping; off by default). A mismatch is
/// `SS_ERR_CORRUPT`.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_set_verify(r: *const SsContentReader, verify: bool) -> ss_status {
    ffi_status!("ss_content_reader_set_verify", {
        // SAFETY: NULL or a live handle.
        unsafe { handle(r, "reader") }?.reader.set_verify(verify);
        Ok(())
    })
}

/// Reads tensor entry `name`: its view and its storage, read-only. The
/// storage is mapped (no copy) when nobody but this process's user can
/// shrink its file; any other file (another user's store) is copied into
/// memory of the reader's own and checked against its CRC-32 or name, so
/// that its owner truncating it can never crash the reader. A storage
/// already read for a live tensor is shared. Free
/// the result with `ss_content_tensor_free`.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile); `name` is NULL or a NUL-terminated string; `out` is NULL or
/// points to a writable `ss_content_tensor*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_read_tensor(
    r: *const SsContentReader,
    name: *const c_char,
    out: *mut *mut SsContentTensor,
) -> ss_status {
    ffi_status!("ss_content_reader_read_tensor", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle; NULL or a NUL-terminated string.
        let (r, name) = unsafe { (handle(r, "reader")?, str_arg(name, "name")?) };
        let tensor = r.reader.read_tensor(name)?;
        let hash = c_string(tensor.meta.storage_hash.clone());
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsContentTensor { tensor, hash }))) };
        Ok(())
    })
}

/// Reads the storage named `hash`, read-only (mapped or copied, as
/// `ss_content_reader_read_tensor` says). Free the result with
/// `ss_content_storage_free`.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile); `hash` is NULL or a NUL-terminated string; `out` is NULL or
/// points to a writable `ss_content_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_read_storage(
    r: *const SsContentReader,
    hash: *const c_char,
    out: *mut *mut SsContentStorage,
) -> ss_status {
    ffi_status!("ss_content_reader_read_storage", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle; NULL or a NUL-terminated string.
        let (r, hash) = unsafe { (handle(r, "reader")?, str_arg(hash, "hash")?) };
        let storage = r.reader.read_storage(hash)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsContentStorage { storage }))) };
        Ok(())
    })
}

fn new_list(out: *mut *mut SsContentList, items: Vec<String>) {
    let items = items.into_iter().map(c_string).collect();
    // SAFETY: callers checked `out` with out_arg.
    unsafe { write_out(out, Box::into_raw(Box::new(SsContentList { items }))) };
}

/// The names of every tensor entry, sorted. Free with `ss_content_list_free`.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile); `out` is NULL or points to a writable `ss_content_list*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_list_tensors(r: *const SsContentReader, out: *mut *mut SsContentList) -> ss_status {
    ffi_status!("ss_content_reader_list_tensors", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let names = unsafe { handle(r, "reader") }?.reader.list_tensors()?;
        new_list(out, names);
        Ok(())
    })
}

/// The hashes of every storage, sorted. Free with `ss_content_list_free`.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile); `out` is NULL or points to a writable `ss_content_list*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_list_storages(r: *const SsContentReader, out: *mut *mut SsContentList) -> ss_status {
    ffi_status!("ss_content_reader_list_storages", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let storages = unsafe { handle(r, "reader") }?.reader.list_storages()?;
        new_list(out, storages.into_iter().map(|s| s.0).collect());
        Ok(())
    })
}

/// Checks the whole store: every storage hashed against its name, every
/// tensor entry parsed and bounds-checked, and every object under
/// `tensors/` or `storages/` that is not a regular file (a link, a FIFO)
/// reported. `*out_checked` (may be NULL) gets the number of objects
/// checked, `*out_problems` one line `"<object>: <why>"` per corrupt or
/// unreadable object (empty when all is well). A PyTorch-format storage
/// may be named by the SHA-1 or by PyTorch's default hash of its bytes;
/// any other name is corrupt. SS_OK means the check ran, whatever it
/// found.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` (other threads may use it
/// meanwhile); `out_checked` is NULL or points to a writable `uint64_t`;
/// `out_problems` is NULL or points to a writable `ss_content_list*`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_verify(
    r: *const SsContentReader,
    out_checked: *mut u64,
    out_problems: *mut *mut SsContentList,
) -> ss_status {
    ffi_status!("ss_content_reader_verify", {
        out_arg(out_problems, "out_problems")?;
        // SAFETY: NULL or a live handle.
        let r = unsafe { handle(r, "reader") }?;
        let report = content_store::verify(&r.reader, &mut |_, _| {})?;
        if !out_checked.is_null() {
            // SAFETY: a non-NULL out-parameter is writable.
            unsafe { write_out(out_checked, report.storages + report.tensors) };
        }
        new_list(out_problems, report.problems.into_iter().map(|p| format!("{}: {}", p.object, p.why)).collect());
        Ok(())
    })
}

/// Closes a reader; tensors and storages read from it stay valid. NULL is
/// a no-op.
///
/// # Safety
/// `r` is NULL or a live `ss_content_reader` that no other thread is using;
/// it must not be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_content_reader_free(r: *mut SsContentReader) {
    ffi_value!("ss_content_reader_free", (), {
        // SAFETY: NULL or a handle from ss_content_reader_open, not used after.
        unsafe { free_handle(r) }
    })
}

/// Runs `f` on a live tensor handle, `fallback` for NULL.
fn with_tensor<T>(t: *const SsContentTensor, fallback: T, f: impl FnOnce(&SsContentTensor) -> T) -> T {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { t.as_ref() }.map_or(fallback, f)
}

/// The tensor's dtype (`SS_DTYPE_*`); -1 for NULL.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_dtype(t: *const SsContentTensor) -> c_int {
    ffi_value!("ss_content_tensor_dtype", -1, { with_tensor(t, -1, |t| t.tensor.meta.dtype.code()) })
}

/// Number of dimensions; 0 for NULL.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_ndim(t: *const SsContentTensor) -> usize {
    ffi_value!("ss_content_tensor_ndim", 0, { with_tensor(t, 0, |t| t.tensor.meta.shape.len()) })
}

/// The sizes, `ndim` elements, valid while the tensor lives (NULL for NULL
/// or a 0-d tensor).
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile). The array is read-only.
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_shape(t: *const SsContentTensor) -> *const i64 {
    ffi_value!("ss_content_tensor_shape", std::ptr::null(), {
        with_tensor(t, std::ptr::null(), |t| if t.tensor.meta.shape.is_empty() { std::ptr::null() } else { t.tensor.meta.shape.as_ptr() })
    })
}

/// The strides in elements, `ndim` elements, valid while the tensor lives
/// (NULL for NULL or a 0-d tensor).
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile). The array is read-only.
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_stride(t: *const SsContentTensor) -> *const i64 {
    ffi_value!("ss_content_tensor_stride", std::ptr::null(), {
        with_tensor(t, std::ptr::null(), |t| if t.tensor.meta.stride.is_empty() { std::ptr::null() } else { t.tensor.meta.stride.as_ptr() })
    })
}

/// The storage offset in elements; 0 for NULL.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_offset(t: *const SsContentTensor) -> i64 {
    ffi_value!("ss_content_tensor_offset", 0, { with_tensor(t, 0, |t| t.tensor.meta.offset) })
}

/// Whether the tensor has PyTorch's lazy conjugate bit set (its values
/// are the complex conjugates of the stored ones, as
/// `ContentStoreReader` hands it out); false for NULL and in the native
/// format.
///
/// # Safety
/// `t` is NULL or a live tensor from `ss_content_reader_read_tensor`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_conj(t: *const SsContentTensor) -> bool {
    ffi_value!("ss_content_tensor_conj", false, { with_tensor(t, false, |t| t.tensor.bits.conj) })
}

/// Whether the tensor has PyTorch's lazy negative bit set (its values are
/// the negations of the stored ones); false for NULL and in the native
/// format.
///
/// # Safety
/// `t` is NULL or a live tensor from `ss_content_reader_read_tensor`.
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_neg(t: *const SsContentTensor) -> bool {
    ffi_value!("ss_content_tensor_neg", false, { with_tensor(t, false, |t| t.tensor.bits.neg) })
}

/// The storage's first byte, read-only (element `i` of the view is at
/// `itemsize * (offset + sum(index_k * stride_k))`); NULL for NULL or an
/// empty storage. Valid while the tensor lives.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile). The bytes are read-only: writing them may fault.
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_data(t: *const SsContentTensor) -> *const c_void {
    ffi_value!("ss_content_tensor_data", std::ptr::null(), {
        with_tensor(t, std::ptr::null(), |t| {
            let b = t.tensor.storage.bytes();
            if b.is_empty() {
                std::ptr::null()
            } else {
                b.as_ptr().cast()
            }
        })
    })
}

/// The storage's size in bytes; 0 for NULL.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_nbytes(t: *const SsContentTensor) -> usize {
    ffi_value!("ss_content_tensor_nbytes", 0, { with_tensor(t, 0, |t| t.tensor.storage.bytes().len()) })
}

/// The storage's hash, valid while the tensor lives; "" for NULL.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_storage_hash(t: *const SsContentTensor) -> *const c_char {
    ffi_value!("ss_content_tensor_storage_hash", c"".as_ptr(), { with_tensor(t, c"".as_ptr(), |t| t.hash.as_ptr()) })
}

/// Releases a tensor (its storage mapping goes with the last user). NULL
/// is a no-op.
///
/// # Safety
/// `t` is NULL or a live `ss_content_tensor` that no other thread is using;
/// neither it nor pointers it returned may be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_content_tensor_free(t: *mut SsContentTensor) {
    ffi_value!("ss_content_tensor_free", (), {
        // SAFETY: NULL or a handle from ss_content_reader_read_tensor, not used after.
        unsafe { free_handle(t) }
    })
}

/// The storage's first byte, read-only; NULL for NULL or an empty storage.
///
/// # Safety
/// `s` is NULL or a live `ss_content_storage` (other threads may use it
/// meanwhile). The bytes are read-only (writing them may fault) and valid
/// until the storage is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_content_storage_data(s: *const SsContentStorage) -> *const c_void {
    ffi_value!("ss_content_storage_data", std::ptr::null(), {
        // SAFETY: NULL or a live handle.
        unsafe { s.as_ref() }.map_or(std::ptr::null(), |s| {
            let b = s.storage.bytes();
            if b.is_empty() {
                std::ptr::null()
            } else {
                b.as_ptr().cast()
            }
        })
    })
}

/// The storage's size in bytes; 0 for NULL.
///
/// # Safety
/// `s` is NULL or a live `ss_content_storage` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_storage_nbytes(s: *const SsContentStorage) -> usize {
    ffi_value!("ss_content_storage_nbytes", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { s.as_ref() }.map_or(0, |s| s.storage.bytes().len())
    })
}

/// Releases a storage. NULL is a no-op.
///
/// # Safety
/// `s` is NULL or a live `ss_content_storage` that no other thread is using;
/// neither it nor its data pointer may be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_content_storage_free(s: *mut SsContentStorage) {
    ffi_value!("ss_content_storage_free", (), {
        // SAFETY: NULL or a handle from ss_content_reader_read_storage, not used after.
        unsafe { free_handle(s) }
    })
}

/// Number of strings in a list; 0 for NULL.
///
/// # Safety
/// `l` is NULL or a live `ss_content_list` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_list_len(l: *const SsContentList) -> usize {
    ffi_value!("ss_content_list_len", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { l.as_ref() }.map_or(0, |l| l.items.len())
    })
}

/// String `i` of a list, valid while the list lives; NULL for NULL or `i`
/// out of range.
///
/// # Safety
/// `l` is NULL or a live `ss_content_list` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_content_list_get(l: *const SsContentList, i: usize) -> *const c_char {
    ffi_value!("ss_content_list_get", std::ptr::null(), {
        // SAFETY: NULL or a live handle.
        unsafe { l.as_ref() }.and_then(|l| l.items.get(i)).map_or(std::ptr::null(), |s| s.as_ptr())
    })
}

/// Releases a list. NULL is a no-op.
///
/// # Safety
/// `l` is NULL or a live `ss_content_list` that no other thread is using;
/// neither it nor strings it returned may be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_content_list_free(l: *mut SsContentList) {
    ffi_value!("ss_content_list_free", (), {
        // SAFETY: NULL or a handle from this library, not used after.
        unsafe { free_handle(l) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_constants_are_c10_codes() {
        for (c, d) in [
            (SS_DTYPE_UINT8, Dtype::UInt8),
            (SS_DTYPE_INT8, Dtype::Int8),
            (SS_DTYPE_INT16, Dtype::Int16),
            (SS_DTYPE_INT32, Dtype::Int32),
            (SS_DTYPE_INT64, Dtype::Int64),
            (SS_DTYPE_FLOAT16, Dtype::Float16),
            (SS_DTYPE_FLOAT32, Dtype::Float32),
            (SS_DTYPE_FLOAT64, Dtype::Float64),
            (SS_DTYPE_COMPLEX32, Dtype::ComplexHalf),
            (SS_DTYPE_COMPLEX64, Dtype::ComplexFloat),
            (SS_DTYPE_COMPLEX128, Dtype::ComplexDouble),
            (SS_DTYPE_BOOL, Dtype::Bool),
            (SS_DTYPE_BFLOAT16, Dtype::BFloat16),
            (SS_DTYPE_FLOAT8_E5M2, Dtype::Float8E5M2),
            (SS_DTYPE_FLOAT8_E4M3FN, Dtype::Float8E4M3Fn),
            (SS_DTYPE_UINT16, Dtype::UInt16),
            (SS_DTYPE_UINT32, Dtype::UInt32),
            (SS_DTYPE_UINT64, Dtype::UInt64),
        ] {
            assert_eq!(Dtype::from_code(c).unwrap(), d);
        }
        assert_eq!(Format::from_code(SS_CONTENT_FORMAT_TORCH).unwrap(), Format::Torch);
        assert_eq!(HashMode::from_code(SS_HASH_STABLE).unwrap().hex_len() + 1, SS_HASH_HEX_MAX);
    }
}
