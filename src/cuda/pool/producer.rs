//! The producer's pool: segments, the blocks placed in them, the tensors
//! described over them, and the update side of the version protocol.

use super::control::ControlWriter;
use super::handle::PoolHandle;
use super::inner::{Layout, PoolInner};
use super::lock;
use super::manifest::{view_extent, Manifest, SegmentEntry, StorageEntry, TensorEntry, MAX_NAME};
use super::options::{PoolDevice, PoolKind, PoolOptions};
use super::placement::Placement;
use super::server::Server;
use crate::content_store::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A tensor to describe in the manifest: a view of the storage that
/// starts at `storage_ptr` (inside the pool) and holds `storage_nbytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub storage_ptr: u64,
    pub storage_nbytes: usize,
    pub dtype: Dtype,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    /// In elements.
    pub storage_offset: i64,
}

/// The state of the update side.
#[derive(Default)]
struct Updating {
    open: bool,
    last_event: Option<u64>,
}

/// A pool of device memory whose tensors are shared whole (see the module docs).
pub struct Pool {
    pub(crate) inner: Arc<PoolInner>,
    updating: Mutex<Updating>,
    server: Mutex<Option<Server>>,
    /// The fork generation it was made in: a forked child's copy is inert.
    generation: u64,
}

impl Pool {
    pub fn new(opts: PoolOptions) -> Result<Pool> {
        opts.validate()?;
        let backend = super::backend_for(opts.device, opts.kind)?;
        let (control, control_fd) = ControlWriter::create(opts.max_consumers)?;
        let layout = Layout {
            placement: Placement::default(),
            segments: Vec::new(),
            storages: Vec::new(),
            storage_by_ptr: HashMap::new(),
            tensors: Vec::new(),
            names: HashMap::new(),
            frozen: None,
        };
        let inner = Arc::new(PoolInner {
            opts,
            backend,
            control,
            control_fd,
            layout: Mutex::new(layout),
            consumers: Mutex::new((0..opts.max_consumers).map(|_| None).collect()),
            closing: AtomicBool::new(false),
            linger: AtomicBool::new(false),
        });
        super::inner::register(&inner);
        Ok(Pool {
            inner,
            updating: Mutex::new(Updating::default()),
            server: Mutex::new(None),
            generation: crate::fork_safe::fork_generation(),
        })
    }

    pub fn options(&self) -> PoolOptions {
        self.inner.opts
    }

    /// A block of at least `nbytes` bytes, 512-aligned; the pool grows by
    /// a segment when none has room (only before export).
    pub fn alloc(&self, nbytes: usize) -> Result<u64> {
        self.check_same_process()?;
        self.inner.alloc(nbytes)
    }

    /// Frees a block from [`Pool::alloc`].
    pub fn free_block(&self, ptr: u64) -> Result<()> {
        self.check_same_process()?;
        self.inner.free_block(ptr)
    }

