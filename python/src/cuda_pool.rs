//! `storage_sharing.cuda`'s native half: a producer's shareable weights
//! pool and a consumer's opened weights (the C functions PyTorch's
//! `CUDAPluggableAllocator` calls are in `pool_allocator`).
//!
//! Objects remember the process that made them: after fork(), a child's
//! copy of a parent's pool or weights refuses calls and is left alone when
//! dropped (dropping it would close the parent's segments or clear the
//! parent's hold slot, which live in shared memory).

use crate::errors::{invalid, OrRaise};
use crate::symm::timeout_of;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use storage_sharing::content_store::Dtype;
use storage_sharing::cuda::pool::{self, Pool, PoolDevice, PoolHandle, PoolKind, PoolOptions, TensorSpec, Weights};

fn pid() -> u32 {
    std::process::id()
}

fn parse_device(device_type: &str, index: i32) -> PyResult<PoolDevice> {
    match device_type {
        "cuda" if index >= 0 => Ok(PoolDevice::Cuda(index)),
        "cuda" => Err(invalid(format!("CUDA device index {index} is negative"))),
        "cpu" => Ok(PoolDevice::Host),
        other => Err(invalid(format!("pool device must be 'cuda' or 'cpu', got {other:?}"))),
    }
}

fn device_parts(d: PoolDevice) -> (&'static str, i32) {
    match d {
        PoolDevice::Cuda(i) => ("cuda", i),
        PoolDevice::Host => ("cpu", -1),
    }
}

fn parse_kind(kind: &str) -> PyResult<PoolKind> {
    match kind {
        "vmm" => Ok(PoolKind::Vmm),
        "legacy" => Ok(PoolKind::Legacy),
        other => Err(invalid(format!("pool kind must be 'vmm' or 'legacy', got {other:?}"))),
    }
}

fn kind_name(k: PoolKind) -> &'static str {
    match k {
        PoolKind::Vmm => "vmm",
        PoolKind::Legacy => "legacy",
    }
}

fn parse_dtype(name: &str) -> PyResult<Dtype> {
    Dtype::from_torch_name(name.strip_prefix("torch.").unwrap_or(name)).or_raise()
}

/// A producer's pool (`storage_sharing.cuda.Pool` wraps it).
#[pyclass(frozen, module = "storage_sharing._native", name = "CudaPool")]
pub struct PyCudaPool {
    pool: ManuallyDrop<Arc<Pool>>,
    pid: u32,
}

impl PyCudaPool {
    fn get(&self) -> PyResult<Arc<Pool>> {
        if self.pid != pid() {
            return Err(invalid(format!("this pool belongs to process {} (inherited through fork): make a new one", self.pid)));
        }
        Ok(Arc::clone(&self.pool))
    }
}

impl Drop for PyCudaPool {
    fn drop(&mut self) {
        if self.pid == pid() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.pool) };
        }
    }
}

#[pymethods]
impl PyCudaPool {
    #[new]
    #[pyo3(signature = (device_type, device, kind="vmm", segment_size=None, max_consumers=None))]
    fn new(
        py: Python<'_>,
        device_type: &str,
        device: i32,
        kind: &str,
        segment_size: Option<usize>,
        max_consumers: Option<usize>,
    ) -> PyResult<Self> {
        let d = PoolOptions::default();
        let opts = PoolOptions {
            device: parse_device(device_type, device)?,
            kind: parse_kind(kind)?,
            segment_size: segment_size.unwrap_or(d.segment_size),
            max_consumers: max_consumers.unwrap_or(d.max_consumers),
        };
        let pool = py.allow_threads(|| Pool::new(opts)).or_raise()?;
        Ok(PyCudaPool { pool: ManuallyDrop::new(Arc::new(pool)), pid: pid() })
    }

