//! The scratch block of a `storage_sharing.symm` group and its collectives,
//! run in Rust without the GIL. Tensors come in as addresses from the
//! Python wrapper, which checks their sizes and keeps them alive.

use crate::errors::{invalid, OrRaise};
use crate::symm::{alloc_block, timeout_of};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use storage_sharing::symm;
use storage_sharing::symm::cpu_collectives::{CpuCollectives, SymmetricInput};
use storage_sharing::symm::reduce::{Elem, ReduceOp};

#[pyclass(frozen, module = "storage_sharing._native", name = "SymmScratch")]
pub struct SymmScratch {
    state: Mutex<Option<(usize, Arc<CpuCollectives>)>>,
}

impl SymmScratch {
    fn coll(&self) -> PyResult<Arc<CpuCollectives>> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().map(|(_, c)| c.clone()).ok_or_else(|| crate::errors::closed("symmetric scratch block"))
    }
}

fn address<T>(a: usize) -> *mut T {
    a as *mut T
}

#[pymethods]
impl SymmScratch {
    /// A scratch block whose calls move up to `bytes` per rank (every rank
    /// of `group` makes it alike).
    #[new]
    #[pyo3(signature = (bytes, group, timeout=None))]
    fn new(py: Python<'_>, bytes: usize, group: &str, timeout: Option<f64>) -> PyResult<Self> {
        let (ptr, mem) = alloc_block(py, CpuCollectives::block_size_for(bytes), group, timeout)?;
        Ok(SymmScratch { state: Mutex::new(Some((ptr, Arc::new(CpuCollectives::new(mem))))) })
    }

    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.coll()?.memory().rank())
    }

    #[getter]
    fn world_size(&self) -> PyResult<usize> {
        Ok(self.coll()?.memory().world_size())
    }

    /// Bytes per rank one call may move.
    #[getter]
    fn capacity(&self) -> PyResult<usize> {
        Ok(self.coll()?.capacity())
    }

    /// The address of rank `rank`'s buffer in this process.
    fn buffer_address(&self, rank: i64) -> PyResult<usize> {
        Ok(self.coll()?.memory().buffer_ptr(rank).or_raise()? as usize)
    }

    /// The buffer offset of the half the next collective uses (for a
    /// collective written in Python: it writes there, barriers, reads).
    fn next_region(&self) -> PyResult<usize> {
        Ok(self.coll()?.next_region())
    }

    #[pyo3(signature = (timeout=None))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        py.allow_threads(|| c.memory().barrier(0, t, 0)).or_raise()
    }

    /// Reduces `numel` elements of `dtype` (a torch dtype name without
    /// `torch.`) at address `input` on every rank into `output` here.
    #[pyo3(signature = (input, output, numel, dtype, op, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        input: usize,
        output: usize,
        numel: usize,
        dtype: &str,
        op: &str,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        let (elem, op) = (Elem::from_name(dtype).or_raise()?, ReduceOp::from_name(op).or_raise()?);
        // SAFETY: the wrapper passes the addresses of live contiguous
        // tensors of `numel` elements of `dtype`, equal or disjoint.
        py.allow_threads(|| unsafe { c.all_reduce(address(input), address(output), numel, elem, op, t) }).or_raise()
    }

    /// Copies `nbytes` at `data` on rank `root` into `data` here.
    #[pyo3(signature = (root, data, nbytes, timeout=None))]
    fn broadcast(&self, py: Python<'_>, root: i64, data: usize, nbytes: usize, timeout: Option<f64>) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        let root = usize::try_from(root).map_err(|_| invalid(format!("broadcast source rank {root} is negative")))?;
        // SAFETY: the wrapper passes a live contiguous tensor of `nbytes`.
        py.allow_threads(|| unsafe { c.broadcast(root, address(data), nbytes, t) }).or_raise()
    }

    /// Copies every rank's `nbytes` at `input` to `outputs[rank]` here.
    /// `symmetric` is `(allocation, size, offset, buffers)` when `input`
    /// lies at `offset` in a symmetric allocation of the group: `buffers`
    /// are its addresses for every rank, `allocation` names it alike on
    /// every rank. Peers then read it in place (when every rank's input
    /// lies in the same allocation); returns whether they did.
    #[pyo3(signature = (input, nbytes, outputs, timeout=None, symmetric=None))]
    fn all_gather(
        &self,
        py: Python<'_>,
        input: usize,
        nbytes: usize,
        outputs: Vec<usize>,
        timeout: Option<f64>,
        symmetric: Option<(u64, usize, usize, Vec<usize>)>,
    ) -> PyResult<bool> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        py.allow_threads(|| {
            let outs: Vec<*mut u8> = outputs.iter().map(|&a| address(a)).collect();
            let buffers: Vec<*const u8> =
                symmetric.as_ref().map(|s| s.3.iter().map(|&a| address(a) as *const u8).collect()).unwrap_or_default();
            let sym =
                symmetric.as_ref().map(|&(allocation, size, offset, _)| SymmetricInput { allocation, size, offset, buffers: &buffers });
            // SAFETY: the wrapper passes live contiguous tensors of
            // `nbytes`, the outputs disjoint from each other, and a
            // symmetric block's live buffers with `input` inside its own.
            unsafe { c.all_gather(address(input), nbytes, &outs, sym, t) }
        })
        .or_raise()
    }

    /// Unmaps the peers and frees the block; views over it must be gone.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.state.lock().unwrap_or_else(|p| p.into_inner()).take();
        match taken {
            Some((ptr, coll)) => {
                drop(coll);
                py.allow_threads(|| symm::free(ptr as *mut u8)).or_raise()
            }
            None => Ok(()),
        }
    }
}

impl Drop for SymmScratch {
    fn drop(&mut self) {
        if let Some((ptr, coll)) = self.state.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            drop(coll);
            let _ = symm::free(ptr as *mut u8);
        }
    }
}