    /// Adds a named tensor to the manifest. Its storage must lie inside
    /// the pool and the view inside its storage; storages are shared by
    /// the views that start at the same address.
    pub fn add_tensor(&self, name: &str, t: &TensorSpec) -> Result<()> {
        self.check_same_process()?;
        let invalid = |msg: String| Error::new(ErrorKind::InvalidArgument, format!("tensor {name:?}: {msg}"));
        if name.is_empty() || name.len() > MAX_NAME || name.contains('\0') {
            return Err(invalid(format!("a name must be 1 to {MAX_NAME} bytes without NUL")));
        }
        let need = view_extent(&t.sizes, &t.strides, t.storage_offset, t.dtype.itemsize()).map_err(invalid)?;
        if need > t.storage_nbytes as u64 {
            return Err(invalid(format!("the view reaches {need} bytes into a storage of {} bytes", t.storage_nbytes)));
        }
        let mut layout = lock(&self.inner.layout);
        if layout.frozen.is_some() {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("cannot add tensor {name:?}: the manifest is frozen after export")));
        }
        if layout.names.contains_key(name) {
            return Err(invalid("a tensor of this name is in the pool already".into()));
        }
        let storage = if t.storage_nbytes == 0 {
            layout.storages.push(StorageEntry { segment: 0, offset: 0, nbytes: 0 });
            layout.storages.len() as u32 - 1
        } else if let Some(&index) = layout.storage_by_ptr.get(&t.storage_ptr) {
            let have = layout.storages[index as usize].nbytes;
            if have != t.storage_nbytes as u64 {
                return Err(invalid(format!(
                    "its storage at 0x{:x} was added before with {have} bytes, now with {}",
                    t.storage_ptr, t.storage_nbytes
                )));
            }
            index
        } else {
            let (segment, offset) = PoolInner::find(&layout, t.storage_ptr, t.storage_nbytes).ok_or_else(|| {
                invalid(format!(
                    "its storage (0x{:x}, {} bytes) does not lie inside one segment of this pool",
                    t.storage_ptr, t.storage_nbytes
                ))
            })?;
            layout.storages.push(StorageEntry { segment: segment as u32, offset: offset as u64, nbytes: t.storage_nbytes as u64 });
            let index = layout.storages.len() as u32 - 1;
            layout.storage_by_ptr.insert(t.storage_ptr, index);
            index
        };
        let entry = TensorEntry {
            name: name.to_string(),
            storage,
            dtype: t.dtype,
            sizes: t.sizes.clone(),
            strides: t.strides.clone(),
            storage_offset: t.storage_offset,
        };
        let at = layout.tensors.len();
        layout.tensors.push(entry);
        layout.names.insert(name.to_string(), at);
        Ok(())
    }

    /// The manifest as it stands (frozen or not).
    pub(crate) fn manifest(layout: &Layout) -> Manifest {
        Manifest {
            segments: layout.segments.iter().map(|s| SegmentEntry { size: s.size() as u64, handle: s.handle() }).collect(),
            storages: layout.storages.clone(),
            tensors: layout.tensors.clone(),
        }
    }

    /// Freezes the manifest, starts the server (once) and publishes
    /// version 1 if nothing was published yet. Every call returns the same handle.
    pub fn export(&self) -> Result<PoolHandle> {
        self.check_same_process()?;
        let mut server = lock(&self.server);
        if let Some(s) = server.as_ref() {
            return Ok(self.handle_for(s.socket_name()));
        }
        {
            let mut layout = lock(&self.inner.layout);
            let manifest = Self::manifest(&layout);
            manifest.validate(ErrorKind::InvalidArgument)?;
            layout.frozen = Some(Arc::new(manifest.encode()));
        }
        if self.inner.control.version() == 0 {
            self.start_update(Some(Duration::ZERO))?;
            self.publish_update(0)?;
        }
        let s = Server::start(self.inner.clone())?;
        let handle = self.handle_for(s.socket_name());
        *server = Some(s);
        Ok(handle)
    }

    fn handle_for(&self, socket_name: &str) -> PoolHandle {
        PoolHandle {
            socket_name: socket_name.to_string(),
            producer_pid: std::process::id() as i32,
            producer_start: crate::proc_identity::me().1,
            device: self.inner.opts.device,
            kind: self.inner.opts.kind,
        }
    }

    /// Opens an update: readers are kept out, and this waits (up to
    /// `timeout`) until no consumer holds a version. Publish with
    /// [`UpdateGuard::publish`]; dropping the guard unpublished leaves the
    /// pool torn until the next publish.
    pub fn begin_update(&self, timeout: Timeout) -> Result<UpdateGuard<'_>> {
        self.start_update(timeout)?;
        Ok(UpdateGuard { pool: self, done: false })
    }

    /// [`Pool::begin_update`] without a guard (for the C and Python APIs,
    /// whose update spans calls): end it with [`Pool::publish_update`] or
    /// [`Pool::abandon_update`].
    pub fn start_update(&self, timeout: Timeout) -> Result<()> {
        self.check_same_process()?;
        // Whether an update is open is this process's own knowledge: no
        // word a consumer can write decides it.
        let mut u = lock(&self.updating);
        if u.open {
            return Err(Error::new(ErrorKind::Busy, "an update of this pool is open already; publish it first"));
        }
        let control = &self.inner.control;
        control.begin_writing();
        let start = Instant::now();
        loop {
            // Only live connections' slots count: a consumer that went
            // took its slot, and whatever it wrote there, with it.
            let holders = self.inner.holders();
            let Some((_, first)) = holders.first() else { break };
            if timeout.is_some_and(|t| start.elapsed() >= t) {
                control.cancel_writing();
                let pids: Vec<String> = holders.iter().map(|(pid, _)| pid.to_string()).collect();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "begin_update: {} consumer(s) (pid {}) still hold version {} after {:?}; they must release it first",
                        holders.len(),
                        pids.join(", "),
                        control.version(),
                        timeout.unwrap_or_default()
                    ),
                ));
            }
            // Every holder must let go; waiting for one at a time costs
            // the longest hold, not their sum. Read before looking, so a
            // release in between cuts the sleep short.
            let seen = first.releases();
            if first.held() != 0 {
                first.wait_release(seen, timeout.map_or(Duration::MAX, |t| t.saturating_sub(start.elapsed())));
            }
        }
        u.open = true;
        Ok(())
    }

    /// Publishes the open update: records an event on `stream` (CUDA),
    /// bumps the version and lets readers in. Returns the new version.
    pub fn publish_update(&self, stream: u64) -> Result<u64> {
        self.publish_update_as(stream, None)
    }

    /// [`Pool::publish_update`] under `version` (at least 1, below 2^62)
    /// instead of the next one when given: a replica of a pool on another
    /// machine publishes its source's version, so a reader anywhere can
    /// tell which step it reads. The number may go back (a new source).
    pub fn publish_update_as(&self, stream: u64, version: Option<u64>) -> Result<u64> {
        self.check_same_process()?;
        if let Some(v) = version.filter(|v| !(1..1 << 62).contains(v)) {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("publish: version {v} is outside 1..2^62")));
        }
        let mut u = lock(&self.updating);
        if !u.open {
            return Err(Error::new(ErrorKind::InvalidArgument, "publish: no update of this pool is open (call begin_update first)"));
        }
        let event = self.inner.backend.record_event(stream)?;
        let handle = event.as_ref().map(|e| &e.handle);
        let version = match version {
            Some(v) => self.inner.control.publish_as(handle, v),
            None => self.inner.control.publish(handle),
        };
        if let Some(old) = std::mem::replace(&mut u.last_event, event.map(|e| e.id)) {
            self.inner.backend.destroy_event(old);
        }
        u.open = false;
        Ok(version)
    }

    /// Ends the open update without publishing: the pool is torn (acquire
    /// fails) until the next publish.
    pub fn abandon_update(&self) {
        if self.check_same_process().is_err() {
            return;
        }
        let mut u = lock(&self.updating);
        if u.open {
            self.inner.control.abandon();
            u.open = false;
        }
    }

    /// The version last published (0 before the first).
    pub fn version(&self) -> u64 {
        self.inner.control.version()
    }

    /// Whether an update was abandoned since the last publish (readers
    /// are refused until the next one): a pool in this state must not be
    /// sent to replicas as if it were a version.
    pub fn torn(&self) -> bool {
        self.inner.control.torn()
    }

    /// Consumer processes connected now.
    pub fn consumers(&self) -> usize {
        self.inner.connected()
    }

    /// (address, bytes) of each segment, in order.
    pub fn segments(&self) -> Vec<(u64, usize)> {
        lock(&self.inner.layout).segments.iter().map(|s| (s.addr(), s.size())).collect()
    }

    /// PyTorch's 8-tuple of each segment (`torch.UntypedStorage._new_shared_cuda`),
    /// for consumers with only stock PyTorch: Legacy pools on CUDA only
    /// (else `Unsupported`). Each call hands out new ref-counter slots; a
    /// segment's memory outlives the pool until every slot is released.
    pub fn stock_segments(&self) -> Result<Vec<crate::cuda::IpcHandle>> {
        if self.inner.opts.kind != PoolKind::Legacy || self.inner.opts.device == PoolDevice::Host {
            return Err(Error::new(ErrorKind::Unsupported, "stock PyTorch tuples exist for Legacy pools on a CUDA device only"));
        }
        lock(&self.inner.layout).segments.iter().map(|s| s.stock_share()).collect()
    }

    pub fn device(&self) -> PoolDevice {
        self.inner.opts.device
    }

    pub fn kind(&self) -> PoolKind {
        self.inner.opts.kind
    }
}

