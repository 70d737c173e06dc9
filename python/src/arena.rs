//! The shareable arena: a producer's `Arena` and its blocks, the `Handle`
//! a block is shared by, and a consumer's `NativeView` of a shared block.
//!
//! Objects remember the process that made them: after fork(), a child's
//! copy of a parent's arena, block or view is left alone when dropped
//! (freeing it would retire the parent's segments or release the parent's
//! holds, which live in shared memory).

use crate::errors::{closed, invalid, OrRaise};
use crate::fd_server;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage_sharing::arena::{self, Arena, ArenaHandle, ArenaOptions, RemoteView, Strategy};

fn pid() -> u32 {
    std::process::id()
}

/// The arena a Python `Arena` and its fd server share; `None` once closed.
pub type SharedArena = Arc<Mutex<Option<Arena>>>;

#[pyclass(frozen, module = "storage_sharing._native", name = "Arena")]
pub struct PyArena {
    arena: ManuallyDrop<SharedArena>,
    pid: u32,
    fd_server: Mutex<Option<String>>,
}

impl PyArena {
    fn get(&self) -> PyResult<Arena> {
        if self.pid != pid() {
            return Err(invalid(format!("this arena belongs to process {} (inherited through fork): make a new one", self.pid)));
        }
        self.arena.lock().unwrap_or_else(|p| p.into_inner()).clone().ok_or_else(|| closed("arena"))
    }
}

impl Drop for PyArena {
    fn drop(&mut self) {
        if self.pid == pid() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.arena) };
        }
    }
}

fn parse_strategy(s: &str) -> PyResult<Strategy> {
    match s {
        "fd" => Ok(Strategy::Fd),
        "name" => Ok(Strategy::Name),
        other => Err(invalid(format!("arena strategy must be 'fd' or 'name', got {other:?}"))),
    }
}

fn strategy_name(s: Strategy) -> &'static str {
    match s {
        Strategy::Fd => "fd",
        Strategy::Name => "name",
    }
}

#[pymethods]
impl PyArena {
    #[new]
    #[pyo3(signature = (segment_size=None, strategy="fd", max_holds=None, large_threshold=None))]
    fn new(
        py: Python<'_>,
        segment_size: Option<usize>,
        strategy: &str,
        max_holds: Option<usize>,
        large_threshold: Option<usize>,
    ) -> PyResult<Self> {
        let d = ArenaOptions::default();
        let opts = ArenaOptions {
            segment_size: segment_size.unwrap_or(d.segment_size),
            strategy: parse_strategy(strategy)?,
            max_holds: max_holds.unwrap_or(d.max_holds),
            large_threshold: large_threshold.unwrap_or(d.large_threshold),
        };
        let arena = py.allow_threads(|| Arena::new(opts)).or_raise()?;
        Ok(PyArena { arena: ManuallyDrop::new(Arc::new(Mutex::new(Some(arena)))), pid: pid(), fd_server: Mutex::new(None) })
    }

    /// A block of `size` bytes aligned to `align`.
    #[pyo3(signature = (size, align=64))]
    fn alloc(&self, py: Python<'_>, size: usize, align: usize) -> PyResult<NativeBlock> {
        let a = self.get()?;
        let address = py.allow_threads(|| a.alloc(size, align).map(|p| p as usize)).or_raise()?;
        Ok(NativeBlock { arena: ManuallyDrop::new(a), address, size, pid: pid(), freed: Mutex::new(false) })
    }

    /// Shares the live block at `address`: one hold, one handle.
    fn share(&self, address: usize) -> PyResult<Handle> {
        let a = self.get()?;
        a.share(address as *mut u8).map(Handle).or_raise()
    }

    /// Cancels a share that will never be opened.
    fn unshare(&self, handle: &Handle) -> PyResult<()> {
        self.get()?.unshare(&handle.0).or_raise()
    }

    /// The descriptor of a by-fd segment, owned by the arena (do not close).
    fn segment_fd(&self, segment_id: u64) -> PyResult<i32> {
        self.get()?.segment_fd(segment_id).or_raise()
    }

    /// Size the block at `address` was carved with.
    fn block_size(&self, address: usize) -> PyResult<usize> {
        self.get()?.block_size(address as *mut u8).or_raise()
    }

    /// Releases dead consumers' holds; returns (reclaimed holds, recycled blocks).
    fn collect(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        let a = self.get()?;
        let r = py.allow_threads(|| a.collect()).or_raise()?;
        Ok((r.reclaimed_holds, r.recycled_blocks))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get()?.stats().or_raise()?;
        let d = PyDict::new(py);
        d.set_item("segments", s.segments)?;
        d.set_item("live_blocks", s.live_blocks)?;
        d.set_item("deferred_blocks", s.deferred_blocks)?;
        d.set_item("segment_bytes", s.segment_bytes)?;
        d.set_item("reserved_bytes", s.reserved_bytes)?;
        Ok(d)
    }

