//! The consumer side: [`Weights::open`] connects to the producer's server,
//! checks who answers, receives the control block, the segments and the
//! manifest, validates everything and only then maps; the connection
//! stays open as this consumer's liveness (and tells it when the producer
//! is gone). [`Weights::acquire`] and [`Weights::release`] are the reader
//! side of the version protocol.

use super::backend::{MappedSegment, PoolBackend};
use super::control::{ControlReader, Hold, HoldSlot};
use super::handle::PoolHandle;
use super::lock;
use super::manifest::{Manifest, MAX_BYTES, MAX_SEGMENTS};
use super::options::PoolKind;
use super::wire::{Hello, HELLO_BYTES, STATUS_OK};
use crate::content_store::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::parent_only::ParentOnlyFd;
use crate::fdpass::{abstract_socket, peer, recv_fds};
use crate::store::Timeout;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// One tensor of an opened pool, a view into a mapped segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenTensor {
    pub name: String,
    pub storage_index: usize,
    pub segment: usize,
    /// Address of its storage's first byte here (0 for an empty storage).
    pub storage_ptr: u64,
    pub storage_nbytes: usize,
    pub dtype: Dtype,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    pub storage_offset: i64,
}

/// This process's readers of the version it holds: the slot is one per
/// process, so threads share the hold and the last to release lets go.
#[derive(Default)]
struct Readers {
    count: usize,
    version: u64,
    /// Reads open per thread: a thread that reads already re-enters at once.
    by_thread: HashMap<ThreadId, usize>,
}

impl Readers {
    fn join(&mut self) -> u64 {
        self.count += 1;
        *self.by_thread.entry(std::thread::current().id()).or_default() += 1;
        self.version
    }

    /// One read less, the caller's own if it has one; true when it was the last.
    fn leave(&mut self) -> bool {
        let me = std::thread::current().id();
        let whose = if self.by_thread.contains_key(&me) { Some(me) } else { self.by_thread.keys().next().copied() };
        if let Some(t) = whose {
            let n = self.by_thread.get_mut(&t).expect("a key just found");
            *n -= 1;
            if *n == 0 {
                self.by_thread.remove(&t);
            }
        }
        self.count -= 1;
        self.count == 0
    }

    fn reading_here(&self) -> bool {
        self.by_thread.contains_key(&std::thread::current().id())
    }
}

/// How long a thread that does not read yet waits for its process's reads
/// to end before it joins them, while the producer waits to write: long
/// enough for reads that end by themselves to let the update in, short
/// enough for a read that waits on this thread (a main thread whose
/// workers read) to cost only this much.
pub const JOIN_GRACE: Duration = Duration::from_millis(10);

/// A producer's pool opened in this process (see the module docs).
pub struct Weights {
    handle: PoolHandle,
    /// Not inherited by forked children (its hang-up is this process's death).
    conn: ParentOnlyFd,
    /// The fork generation it was opened in: a forked child's copy is inert.
    generation: u64,
    control: ControlReader,
    /// Where this process's hold is written (a page of its own).
    hold: HoldSlot,
    slot: usize,
    backend: Arc<dyn PoolBackend>,
    segments: Vec<Box<dyn MappedSegment>>,
    manifest: Manifest,
    tensors: Vec<OpenTensor>,
    readers: Mutex<Readers>,
    /// Notified when the process's last read ends.
    released: Condvar,
    gone: AtomicBool,
}

struct Deadline(Option<Instant>);

impl Deadline {
    fn new(timeout: Timeout) -> Deadline {
        Deadline(timeout.and_then(|t| Instant::now().checked_add(t)))
    }
    /// Milliseconds left for poll (-1: forever), 0 when past.
    fn poll_ms(&self) -> i32 {
        match self.0 {
            None => -1,
            Some(d) => d.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32,
        }
    }
    fn passed(&self) -> bool {
        self.0.is_some_and(|d| Instant::now() >= d)
    }
    fn left(&self) -> Option<Duration> {
        self.0.map(|d| d.saturating_duration_since(Instant::now()))
    }
}

fn gone_error(h: &PoolHandle) -> Error {
    Error::new(
        ErrorKind::PeerGone,
        format!(
            "the producer (pid {}) of pool {} is gone (its connection closed); the weights mapped here stay readable but get no more updates",
            h.producer_pid, h.socket_name
        ),
    )
}

