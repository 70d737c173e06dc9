//! The content store in PyTorch's format, for `storage_sharing.content_store`:
//! a writer and a reader over byte ranges the Python side names by
//! address (a torch storage's `data_ptr()` and `nbytes()`, kept alive by
//! the caller for the length of the call). Hashing, writing and copying
//! release the GIL.

use crate::errors::{invalid, OrRaise};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;
use storage_sharing::content_store::torch_default_hash::torch_default_hash_hex;
use storage_sharing::content_store::{hash_hex, Digest, Dtype, Format, HashMode, HashWhere, Pipeline, Reader, StorageFile, Writer};

/// The bytes at `address`, `nbytes` long.
///
/// # Safety
/// The range must stay readable and unchanged for the returned lifetime:
/// the Python caller holds the storage that owns it across the call.
unsafe fn bytes_at<'a>(address: usize, nbytes: usize) -> &'a [u8] {
    if nbytes == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(address as *const u8, nbytes)
    }
}

fn checked_address(address: usize, nbytes: usize) -> PyResult<()> {
    if address == 0 && nbytes != 0 {
        return Err(invalid(format!("null address for {nbytes} bytes")));
    }
    Ok(())
}

/// PyTorch's `hash_storage` of the bytes: SHA-1 with `stable`, its
/// default (seeded Philox) hash otherwise.
fn digest(data: &[u8], stable: bool) -> String {
    digest_fn(stable)(data)
}

fn sha1_hex(data: &[u8]) -> String {
    hash_hex(data, HashMode::Stable)
}

/// The digest function of `digest`, for the background writer.
fn digest_fn(stable: bool) -> Digest {
    if stable {
        sha1_hex
    } else {
        torch_default_hash_hex
    }
}

/// `hash_storage` of `nbytes` bytes at `address`.
#[pyfunction]
pub fn content_hash(py: Python<'_>, address: usize, nbytes: usize, stable: bool) -> PyResult<String> {
    checked_address(address, nbytes)?;
    // SAFETY: the caller holds the storage across the call.
    let data = unsafe { bytes_at(address, nbytes) };
    Ok(py.allow_threads(|| digest(data, stable)))
}

fn parse_dtype(name: &str) -> PyResult<Dtype> {
    Dtype::from_torch_name(name.strip_prefix("torch.").unwrap_or(name)).or_raise()
}

#[pyclass(frozen, module = "storage_sharing._native", name = "ContentWriter")]
pub struct PyContentWriter {
    writer: Arc<Writer>,
    pipeline: Pipeline,
}

#[pymethods]
impl PyContentWriter {
    /// Opens (creating) a PyTorch-format store at `path`. `durable`
    /// fsyncs every file (PyTorch's writer does not).
    #[new]
    #[pyo3(signature = (path, durable=false))]
    fn new(py: Python<'_>, path: PathBuf, durable: bool) -> PyResult<Self> {
        let writer = py.allow_threads(|| Writer::open(&path, Format::Torch)).or_raise()?;
        writer.set_durable(durable);
        let writer = Arc::new(writer);
        Ok(PyContentWriter { pipeline: Pipeline::new(writer.clone()), writer })
    }

    /// Hashes and stores the bytes unless present; returns the hash.
    fn write_storage(&self, py: Python<'_>, address: usize, nbytes: usize, stable: bool) -> PyResult<String> {
        checked_address(address, nbytes)?;
        // SAFETY: the caller holds the storage across the call.
        let data = unsafe { bytes_at(address, nbytes) };
        py.allow_threads(|| {
            let hash = digest(data, stable);
            self.writer.write_storage_hashed(&hash, data).map(|_| hash)
        })
        .or_raise()
    }

    /// Stores the bytes under a hash computed elsewhere.
    fn write_storage_hashed(&self, py: Python<'_>, hash: &str, address: usize, nbytes: usize) -> PyResult<()> {
        checked_address(address, nbytes)?;
        // SAFETY: the caller holds the storage across the call.
        let data = unsafe { bytes_at(address, nbytes) };
        py.allow_threads(|| self.writer.write_storage_hashed(hash, data)).or_raise()
    }

    /// Queues the tensor `name` over a copy of the storage's bytes (taken
    /// in the call), to be hashed and written in the background. Returns
    /// the hash when the work was done in the call (a forked child), else
    /// None. A background error comes back from a later call.
    #[allow(clippy::too_many_arguments)]
    fn submit_tensor(
        &self,
        py: Python<'_>,
        name: &str,
        address: usize,
        nbytes: usize,
        stable: bool,
        dtype: &str,
        offset: i64,
        shape: Vec<i64>,
        stride: Vec<i64>,
    ) -> PyResult<Option<String>> {
        checked_address(address, nbytes)?;
        let dtype = parse_dtype(dtype)?;
        // SAFETY: the caller holds the storage across the call; the bytes
        // are copied before it returns.
        let data = unsafe { bytes_at(address, nbytes) };
        py.allow_threads(|| self.pipeline.submit_tensor(name, data, digest_fn(stable), dtype, offset, &shape, &stride)).or_raise()
    }