    #[getter]
    fn strategy(&self) -> PyResult<&'static str> {
        Ok(strategy_name(self.get()?.options().strategy))
    }

    #[getter]
    fn closed(&self) -> bool {
        self.pid != pid() || self.arena.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// The abstract Unix socket this process answers segment-fd requests
    /// on (started on first use, by-fd arenas only): what `open_shared`
    /// on the consumer's side connects to.
    fn fd_server_address(&self) -> PyResult<String> {
        self.get()?;
        let mut s = self.fd_server.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = s.as_ref() {
            return Ok(a.clone());
        }
        let address = fd_server::start(Arc::clone(&self.arena)).or_raise()?;
        *s = Some(address.clone());
        Ok(address)
    }

    /// Gives the arena up: its segments go when the last block over them goes.
    fn close(&self) {
        if self.pid == pid() {
            let taken = self.arena.lock().unwrap_or_else(|p| p.into_inner()).take();
            drop(taken);
            if let Some(address) = self.fd_server.lock().unwrap_or_else(|p| p.into_inner()).take() {
                fd_server::stop(&address);
            }
        }
    }
}

/// A producer's block. Freed when this object goes (or by `free()`).
#[pyclass(frozen, module = "storage_sharing._native")]
pub struct NativeBlock {
    arena: ManuallyDrop<Arena>,
    address: usize,
    size: usize,
    pid: u32,
    freed: Mutex<bool>,
}

impl NativeBlock {
    fn release(&self) -> PyResult<()> {
        let mut freed = self.freed.lock().unwrap_or_else(|p| p.into_inner());
        if *freed || self.pid != pid() {
            return Ok(());
        }
        *freed = true;
        self.arena.free(self.address as *mut u8).or_raise()
    }
}

impl Drop for NativeBlock {
    fn drop(&mut self) {
        if self.pid == pid() {
            let freed = *self.freed.get_mut().unwrap_or_else(|p| p.into_inner());
            if !freed {
                let _ = self.arena.free(self.address as *mut u8);
            }
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.arena) };
        }
    }
}

#[pymethods]
impl NativeBlock {
    #[getter]
    fn address(&self) -> usize {
        self.address
    }

    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    #[getter]
    fn freed(&self) -> bool {
        *self.freed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One hold on this block, as a handle another process opens once.
    fn share(&self) -> PyResult<Handle> {
        if self.freed() {
            return Err(closed("block"));
        }
        if self.pid != pid() {
            return Err(invalid(format!("this block belongs to process {} (inherited through fork)", self.pid)));
        }
        self.arena.share(self.address as *mut u8).map(Handle).or_raise()
    }

    fn free(&self) -> PyResult<()> {
        self.release()
    }
}

/// A shared block's handle: 112 bytes, pickled as those bytes.
#[pyclass(frozen, module = "storage_sharing._native")]
#[derive(Clone)]
pub struct Handle(pub ArenaHandle);

#[pymethods]
impl Handle {
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Handle> {
        ArenaHandle::decode(data).map(Handle).or_raise()
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.encode())
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let from_bytes = slf.get_type().getattr("from_bytes")?;
        Ok((from_bytes, (slf.get().__bytes__(slf.py()),)))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.downcast::<Handle>().is_ok_and(|o| o.get().0 == self.0)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.0.encode().hash(&mut h);
        h.finish()
    }

    fn __repr__(&self) -> String {
        let h = &self.0;
        format!(
            "Handle(strategy={:?}, producer_pid={}, segment_id={}, offset={}, size={}, slot={}, generation={}{})",
            strategy_name(h.strategy),
            h.key.producer_pid,
            h.key.segment_id,
            h.offset,
            h.size,
            h.slot,
            h.generation,
            if h.name.is_empty() { String::new() } else { format!(", name={:?}", h.name) }
        )
    }

    #[getter]
    fn strategy(&self) -> &'static str {
        strategy_name(self.0.strategy)
    }
    #[getter]
    fn producer_pid(&self) -> i32 {
        self.0.key.producer_pid
    }
    #[getter]
    fn segment_id(&self) -> u64 {
        self.0.key.segment_id
    }
    #[getter]
    fn offset(&self) -> u64 {
        self.0.offset
    }
    #[getter]
    fn size(&self) -> u64 {
        self.0.size
    }
    #[getter]
    fn slot(&self) -> u32 {
        self.0.slot
    }
    #[getter]
    fn generation(&self) -> u32 {
        self.0.generation
    }
    #[getter]
    fn name(&self) -> String {
        self.0.name.clone()
    }
}

/// A consumer's view of a shared block: holds it until this object goes.
#[pyclass(frozen, module = "storage_sharing._native")]
pub struct NativeView {
    view: ManuallyDrop<RemoteView>,
    pid: u32,
}