/// Waits until `fd` is readable or the deadline passes.
fn wait_readable(fd: RawFd, deadline: &Deadline, h: &PoolHandle, what: &str) -> Result<()> {
    loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, deadline.poll_ms()) };
        if n > 0 {
            return Ok(());
        }
        if n < 0 && crate::error::errno() == libc::EINTR {
            continue;
        }
        if n < 0 {
            return Err(Error::last_os_error(format!("poll while {what}")));
        }
        return Err(Error::new(
            ErrorKind::Timeout,
            format!("timed out {what} from the producer (pid {}) of pool {}", h.producer_pid, h.socket_name),
        ));
    }
}

/// One message from the producer; a closed connection is PeerGone.
fn receive(fd: RawFd, buf: &mut [u8], max_fds: usize, deadline: &Deadline, h: &PoolHandle, what: &str) -> Result<(usize, Vec<OwnedFd>)> {
    wait_readable(fd, deadline, h, what)?;
    let (n, fds) = recv_fds(fd, buf, max_fds).map_err(|e| e.context(format!("opening pool {}", h.socket_name)))?;
    if n == 0 {
        return Err(gone_error(h));
    }
    Ok((n, fds))
}

/// Connects to the producer's socket. A full backlog (a burst of
/// consumers, or another user's flood of connections) is waited out until
/// the deadline: the server takes connections in turn and drops strangers'
/// at once.
fn connect(h: &PoolHandle, deadline: &Deadline) -> Result<OwnedFd> {
    let mut pause = Duration::from_micros(100);
    loop {
        let e = match abstract_socket::connect(&h.socket_name) {
            Ok(conn) => return Ok(conn),
            Err(e) => e,
        };
        match e.raw_os_error() {
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => {
                return Err(Error::new(
                    ErrorKind::PeerGone,
                    format!("no pool listens at {} (its producer, pid {}, is gone or dropped the pool)", h.socket_name, h.producer_pid),
                ))
            }
            Some(libc::EAGAIN) if !deadline.passed() => {
                std::thread::sleep(pause.min(deadline.left().unwrap_or(pause)));
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            Some(libc::EAGAIN) => {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "timed out connecting to pool {} of pid {}: its server's backlog stayed full (a burst of consumers, or connections of another process)",
                        h.socket_name, h.producer_pid
                    ),
                ))
            }
            _ => return Err(Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("connecting to pool {}", h.socket_name))),
        }
    }
}

