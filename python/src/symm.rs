//! CPU symmetric memory for `storage_sharing.symm`: groups registered with
//! a store (the library's TCPStore client, or a Python c10d store object
//! wrapped as a host-callback store), blocks allocated and rendezvoused
//! across the group, and the block's barrier and signals. Every call that
//! waits releases the GIL; the Python store's methods take it back.

use crate::errors::{invalid, OrRaise};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage_sharing::store::{show_key, Store, StoreRef, TcpStore, Timeout};
use storage_sharing::symm::{self, DeviceType, SymmetricMemory};
use storage_sharing::{Error, ErrorKind, Result};

/// A c10d store object of the Python process (`torch.distributed.Store`):
/// set/get/add/wait/check called back under the GIL.
struct PythonStore {
    store: Py<PyAny>,
    what: String,
}

fn timedelta(py: Python<'_>, t: Duration) -> PyResult<Bound<'_, PyAny>> {
    py.import("datetime")?.getattr("timedelta")?.call1((0, t.as_secs(), t.subsec_micros()))
}

impl PythonStore {
    fn call<T>(&self, op: &str, f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>) -> Result<T> {
        Python::with_gil(|py| {
            f(py, self.store.bind(py)).map_err(|e| {
                let text = e.to_string();
                // c10d raises DistStoreError (a RuntimeError) on expiry.
                let lower = text.to_lowercase();
                let kind = if lower.contains("timeout") || lower.contains("timed out") { ErrorKind::Timeout } else { ErrorKind::Io };
                Error::new(kind, format!("{} {op}: {text}", self.what))
            })
        })
    }
}

/// A key as the Python store takes it: `str` when it is UTF-8 (c10d keys
/// are), `bytes` otherwise (pybind11 passes both as `std::string`).
fn key_object(py: Python<'_>, key: &[u8]) -> PyObject {
    match std::str::from_utf8(key) {
        Ok(text) => PyString::new(py, text).into_any().unbind(),
        Err(_) => PyBytes::new(py, key).into_any().unbind(),
    }
}

fn key_objects(py: Python<'_>, keys: &[&[u8]]) -> Vec<PyObject> {
    keys.iter().map(|k| key_object(py, k)).collect()
}

impl Store for PythonStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.call("set", |py, s| s.call_method1("set", (key_object(py, key), PyBytes::new(py, value))).map(|_| ()))
    }

    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.call("get", |py, s| s.call_method1("get", (key_object(py, key),))?.extract::<Vec<u8>>())
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.call("add", |py, s| s.call_method1("add", (key_object(py, key), delta))?.extract::<i64>())
    }

    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        match timeout {
            // A zero wait is a look: c10d reads a zero timeout as "none".
            Some(t) if t.is_zero() => {
                if self.check(keys)? {
                    Ok(())
                } else {
                    let names: Vec<String> = keys.iter().map(|k| show_key(k)).collect();
                    Err(Error::new(ErrorKind::Timeout, format!("{}: keys {} are not set", self.what, names.join(", "))))
                }
            }
            Some(t) => self.call("wait", |py, s| s.call_method1("wait", (key_objects(py, keys), timedelta(py, t)?)).map(|_| ())),
            None => self.call("wait", |py, s| s.call_method1("wait", (key_objects(py, keys),)).map(|_| ())),
        }
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.call("check", |py, s| s.call_method1("check", (key_objects(py, keys),))?.extract::<bool>())
    }

    fn describe(&self) -> String {
        self.what.clone()
    }
}

pub(crate) fn timeout_of(seconds: Option<f64>) -> PyResult<Timeout> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(invalid(format!("timeout must be a non-negative number of seconds, got {s}"))),
    }
}

/// Registers group `name` (this process is `rank` of `world_size`) with
/// the TCPStore at `host:port`, reached by the library's own client.
#[pyfunction]
#[pyo3(signature = (name, rank, world_size, host, port, timeout=None))]
pub fn symm_group_tcp(py: Python<'_>, name: &str, rank: i64, world_size: i64, host: &str, port: u16, timeout: Option<f64>) -> PyResult<()> {
    let t = timeout_of(timeout)?;
    let store: StoreRef = Arc::new(py.allow_threads(|| TcpStore::open(host, port, false, 0, t)).or_raise()?);
    symm::group::set_group_info(name, rank, world_size, store).or_raise()
}