    /// A block of `nbytes` (512-byte aligned); its address in this process.
    fn alloc(&self, py: Python<'_>, nbytes: usize) -> PyResult<u64> {
        let p = self.get()?;
        py.allow_threads(|| p.alloc(nbytes)).or_raise()
    }

    fn free_block(&self, ptr: u64) -> PyResult<()> {
        self.get()?.free_block(ptr).or_raise()
    }

    /// Adds tensor `name` (a view of the pool storage at `storage_ptr`) to
    /// the manifest.
    #[allow(clippy::too_many_arguments)]
    fn add_tensor(
        &self,
        name: &str,
        storage_ptr: u64,
        storage_nbytes: usize,
        dtype: &str,
        sizes: Vec<i64>,
        strides: Vec<i64>,
        storage_offset: i64,
    ) -> PyResult<()> {
        let spec = TensorSpec { storage_ptr, storage_nbytes, dtype: parse_dtype(dtype)?, sizes, strides, storage_offset };
        self.get()?.add_tensor(name, &spec).or_raise()
    }

    /// Freezes the manifest, starts answering consumers, publishes version
    /// 1 (the first time); the handle's bytes.
    fn export<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let p = self.get()?;
        let handle = py.allow_threads(|| p.export()).or_raise()?;
        Ok(PyBytes::new(py, &handle.to_bytes()))
    }

    /// Opens an update: waits (up to `timeout` seconds, None = no limit)
    /// until no consumer holds a version. End it with `publish_update` or
    /// `abandon_update`.
    #[pyo3(signature = (timeout=None))]
    fn begin_update(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let p = self.get()?;
        let t = timeout_of(timeout)?;
        py.allow_threads(|| p.start_update(t)).or_raise()
    }

    /// Records the end of the update's writes on `stream` (0 on the host)
    /// and bumps the version, or sets it to `version` (a replica publishes
    /// its source's); returns the new version.
    #[pyo3(signature = (stream, version=None))]
    fn publish_update(&self, py: Python<'_>, stream: u64, version: Option<u64>) -> PyResult<u64> {
        let p = self.get()?;
        py.allow_threads(|| p.publish_update_as(stream, version)).or_raise()
    }

    /// Ends the open update without publishing: the pool stays torn.
    fn abandon_update(&self) -> PyResult<()> {
        self.get()?.abandon_update();
        Ok(())
    }

    #[getter]
    fn version(&self) -> PyResult<u64> {
        Ok(self.get()?.version())
    }

    /// Whether an abandoned update left the pool torn (until the next publish).
    #[getter]
    fn torn(&self) -> PyResult<bool> {
        Ok(self.get()?.torn())
    }

    #[getter]
    fn consumers(&self) -> PyResult<usize> {
        Ok(self.get()?.consumers())
    }

    /// (address, bytes) of each segment, in order.
    fn segments(&self) -> PyResult<Vec<(u64, usize)>> {
        Ok(self.get()?.segments())
    }

    /// Per segment, the eight fields of PyTorch's `_share_cuda_()` tuple
    /// (legacy-kind CUDA pools only).
    #[allow(clippy::type_complexity)]
    fn stock_segments<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(i32, Bound<'py, PyBytes>, u64, u64, Bound<'py, PyBytes>, u64, Bound<'py, PyBytes>, bool)>> {
        let p = self.get()?;
        let handles = py.allow_threads(|| p.stock_segments()).or_raise()?;
        Ok(handles
            .into_iter()
            .map(|h| {
                (
                    h.device,
                    PyBytes::new(py, &h.mem_handle),
                    h.size_bytes,
                    h.offset_bytes,
                    PyBytes::new(py, h.ref_counter_handle.as_bytes()),
                    h.ref_counter_offset,
                    PyBytes::new(py, &h.event_handle),
                    h.event_sync_required,
                )
            })
            .collect())
    }

    /// Makes this pool the process's current one: where
    /// `ss_pool_torch_malloc` places PyTorch's allocations.
    fn make_current(&self) -> PyResult<()> {
        pool::set_current(Some(self.get()?));
        Ok(())
    }
}