impl Weights {
    /// Opens the pool `h` names: one connection and one message exchange,
    /// whatever the number of tensors. Errors: `PeerGone` (no producer
    /// listens), `Permission` (someone else answers at that name),
    /// `TooManyFiles` (no descriptors left here; nothing mapped),
    /// `Protocol` (malformed manifest), `Timeout`.
    pub fn open(h: &PoolHandle, timeout: Timeout) -> Result<Weights> {
        let deadline = Deadline::new(timeout);
        let conn = connect(h, &deadline)?;
        let generation = crate::fork_safe::fork_generation();
        let conn = ParentOnlyFd::new(conn);
        peer::expect_process_started(conn.as_raw_fd(), h.producer_pid, h.producer_start, &format!("pool socket {}", h.socket_name))?;
        let mut buf = [0u8; HELLO_BYTES + 512];
        let (n, mut fds) = receive(conn.as_raw_fd(), &mut buf, 2 + MAX_SEGMENTS, &deadline, h, "waiting for the pool")?;
        let hello = Hello::decode(&buf[..n])?;
        if hello.status != STATUS_OK {
            let why = String::from_utf8_lossy(&buf[HELLO_BYTES.min(n)..n]).into_owned();
            return Err(Error::new(ErrorKind::Busy, format!("pool {} refused this consumer: {why}", h.socket_name)));
        }
        let kind = PoolKind::from_code(hello.kind).map_err(|e| Error::new(ErrorKind::Protocol, e.to_string()))?;
        if kind != h.kind {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("pool {} is of kind {kind:?}, its handle says {:?}", h.socket_name, h.kind),
            ));
        }
        let segments = hello.segments as usize;
        // The control block, this consumer's hold page, and (Vmm) the segments.
        let want_fds = 2 + if kind == PoolKind::Vmm { segments } else { 0 };
        if segments > MAX_SEGMENTS || fds.len() != want_fds {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("pool {} sent {} descriptors for {segments} segments of kind {kind:?}", h.socket_name, fds.len()),
            ));
        }
        if hello.slot >= hello.slots {
            return Err(Error::new(ErrorKind::Protocol, format!("pool {} gave slot {} of {}", h.socket_name, hello.slot, hello.slots)));
        }
        let len = hello.manifest_len as usize;
        if hello.manifest_len > MAX_BYTES as u64 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("pool {} announced a manifest of {} bytes", h.socket_name, hello.manifest_len),
            ));
        }
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(len).map_err(|_| Error::new(ErrorKind::NoSpace, format!("no memory for a manifest of {len} bytes")))?;
        let mut chunk = vec![0u8; super::wire::CHUNK];
        while bytes.len() < len {
            let (n, _) = receive(conn.as_raw_fd(), &mut chunk, 0, &deadline, h, "receiving the manifest")?;
            if bytes.len() + n > len {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("pool {} sent more manifest bytes than the {len} announced", h.socket_name),
                ));
            }
            bytes.extend_from_slice(&chunk[..n]);
        }
        let manifest = Manifest::decode(&bytes).map_err(|e| e.context(format!("pool {}", h.socket_name)))?;
        if manifest.segments.len() != segments {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("pool {} announced {segments} segments, its manifest has {}", h.socket_name, manifest.segments.len()),
            ));
        }
        let segment_fds = fds.split_off(2);
        let control = ControlReader::open(&fds[0], hello.slots as usize)?;
        let hold = HoldSlot::open(&fds[1])?;
        drop(fds);
        let backend = super::backend_for(h.device, kind)?;
        let mapped = map_segments(&*backend, &manifest, segment_fds, kind)?;
        let tensors = open_tensors(&manifest, &mapped);
        Ok(Weights {
            handle: h.clone(),
            conn,
            generation,
            control,
            hold,
            slot: hello.slot as usize,
            backend,
            segments: mapped,
            manifest,
            tensors,
            readers: Mutex::new(Readers::default()),
            released: Condvar::new(),
            gone: AtomicBool::new(false),
        })
    }

    pub fn handle(&self) -> &PoolHandle {
        &self.handle
    }

    pub fn tensors(&self) -> &[OpenTensor] {
        &self.tensors
    }

    /// Where each segment is mapped here: (address, bytes).
    pub fn segments(&self) -> Vec<(u64, usize)> {
        self.segments.iter().map(|s| (s.addr(), s.size())).collect()
    }

    /// The version published last (0 before the first).
    pub fn version(&self) -> u64 {
        self.control.version()
    }

    /// Whether the producer is writing an update now (new holds wait,
    /// except those joining a hold this process has).
    pub fn update_pending(&self) -> bool {
        self.control.state() & super::control::WRITING != 0
    }

    /// `PeerGone` once the producer is gone (its connection hung up).
    pub fn check_producer(&self) -> Result<()> {
        self.check_same_process()?;
        if self.gone.load(Ordering::SeqCst) {
            return Err(gone_error(&self.handle));
        }
        let mut p = libc::pollfd { fd: self.conn.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd; no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        if n > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLIN) != 0 {
            if !self.gone.swap(true, Ordering::SeqCst) && self.handle.device == super::PoolDevice::Host {
                // A producer killed with -9 could not unlink its named segments.
                let handles: Vec<Vec<u8>> = self.manifest.segments.iter().map(|s| s.handle.clone()).collect();
                super::host_backend::unlink_names_of(&handles, self.handle.producer_pid);
            }
            return Err(gone_error(&self.handle));
        }
        Ok(())
    }

    /// Holds the current version for reading: waits (up to `timeout`)
    /// while an update is written, makes `stream` wait for the publish
    /// event, and returns the version. Threads of one process share the
    /// hold; each acquire needs its release.
    pub fn acquire(&self, stream: u64, timeout: Timeout) -> Result<u64> {
        let deadline = Deadline::new(timeout);
        let mut grace_end = None;
        loop {
            self.check_producer()?;
            // Read before looking, so a publish in between cuts the sleep short.
            let changes = self.control.changes();
            let mut r = lock(&self.readers);
            if r.count > 0 {
                // The process holds a version. A thread nested in its own
                // read joins at once (queueing behind the producer, which
                // waits for that read, would never end). Another thread
                // joins at once unless an update waits; then it lets the
                // process's reads end first, for up to JOIN_GRACE, so that
                // threads reading in turn cannot keep the producer out, and
                // then joins (the open read may be waiting for it).
                let update_waits = self.control.state() & super::control::WRITING != 0;
                let grace = match update_waits && !r.reading_here() {
                    true => *grace_end.get_or_insert_with(|| Instant::now() + JOIN_GRACE),
                    false => Instant::now(),
                };
                if Instant::now() >= grace {
                    let v = r.join();
                    drop(r);
                    return self.wait_publish(stream).map(|_| v);
                }
                let wait = grace.saturating_duration_since(Instant::now()).min(deadline.left().unwrap_or(Duration::MAX));
                let _ = self.released.wait_timeout(r, wait);
                continue;
            }
            match self.control.try_hold(&self.hold) {
                Hold::Held(v) => {
                    r.version = v;
                    r.join();
                    drop(r);
                    return self.wait_publish(stream).map(|_| v);
                }
                Hold::Torn => {
                    return Err(Error::new(
                        ErrorKind::Busy,
                        format!(
                            "pool {} is torn: an update was abandoned without publish, so its memory may mix two versions; wait for the producer's next publish",
                            self.handle.socket_name
                        ),
                    ))
                }
                Hold::Writing => {
                    drop(r);
                    self.control.wait_change(changes, deadline.left().unwrap_or(Duration::MAX));
                }
            }
            if deadline.passed() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "acquire: the producer of pool {} was still writing an update when the timeout ran out",
                        self.handle.socket_name
                    ),
                ));
            }
        }
    }

    fn wait_publish(&self, stream: u64) -> Result<()> {
        let Some(event) = self.control.event() else { return Ok(()) };
        self.backend.wait_event(&event, stream).map_err(|e| {
            let _ = self.release_hold();
            e
        })
    }

    /// Ends a read: waits for the work queued on `stream` (so kernels
    /// reading the weights are done), then lets go of the hold if this was
    /// the last reader of this process.
    pub fn release(&self, stream: u64) -> Result<()> {
        self.check_same_process()?;
        self.backend.sync_stream(stream)?;
        self.release_hold()
    }

    fn release_hold(&self) -> Result<()> {
        let mut r = lock(&self.readers);
        if r.count == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "release without a matching acquire"));
        }
        if r.leave() {
            self.hold.let_go();
            self.released.notify_all();
        }
        Ok(())
    }

    /// Readers of this process holding a version now.
    pub fn readers(&self) -> usize {
        lock(&self.readers).count
    }

    /// The slot this consumer holds in the producer's control block.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The manifest as received.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