/// Registers group `name` with a Python c10d store object.
#[pyfunction]
pub fn symm_group_store(name: &str, rank: i64, world_size: i64, store: Bound<'_, PyAny>) -> PyResult<()> {
    let what = format!("store {}", store.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into()));
    let store: StoreRef = Arc::new(PythonStore { store: store.unbind(), what });
    symm::group::set_group_info(name, rank, world_size, store).or_raise()
}

/// Whether group `name` is registered in this process.
#[pyfunction]
pub fn symm_has_group(name: &str) -> bool {
    symm::group::get_group_info(name).is_ok()
}

/// Allocates a CPU block of `size` bytes in `group` and runs its
/// rendezvous (every rank must), without the GIL: its address here and
/// its handle.
pub(crate) fn alloc_block(py: Python<'_>, size: usize, group: &str, timeout: Option<f64>) -> PyResult<(usize, Arc<SymmetricMemory>)> {
    let t = timeout_of(timeout)?;
    py.allow_threads(|| -> Result<(usize, Arc<SymmetricMemory>)> {
        let ptr = symm::alloc(DeviceType::Cpu, 0, size, Some(group))?;
        match symm::rendezvous(ptr, Some(group), t) {
            Ok(h) => Ok((ptr as usize, h)),
            Err(e) => {
                let _ = symm::free(ptr);
                Err(e)
            }
        }
    })
    .or_raise()
}

/// A block of `size` bytes on every rank of a group, after its rendezvous.
// weakref: a group finds its live allocations without keeping them.
#[pyclass(frozen, weakref, module = "storage_sharing._native", name = "SymmBlock")]
pub struct SymmBlock {
    state: Mutex<Option<(usize, Arc<SymmetricMemory>)>>,
}

impl SymmBlock {
    fn handle(&self) -> PyResult<Arc<SymmetricMemory>> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().map(|(_, h)| h.clone()).ok_or_else(|| crate::errors::closed("symmetric block"))
    }
}

#[pymethods]
impl SymmBlock {
    /// Allocates and runs the rendezvous (every rank of `group` must).
    #[new]
    #[pyo3(signature = (size, group, timeout=None))]
    fn new(py: Python<'_>, size: usize, group: &str, timeout: Option<f64>) -> PyResult<Self> {
        let (ptr, handle) = alloc_block(py, size, group, timeout)?;
        Ok(SymmBlock { state: Mutex::new(Some((ptr, handle))) })
    }

    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.handle()?.rank())
    }

    #[getter]
    fn world_size(&self) -> PyResult<usize> {
        Ok(self.handle()?.world_size())
    }

    #[getter]
    fn size(&self) -> PyResult<usize> {
        Ok(self.handle()?.buffer_size())
    }

    /// How many signal channels the pad holds.
    #[getter]
    fn channels(&self) -> PyResult<usize> {
        Ok(self.handle()?.channels())
    }

    /// The address of rank `rank`'s buffer in this process.
    fn buffer_address(&self, rank: i64) -> PyResult<usize> {
        Ok(self.handle()?.buffer_ptr(rank).or_raise()? as usize)
    }

    #[pyo3(signature = (channel=0, timeout=None))]
    fn barrier(&self, py: Python<'_>, channel: i64, timeout: Option<f64>) -> PyResult<()> {
        let (h, t) = (self.handle()?, timeout_of(timeout)?);
        py.allow_threads(|| h.barrier(channel, t, 0)).or_raise()
    }

    #[pyo3(signature = (dst, channel=0, timeout=None))]
    fn put_signal(&self, py: Python<'_>, dst: i64, channel: i64, timeout: Option<f64>) -> PyResult<()> {
        let (h, t) = (self.handle()?, timeout_of(timeout)?);
        py.allow_threads(|| h.put_signal(dst, channel, t, 0)).or_raise()
    }

    #[pyo3(signature = (src, channel=0, timeout=None))]
    fn wait_signal(&self, py: Python<'_>, src: i64, channel: i64, timeout: Option<f64>) -> PyResult<()> {
        let (h, t) = (self.handle()?, timeout_of(timeout)?);
        py.allow_threads(|| h.wait_signal(src, channel, t, 0)).or_raise()
    }

    /// Unmaps the peers and frees the block; tensors over it must be gone.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.state.lock().unwrap_or_else(|p| p.into_inner()).take();
        match taken {
            Some((ptr, handle)) => {
                drop(handle);
                py.allow_threads(|| symm::free(ptr as *mut u8)).or_raise()
            }
            None => Ok(()),
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }
}

impl Drop for SymmBlock {
    fn drop(&mut self) {
        if let Some((ptr, handle)) = self.state.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            drop(handle);
            let _ = symm::free(ptr as *mut u8);
        }
    }
}
