//! Tensors written in the background: [`Pipeline::submit_tensor`] copies
//! the storage's bytes and returns; the content store's pool hashes each
//! copy, stores it unless the store has that content, then writes the
//! tensor entry. Storages are hashed side by side on all cores, and one
//! is written while the next are hashed.
//!
//! - The copy is the snapshot: the caller may change or free its storage
//!   as soon as the call returns, as with a synchronous writer.
//! - Two copies of one content hashed at the same time are stored once:
//!   the first to claim the hash writes it, the others only add their
//!   entries after it (no job ever waits inside the pool).
//! - Tensor entries are published in submission order, each once its
//!   storage is stored: an entry seen in the folder means every earlier
//!   one is there too, the last tensor of a name wins, and a name that
//!   cannot be made fails as it would written in the call.
//! - Bytes in flight are bounded; a caller past the bound waits.
//! - An error of a background job is kept and returned by the next
//!   submit, or by [`Pipeline::flush`].
//! - In a child made by fork() the pool's threads do not exist: there the
//!   work is done in the call, and nothing waits for the parent's jobs.

use super::fork_aware::hash_pool;
use super::meta::TensorMeta;
use super::writer::{check_tensor, Writer};
use super::Dtype;
use crate::error::{Error, ErrorKind, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A digest of a storage's bytes: the hex name it is stored under.
pub type Digest = fn(&[u8]) -> String;

/// Most storage bytes copied and not yet stored (one bigger storage is
/// still taken when nothing else is in flight).
const BYTES_IN_FLIGHT: usize = 256 << 20;
/// Most tensors submitted and not yet written.
const JOBS_IN_FLIGHT: usize = 4096;
/// With a pool this small, storages are hashed by the caller (see
/// [`Pipeline::submit_tensor`]).
const HASH_HERE_UP_TO_THREADS: usize = 2;

/// A tensor entry waiting for its storage.
struct Entry {
    name: String,
    meta: TensorMeta,
    seq: u64,
}

#[derive(Default)]
struct State {
    bytes: usize,
    jobs: usize,
    error: Option<Error>,
    /// Copy buffers to reuse (fresh memory costs a page fault a page).
    spare: Vec<Vec<u8>>,
    spare_bytes: usize,
    /// Hashes being stored, with the entries of other jobs that found
    /// the same content meanwhile.
    claims: HashMap<String, Vec<Entry>>,
    /// Entries whose storage is settled (`None`: it failed), by
    /// submission number, waiting for the earlier ones.
    ready: BTreeMap<u64, Option<Entry>>,
    /// The submission number of the next entry to publish.
    next_publish: u64,
    next_seq: u64,
    /// Hashes stored or found since the caller last took them.
    hashes: Vec<String>,
}

struct Shared {
    writer: Arc<Writer>,
    state: Mutex<State>,
    changed: Condvar,
    /// This pipeline's jobs queued or running in the pool.
    in_pool: AtomicUsize,
}

/// Counts a pool job out when it ends, even by a panic.
struct InPool(Arc<Shared>);

impl InPool {
    fn enter(shared: Arc<Shared>) -> InPool {
        shared.in_pool.fetch_add(1, Ordering::AcqRel);
        InPool(shared)
    }
}

impl Drop for InPool {
    fn drop(&mut self) {
        self.0.in_pool.fetch_sub(1, Ordering::Release);
    }
}

/// A background writer over a [`Writer`]. Dropping it waits for its jobs.
pub struct Pipeline {
    shared: Arc<Shared>,
    owner: u32,
    hash_where: AtomicU8,
}

/// Where a submitted storage is hashed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashWhere {
    /// By the pool's size (the default): on more than two threads in the
    /// pool; on up to two in the caller, except while the pool has
    /// nothing to do (then it hashes a copy, and the caller goes on).
    Auto,
    /// In the caller's call, over its bytes; only new content is copied.
    Caller,
    /// In the pool, over a copy taken in the call.
    Pool,
}

impl HashWhere {
    const CALLER: u8 = 1;
    const POOL: u8 = 2;
}

impl Pipeline {
    pub fn new(writer: Arc<Writer>) -> Pipeline {
        Pipeline {
            shared: Arc::new(Shared { writer, state: Mutex::new(State::default()), changed: Condvar::new(), in_pool: AtomicUsize::new(0) }),
            owner: std::process::id(),
            hash_where: AtomicU8::new(0),
        }
    }