fn map_segments(backend: &dyn PoolBackend, m: &Manifest, fds: Vec<OwnedFd>, kind: PoolKind) -> Result<Vec<Box<dyn MappedSegment>>> {
    let mut out = Vec::with_capacity(m.segments.len());
    match kind {
        PoolKind::Vmm => {
            for (i, (seg, fd)) in m.segments.iter().zip(fds).enumerate() {
                out.push(backend.import_fd(fd, seg.size as usize, &format!("pool segment {i}"))?);
            }
        }
        PoolKind::Legacy => {
            for (i, seg) in m.segments.iter().enumerate() {
                out.push(backend.import_handle(&seg.handle, seg.size as usize, &format!("pool segment {i}"))?);
            }
        }
    }
    Ok(out)
}

fn open_tensors(m: &Manifest, mapped: &[Box<dyn MappedSegment>]) -> Vec<OpenTensor> {
    m.tensors
        .iter()
        .map(|t| {
            let st = m.storages[t.storage as usize];
            let ptr = if st.nbytes == 0 { 0 } else { mapped[st.segment as usize].addr() + st.offset };
            OpenTensor {
                name: t.name.clone(),
                storage_index: t.storage as usize,
                segment: st.segment as usize,
                storage_ptr: ptr,
                storage_nbytes: st.nbytes as usize,
                dtype: t.dtype,
                sizes: t.sizes.clone(),
                strides: t.strides.clone(),
                storage_offset: t.storage_offset,
            }
        })
        .collect()
}

impl Weights {
    /// A forked child's copy shares the parent's hold slot and has no
    /// connection of its own (`ParentOnlyFd`): it must not touch either.
    fn check_same_process(&self) -> Result<()> {
        crate::fork_safe::check_made_here(self.generation, || {
            format!(
                "the weights of pool {} were opened before a fork: the child cannot use the parent's connection and hold; open the handle again in the child",
                self.handle.socket_name
            )
        })
    }
}

impl Drop for Weights {
    fn drop(&mut self) {
        // In a forked child the slot is the parent's, whatever the copied count says.
        if self.check_same_process().is_ok() && lock(&self.readers).count > 0 {
            self.hold.let_go();
        }
    }
}