impl Pool {
    /// A forked child's copy shares the parent's control block, server
    /// wake-up descriptor and memory: it must change none of them.
    fn check_same_process(&self) -> Result<()> {
        crate::fork_safe::check_made_here(self.generation, || {
            "this pool was made before a fork: only the process that made it may change, export or update it".into()
        })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if self.check_same_process().is_err() {
            // Dropping the child's copy would stop the parent's server
            // (their wake-up eventfd is one) and mark its updates torn.
            std::mem::forget(self.inner.clone());
            std::mem::forget(lock(&self.server).take());
            return;
        }
        // An update left open (C and Python callers) may have written half.
        self.abandon_update();
        self.inner.closing.store(true, Ordering::SeqCst);
        // Legacy memory would be freed under its consumers' mappings: it
        // lives on, served, until they have gone. VMM and host memory are
        // refcounted by the driver and the kernel.
        let linger = self.inner.opts.kind == PoolKind::Legacy && self.consumers() > 0;
        self.inner.linger.store(linger, Ordering::SeqCst);
        let server = lock(&self.server).take();
        match server {
            Some(s) if linger => s.linger(),
            other => drop(other),
        }
        super::inner::forget(&self.inner);
        let event = lock(&self.updating).last_event.take();
        if let Some(ev) = event {
            self.inner.backend.destroy_event(ev);
        }
    }
}

/// An open update (see [`Pool::begin_update`]).
pub struct UpdateGuard<'a> {
    pool: &'a Pool,
    done: bool,
}

impl UpdateGuard<'_> {
    /// Publishes the update on `stream`; returns the new version.
    pub fn publish(mut self, stream: u64) -> Result<u64> {
        let v = self.pool.publish_update(stream);
        if v.is_ok() {
            self.done = true;
        }
        v
    }
}

impl Drop for UpdateGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.pool.abandon_update();
        }
    }
}