    /// Where submitted storages are hashed: "auto", "caller" or "pool".
    fn set_hash_where(&self, at: &str) -> PyResult<()> {
        let at = match at {
            "auto" => HashWhere::Auto,
            "caller" => HashWhere::Caller,
            "pool" => HashWhere::Pool,
            _ => return Err(invalid(format!("hash place {at:?}: expected \"auto\", \"caller\" or \"pool\""))),
        };
        self.pipeline.set_hash_where(at);
        Ok(())
    }

    /// Waits for the queued tensors; raises the first background error.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.pipeline.flush()).or_raise()
    }

    /// Waits for the queued tensors, raising nothing (for readers).
    fn wait_idle(&self, py: Python<'_>) {
        py.allow_threads(|| self.pipeline.wait_idle())
    }

    /// Hashes of the storages the background stored or found since the
    /// last call.
    fn take_hashes(&self) -> Vec<String> {
        self.pipeline.take_hashes()
    }

    /// (storages written, deduplicated, tensors written, bytes written).
    fn stats(&self) -> (u64, u64, u64, u64) {
        let s = self.writer.stats();
        (s.storages_written, s.storages_deduplicated, s.tensors_written, s.bytes_written)
    }
}

#[pyclass(frozen, module = "storage_sharing._native", name = "ContentReader")]
pub struct PyContentReader {
    reader: Reader,
}

#[pymethods]
impl PyContentReader {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        Ok(PyContentReader { reader: py.allow_threads(|| Reader::open(&path)).or_raise()? })
    }

    /// The entry `name`: (dtype, storage hash, offset, shape, stride,
    /// conj bit, neg bit).
    #[allow(clippy::type_complexity)]
    fn read_meta(&self, py: Python<'_>, name: &str) -> PyResult<(&'static str, String, i64, Vec<i64>, Vec<i64>, bool, bool)> {
        let (m, bits) = py.allow_threads(|| self.reader.read_entry(name)).or_raise()?;
        Ok((m.dtype.torch_name(), m.storage_hash, m.offset, m.shape, m.stride, bits.conj, bits.neg))
    }

    /// The entry `name`'s bytes, unparsed, after every check of the name
    /// and the file (inside `tensors/`, no link, a regular file, bounded
    /// size): what may be handed to another parser when ours refuses the
    /// contents. Raises what `read_meta` raises for a refused name.
    fn read_entry_bytes<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let bytes = py.allow_threads(|| self.reader.read_entry_file(name)).or_raise()?;
        Ok(pyo3::types::PyBytes::new(py, &bytes))
    }

    /// The storage named `hash`, its file open and parsed, to be copied
    /// out once by `StoredBytes.copy_to`.
    fn open_storage(&self, py: Python<'_>, hash: &str) -> PyResult<StoredBytes> {
        Ok(StoredBytes { file: py.allow_threads(|| self.reader.open_storage_file(hash)).or_raise()? })
    }

    fn list_tensors(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.allow_threads(|| self.reader.list_tensors()).or_raise()
    }
}

/// A stored storage's file, open while this object lives.
#[pyclass(frozen, module = "storage_sharing._native", name = "StoredBytes")]
pub struct StoredBytes {
    file: StorageFile,
}

#[pymethods]
impl StoredBytes {
    #[getter]
    fn nbytes(&self) -> usize {
        self.file.len()
    }

    #[getter]
    fn hash(&self) -> &str {
        self.file.hash()
    }

    /// Reads the bytes from the file to `address`, which must have room
    /// for `nbytes`, checking them against the file's CRC-32 on the way
    /// (a damaged file raises; the destination then holds what was read).
    fn copy_to(&self, py: Python<'_>, address: usize, room: usize) -> PyResult<()> {
        let len = self.file.len();
        if room < len {
            return Err(invalid(format!("destination has {room} bytes; the storage has {len}")));
        }
        checked_address(address, len)?;
        py.allow_threads(|| {
            let dst: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: the caller owns `room` >= len writable bytes at
                // `address` (a fresh storage) for the length of the call.
                unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) }
            };
            self.file.read_into(dst)
        })
        .or_raise()
    }
}