    /// Where the next submissions are hashed.
    pub fn set_hash_where(&self, at: HashWhere) {
        let code = match at {
            HashWhere::Auto => 0,
            HashWhere::Caller => HashWhere::CALLER,
            HashWhere::Pool => HashWhere::POOL,
        };
        self.hash_where.store(code, Ordering::Relaxed);
    }

    pub fn writer(&self) -> &Arc<Writer> {
        &self.shared.writer
    }

    fn in_owner(&self) -> bool {
        std::process::id() == self.owner
    }

    /// Queues the tensor `name` viewing a copy of `data`, stored under
    /// `digest(data)`. Returns `Some(hash)` when the work was done in the
    /// call (in a forked child, or without a pool), `None` when queued.
    /// Name and bounds are checked here; a background failure is returned
    /// by a later call.
    #[allow(clippy::too_many_arguments)]
    pub fn submit_tensor(
        &self,
        name: &str,
        data: &[u8],
        digest: Digest,
        dtype: Dtype,
        offset: i64,
        shape: &[i64],
        stride: &[i64],
    ) -> Result<Option<String>> {
        // Checked with a placeholder hash; the real one comes later.
        let meta = TensorMeta { dtype, storage_hash: String::new(), offset, shape: shape.to_vec(), stride: stride.to_vec() };
        check_tensor(name, &meta, data.len())?;
        let pool = if self.in_owner() { hash_pool() } else { None };
        let Some(pool) = pool else {
            let hash = digest(data);
            self.shared.writer.write_tensor_hashed(name, &hash, data, dtype, offset, shape, stride)?;
            return Ok(Some(hash));
        };
        // Hashing here reads the caller's bytes in place, and only new
        // content is copied; hashing in the pool hashes several storages
        // at once but copies every one first. The copy pays off where
        // there are cores to spare.
        let hash_here = match self.hash_where.load(Ordering::Relaxed) {
            HashWhere::CALLER => true,
            HashWhere::POOL => false,
            _ => pool.current_num_threads() <= HASH_HERE_UP_TO_THREADS && self.shared.in_pool.load(Ordering::Acquire) > 0,
        };
        let hash = if hash_here { Some(digest(data)) } else { None };
        let seq = self.shared.admit(data.len())?;
        let mut entry = Entry { name: name.to_string(), meta, seq };
        let shared = self.shared.clone();
        match hash {
            Some(hash) => {
                entry.meta.storage_hash = hash;
                if let Some(entry) = self.shared.place(entry, data.len()) {
                    let buf = self.shared.copy_of(data);
                    let counted = InPool::enter(shared);
                    pool.spawn(move || counted.0.store(buf, entry));
                }
            }
            None => {
                let buf = self.shared.copy_of(data);
                let counted = InPool::enter(shared);
                pool.spawn(move || counted.0.hash_and_store(buf, digest, entry));
            }
        }
        Ok(None)
    }

    /// Waits until every queued tensor is written; returns the first
    /// background error since the last call that returned one.
    pub fn flush(&self) -> Result<()> {
        if !self.in_owner() {
            return Ok(());
        }
        let mut st = self.wait_idle_locked();
        st.error.take().map_or(Ok(()), Err)
    }

    /// Waits until every queued tensor is written, keeping any error.
    pub fn wait_idle(&self) {
        if self.in_owner() {
            drop(self.wait_idle_locked());
        }
    }

    fn wait_idle_locked(&self) -> MutexGuard<'_, State> {
        let mut st = self.shared.lock();
        while st.jobs > 0 {
            st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st
    }

    /// The hashes of the storages stored or found since the last call.
    pub fn take_hashes(&self) -> Vec<String> {
        if !self.in_owner() {
            return Vec::new();
        }
        std::mem::take(&mut self.shared.lock().hashes)
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.wait_idle();
    }
}

impl State {
    fn take_spare(&mut self, len: usize) -> Vec<u8> {
        match self.spare.iter().position(|b| b.capacity() >= len) {
            Some(i) => {
                let mut b = self.spare.swap_remove(i);
                self.spare_bytes -= b.capacity();
                b.clear();
                b
            }
            None => Vec::with_capacity(len),
        }
    }

