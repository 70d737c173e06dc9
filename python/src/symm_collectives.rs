//! The scratch block of a `storage_sharing.symm` group and its collectives,
//! run in Rust without the GIL. Tensors come in as addresses from the
//! Python wrapper, which checks their sizes and keeps them alive.

use crate::errors::{invalid, OrRaise};
use crate::symm::{alloc_block, timeout_of};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use storage_sharing::symm;
use storage_sharing::symm::collective_header::{Call, Kind};
use storage_sharing::symm::cpu_collectives::{CpuCollectives, Items, SymmetricInput};
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

    /// A barrier that is also a collective call: it fails on every rank
    /// when another rank is in another collective.
    #[pyo3(signature = (timeout=None))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        py.allow_threads(|| c.barrier(t)).or_raise()
    }

    /// A plain barrier between the steps of a collective written in
    /// Python (it takes no turn and posts nothing).
    #[pyo3(signature = (timeout=None))]
    fn sync(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        py.allow_threads(|| c.memory().barrier(0, t, 0)).or_raise()
    }

    /// Checks with every rank that they all make the same call (`kind`
    /// as "all_reduce", "broadcast", ...; `numel` elements of `dtype`,
    /// `itemsize` bytes each; `op` or `root` where they matter), raising on
    /// every rank when they do not. In the half at `region` (a collective
    /// written in Python, after its data is there), or in a turn of its own.
    #[pyo3(signature = (kind, dtype, numel, itemsize, op=None, root=None, timeout=None, region=None))]
    #[allow(clippy::too_many_arguments)]
    fn agree(
        &self,
        py: Python<'_>,
        kind: &str,
        dtype: &str,
        numel: usize,
        itemsize: usize,
        op: Option<&str>,
        root: Option<usize>,
        timeout: Option<f64>,
        region: Option<usize>,
    ) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        let mut call = Call::new(Kind::from_name(kind).or_raise()?, dtype, numel, itemsize);
        if let Some(op) = op {
            call = call.with_op(ReduceOp::from_name(op).or_raise()?);
        }
        if let Some(root) = root {
            call = call.with_root(root);
        }
        py.allow_threads(|| match region {
            Some(off) if off == 0 || off == c.capacity() => c.agree_at(off, &call, t),
            Some(off) => Err(storage_sharing::Error::new(
                storage_sharing::ErrorKind::InvalidArgument,
                format!("region {off} is not a half of the scratch block (0 or {})", c.capacity()),
            )),
            None => c.agree(&call, t),
        })
        .or_raise()
    }

    /// Tells every peer that this rank refused its arguments to a `kind`
    /// call (they raise, naming this rank), after the call's barrier.
    #[pyo3(signature = (kind, timeout=None))]
    fn refuse(&self, py: Python<'_>, kind: &str, timeout: Option<f64>) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        let call = Call::new(Kind::from_name(kind).or_raise()?, "", 0, 0);
        let why = storage_sharing::Error::new(storage_sharing::ErrorKind::InvalidArgument, "refused");
        py.allow_threads(|| drop(c.refuse(&call, why, t)));
        Ok(())
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

    /// Copies `numel` elements of `dtype` (`itemsize` bytes each) at
    /// `data` on rank `root` into `data` here.
    #[pyo3(signature = (root, data, numel, dtype, itemsize, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast(
        &self,
        py: Python<'_>,
        root: i64,
        data: usize,
        numel: usize,
        dtype: &str,
        itemsize: usize,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        let root = usize::try_from(root).map_err(|_| invalid(format!("broadcast source rank {root} is negative")))?;
        let items = Items { dtype, numel, itemsize };
        // SAFETY: the wrapper passes a live contiguous tensor of `numel`
        // elements of `itemsize` bytes.
        py.allow_threads(|| unsafe { c.broadcast(root, address(data), items, t) }).or_raise()
    }

    /// Copies every rank's `numel` elements of `dtype` (`itemsize` bytes
    /// each) at `input` to `outputs[rank]` here. `symmetric` is
    /// `(allocation, size, offset, buffers)` when `input` lies at `offset`
    /// in a symmetric allocation of the group: `buffers` are its addresses
    /// for every rank, `allocation` names it alike on every rank. Peers then
    /// read it in place (when every rank's input lies in the same
    /// allocation); returns whether they did.
    #[pyo3(signature = (input, numel, dtype, itemsize, outputs, timeout=None, symmetric=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        py: Python<'_>,
        input: usize,
        numel: usize,
        dtype: &str,
        itemsize: usize,
        outputs: Vec<usize>,
        timeout: Option<f64>,
        symmetric: Option<(u64, usize, usize, Vec<usize>)>,
    ) -> PyResult<bool> {
        let (c, t) = (self.coll()?, timeout_of(timeout)?);
        let items = Items { dtype, numel, itemsize };
        py.allow_threads(|| {
            let outs: Vec<*mut u8> = outputs.iter().map(|&a| address(a)).collect();
            let buffers: Vec<*const u8> =
                symmetric.as_ref().map(|s| s.3.iter().map(|&a| address(a) as *const u8).collect()).unwrap_or_default();
            let sym =
                symmetric.as_ref().map(|&(allocation, size, offset, _)| SymmetricInput { allocation, size, offset, buffers: &buffers });
            // SAFETY: the wrapper passes live contiguous tensors of
            // `numel` elements, the outputs disjoint from each other, and a
            // symmetric block's live buffers with `input` inside its own.
            unsafe { c.all_gather(address(input), items, &outs, sym, t) }
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