impl Drop for NativeView {
    fn drop(&mut self) {
        if self.pid == pid() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.view) };
        }
    }
}

#[pymethods]
impl NativeView {
    #[getter]
    fn address(&self) -> usize {
        self.view.data() as usize
    }

    #[getter]
    fn size(&self) -> usize {
        self.view.size()
    }

    #[getter]
    fn producer_pid(&self) -> i32 {
        self.view.segment().producer_pid
    }
}

fn view(v: RemoteView) -> NativeView {
    NativeView { view: ManuallyDrop::new(v), pid: pid() }
}

/// Opens a handle whose segment is mapped here already or is by name.
#[pyfunction]
pub fn open_remote(py: Python<'_>, handle: &Handle) -> PyResult<NativeView> {
    let h = handle.0.clone();
    py.allow_threads(|| arena::open_remote(&h)).map(view).or_raise()
}

/// Opens a handle, first asking the producer's fd server at `address` for
/// the segment's descriptor if this process has not mapped it yet.
#[pyfunction]
#[pyo3(signature = (handle, address, timeout=30.0))]
pub fn open_shared(py: Python<'_>, handle: &Handle, address: &str, timeout: f64) -> PyResult<NativeView> {
    if !(timeout > 0.0 && timeout.is_finite()) {
        return Err(invalid(format!("timeout must be a positive number of seconds, got {timeout}")));
    }
    let h = handle.0.clone();
    let address = address.to_string();
    py.allow_threads(|| {
        // Mapped and opened under one lock: a large block's segment goes
        // with its last view, which another thread may drop meanwhile.
        let fetch_and_open = || {
            let fd =
                fd_server::fetch(&address, h.key.producer_pid, h.key.producer_start, h.key.segment_id, Duration::from_secs_f64(timeout))?;
            arena::remote::open_with_fd(&h, fd)
        };
        if h.strategy == Strategy::Fd && !arena::remote::has_segment(&h) {
            return fetch_and_open();
        }
        match arena::open_remote(&h) {
            Err(e) if e.kind() == storage_sharing::ErrorKind::NotFound && h.strategy == Strategy::Fd => fetch_and_open(),
            r => r,
        }
    })
    .map(view)
    .or_raise()
}

/// A new handle for the block this process holds through `held` (a
/// handle it opened), made by the block's producer, whose fd server is at
/// `address`: what a received block is sent on as.
#[pyfunction]
#[pyo3(signature = (held, address, timeout=30.0))]
pub fn reshare(py: Python<'_>, held: &Handle, address: &str, timeout: f64) -> PyResult<Handle> {
    if !(timeout > 0.0 && timeout.is_finite()) {
        return Err(invalid(format!("timeout must be a positive number of seconds, got {timeout}")));
    }
    let h = held.0.clone();
    let address = address.to_string();
    py.allow_threads(|| crate::reshare::request(&address, &h, Duration::from_secs_f64(timeout))).map(Handle).or_raise()
}

/// Maps the by-fd segment of `handle` from a duplicate of `fd` (the
/// caller keeps `fd`).
#[pyfunction]
pub fn import_segment_fd(handle: &Handle, fd: i32) -> PyResult<()> {
    // SAFETY: dup has no memory-safety preconditions; a bad fd gives -1.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(storage_sharing::Error::last_os_error(format!("dup of fd {fd}"))).or_raise();
    }
    // SAFETY: dup is a new descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(dup) };
    arena::import_segment_fd(&handle.0, owned).or_raise()
}

/// Whether this process has the segment of `handle` mapped.
#[pyfunction]
pub fn has_segment(handle: &Handle) -> bool {
    arena::remote::has_segment(&handle.0)
}

/// Unmaps idle segments of retired or dead producers; returns how many.
#[pyfunction]
pub fn trim_remote_cache(py: Python<'_>) -> usize {
    py.allow_threads(arena::trim_cache)
}

/// Remote segments this process has mapped.
#[pyfunction]
pub fn remote_cache_size() -> usize {
    arena::cached_segments()
}

/// Shares `block` and sends its handle over the connected Unix socket
/// `sock` (the segment's fd the first time this peer gets that segment).
#[pyfunction]
pub fn send_block(py: Python<'_>, arena: &PyArena, sock: i32, block: &NativeBlock) -> PyResult<()> {
    let a = arena.get()?;
    let p = block.address;
    py.allow_threads(|| arena::transport::send_block(&a, sock, p as *mut u8)).or_raise()
}

/// Receives one block sent by `send_block` and opens it.
#[pyfunction]
pub fn recv_block(py: Python<'_>, sock: i32) -> PyResult<NativeView> {
    py.allow_threads(|| arena::transport::recv_block(sock)).map(view).or_raise()
}