/// No pool is current any more (`ss_pool_torch_malloc` fails from now on).
#[pyfunction]
pub fn clear_current_pool() {
    pool::set_current(None);
}

/// (socket name, producer pid, device type, device index, kind) of a
/// handle's bytes, or an error naming what is wrong with them.
#[pyfunction]
pub fn pool_handle_info(data: &[u8]) -> PyResult<(String, i32, &'static str, i32, &'static str)> {
    let h = PoolHandle::from_bytes(data).or_raise()?;
    let (t, i) = device_parts(h.device);
    Ok((h.socket_name, h.producer_pid, t, i, kind_name(h.kind)))
}

/// A consumer's opened weights (`storage_sharing.cuda.Weights` wraps it).
#[pyclass(frozen, module = "storage_sharing._native", name = "CudaWeights")]
pub struct PyCudaWeights {
    weights: ManuallyDrop<Arc<Weights>>,
    pid: u32,
}

impl PyCudaWeights {
    fn get(&self) -> PyResult<Arc<Weights>> {
        if self.pid != pid() {
            return Err(invalid(format!(
                "these weights were opened by process {} (inherited through fork): open the handle again",
                self.pid
            )));
        }
        Ok(Arc::clone(&self.weights))
    }
}

impl Drop for PyCudaWeights {
    fn drop(&mut self) {
        if self.pid == pid() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.weights) };
        }
    }
}

type TensorRow = (String, usize, usize, u64, usize, &'static str, Vec<i64>, Vec<i64>, i64);

#[pymethods]
impl PyCudaWeights {
    /// Connects to the producer of the handle `data` and maps its pool
    /// (waits up to `timeout` seconds, None = no limit).
    #[new]
    #[pyo3(signature = (data, timeout=None))]
    fn open(py: Python<'_>, data: &[u8], timeout: Option<f64>) -> PyResult<Self> {
        let t = timeout_of(timeout)?;
        let h = PoolHandle::from_bytes(data).or_raise()?;
        let w = py.allow_threads(|| Weights::open(&h, t)).or_raise()?;
        Ok(PyCudaWeights { weights: ManuallyDrop::new(Arc::new(w)), pid: pid() })
    }

    /// One row per tensor: (name, storage index, segment, storage address,
    /// storage bytes, dtype name, sizes, strides, storage offset).
    fn tensors(&self) -> PyResult<Vec<TensorRow>> {
        Ok(self
            .get()?
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.storage_index,
                    t.segment,
                    t.storage_ptr,
                    t.storage_nbytes,
                    t.dtype.torch_name(),
                    t.sizes.clone(),
                    t.strides.clone(),
                    t.storage_offset,
                )
            })
            .collect())
    }

    fn segments(&self) -> PyResult<Vec<(u64, usize)>> {
        Ok(self.get()?.segments())
    }

    /// Holds the current version (waiting while the producer writes, up to
    /// `timeout` seconds); `stream` waits for its publish. Returns it.
    #[pyo3(signature = (stream, timeout=None))]
    fn acquire(&self, py: Python<'_>, stream: u64, timeout: Option<f64>) -> PyResult<u64> {
        let w = self.get()?;
        let t = timeout_of(timeout)?;
        py.allow_threads(|| w.acquire(stream, t)).or_raise()
    }

    /// Lets the held version go once `stream`'s work is done.
    fn release(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let w = self.get()?;
        py.allow_threads(|| w.release(stream)).or_raise()
    }

    /// Whether the producer is writing an update now.
    #[getter]
    fn update_pending(&self) -> PyResult<bool> {
        Ok(self.get()?.update_pending())
    }

    /// PeerGone once the producer is gone.
    fn check_producer(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.get()?;
        py.allow_threads(|| w.check_producer()).or_raise()
    }
}