    fn give_spare(&mut self, buf: Vec<u8>) {
        if self.spare_bytes + buf.capacity() <= BYTES_IN_FLIGHT {
            self.spare_bytes += buf.capacity();
            self.spare.push(buf);
        }
    }

    fn fail(&mut self, e: Error) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a submission in (waiting while too much is in flight);
    /// returns its sequence number, or a background error.
    fn admit(&self, len: usize) -> Result<u64> {
        let mut st = self.lock();
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        while st.jobs > 0 && (st.bytes + len > BYTES_IN_FLIGHT || st.jobs >= JOBS_IN_FLIGHT) {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.bytes += len;
        st.jobs += 1;
        let seq = st.next_seq;
        st.next_seq += 1;
        Ok(seq)
    }

    /// A copy of `data` in a reused buffer where one is free.
    fn copy_of(&self, data: &[u8]) -> Vec<u8> {
        let mut buf = self.lock().take_spare(data.len());
        buf.extend_from_slice(data);
        buf
    }

    /// Settles `entry` (its hash known) unless its content must be
    /// stored: then claims the hash and returns the entry to the caller,
    /// who stores the content and calls [`settle`](Self::settle).
    fn place(&self, entry: Entry, len: usize) -> Option<Entry> {
        let mut st = self.lock();
        let hash = entry.meta.storage_hash.clone();
        if let Some(waiting) = st.claims.get_mut(&hash) {
            // Another job is storing this content: it adds our entry.
            waiting.push(entry);
            self.writer.note_deduplicated();
            st.bytes -= len;
            self.changed.notify_all();
            return None;
        }
        if self.writer.has_storage(&hash, len) {
            st.bytes -= len;
            self.publish(&mut st, &hash, Ok(()), vec![entry]);
            return None;
        }
        st.claims.insert(hash, Vec::new());
        Some(entry)
    }

    /// A pool job: hashes the copy, then stores it unless the store has it.
    fn hash_and_store(&self, buf: Vec<u8>, digest: Digest, mut entry: Entry) {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| digest(&buf))) {
            Ok(hash) => {
                entry.meta.storage_hash = hash;
                let len = buf.len();
                match self.place(entry, len) {
                    Some(entry) => self.store(buf, entry),
                    None => self.lock().give_spare(buf),
                }
            }
            Err(_) => {
                let mut st = self.lock();
                st.bytes -= buf.len();
                st.give_spare(buf);
                let err = Error::new(ErrorKind::Panic, "hashing a storage panicked".to_string());
                self.publish(&mut st, "", Err(err), vec![entry]);
            }
        }
    }

    /// A pool job: writes the claimed content, then the entries waiting
    /// for it.
    fn store(&self, buf: Vec<u8>, entry: Entry) {
        let hash = entry.meta.storage_hash.clone();
        let stored = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.writer.write_storage_hashed(&hash, &buf)))
            .unwrap_or_else(|_| Err(Error::new(ErrorKind::Panic, "writing a storage panicked".to_string())));
        let mut st = self.lock();
        st.bytes -= buf.len();
        st.give_spare(buf);
        let mut entries = st.claims.remove(&hash).unwrap_or_default();
        entries.insert(0, entry);
        self.publish(&mut st, &hash, stored, entries);
    }

    /// Marks the entries of a hash settled (stored, or failed with the
    /// error kept), then publishes every entry whose turn has come.
    fn publish(&self, st: &mut State, hash: &str, stored: Result<()>, entries: Vec<Entry>) {
        let ok = stored.is_ok();
        match stored {
            Ok(()) => st.hashes.push(hash.to_string()),
            Err(err) => st.fail(err.context(format!("tensor {:?}", entries[0].name))),
        }
        for e in entries {
            let seq = e.seq;
            st.ready.insert(seq, ok.then_some(e));
        }
        // Under the lock, so entries go out one at a time, in order.
        while let Some(entry) = st.ready.remove(&st.next_publish) {
            if let Some(e) = entry {
                if let Err(err) = self.writer.write_entry(&e.name, &e.meta) {
                    st.fail(err);
                }
            }
            st.next_publish += 1;
            st.jobs -= 1;
        }
        self.changed.notify_all();
    }
}
