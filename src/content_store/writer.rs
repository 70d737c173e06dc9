//! Writing a store: each distinct storage once under `storages/<hash>`,
//! tensor entries under `tensors/<name>`, every file atomically. Several
//! writers (threads or processes) may add to the same store at once, and
//! a store can be reopened and added to later.

use super::bounds::check_fits;
use super::dtype::Dtype;
use super::fork_aware::CacheLock;
use super::fsio;
use super::hash::{hash_hex, is_digest, HashMode};
use super::layout::{self, Format};
use super::meta::TensorMeta;
use super::names::tensor_name_parts;
use super::store_lock::StoreLock;
use super::{record, torch_glue};
use crate::error::{Error, ErrorKind, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// What a writer did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Storages written to a new file.
    pub storages_written: u64,
    /// Storages whose content the store already had (nothing written).
    pub storages_deduplicated: u64,
    /// Tensor entries written.
    pub tensors_written: u64,
    /// Storage bytes written to new files.
    pub bytes_written: u64,
}

/// How long opening a writer waits for the store's lock by default (a gc
/// holds it while it removes unreferenced storages).
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(300);

/// A writer of one store. Safe to share between threads.
pub struct Writer {
    root: PathBuf,
    format: Format,
    hash: HashMode,
    /// Held (shared flock) while the writer lives, so `gc` never removes a
    /// storage whose tensor entry is still to come.
    lock: CacheLock<StoreLock>,
    /// Hashes this writer stored or found; only saves a stat.
    seen: CacheLock<HashSet<String>>,
    durable: AtomicBool,
    written: AtomicU64,
    deduplicated: AtomicU64,
    tensors: AtomicU64,
    bytes: AtomicU64,
}

impl Writer {
    /// Opens (creating if needed) the store at `path` in `format`. A store
    /// already there must have the same format. Waits for a running gc up
    /// to [`DEFAULT_LOCK_WAIT`].
    pub fn open(path: &Path, format: Format) -> Result<Writer> {
        Writer::open_with_lock_wait(path, format, DEFAULT_LOCK_WAIT)
    }

    /// [`open`](Self::open) waiting at most `lock_wait` for the store's
    /// lock (held exclusively by a gc, or by anyone who can open the lock
    /// file, which must be this user's); `Timeout` after it.
    pub fn open_with_lock_wait(path: &Path, format: Format, lock_wait: Duration) -> Result<Writer> {
        // create_dir_all would say only "File exists".
        if std::fs::metadata(path).is_ok_and(|m| !m.is_dir()) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{} exists and is not a folder (a content store is a folder)", path.display()),
            ));
        }
        std::fs::create_dir_all(path)
            .map_err(|e| Error::new(ErrorKind::Io, format!("unable to create store folder {}: {e}", path.display())))?;
        let root_fd = fsio::open_root(path)?;
        let hash = match layout::detect(&root_fd, path)? {
            Some((found, hash)) if found == format => hash,
            Some((found, _)) => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("{} holds a {} store; cannot add to it in {} format", path.display(), found.name(), format.name()),
                ))
            }
            None => {
                if format == Format::Native {
                    let text = layout::marker_text(format.hash_mode());
                    fsio::write_atomic(path, layout::MARKER, true, |f| fsio::write_all(f, text.as_bytes()))?;
                }
                format.hash_mode()
            }
        };
        fsio::make_dirs(path, &[layout::STORAGES])?;
        fsio::make_dirs(path, &[layout::TENSORS])?;
        let lock = StoreLock::shared(&path.join(layout::LOCK), lock_wait)?;
        Ok(Writer {
            root: path.to_path_buf(),
            format,
            hash,
            lock: CacheLock::new(lock),
            seen: CacheLock::new(HashSet::new()),
            durable: AtomicBool::new(true),
            written: AtomicU64::new(0),
            deduplicated: AtomicU64::new(0),
            tensors: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        })
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The hash that names this store's storages.
    pub fn hash_mode(&self) -> HashMode {
        self.hash
    }

    /// Whether each file is fsynced (with its folder) before and after
    /// the rename that publishes it (the default). Off, writing is several
    /// times faster and a killed process still leaves no partial file, but
    /// a power loss or kernel crash may: PyTorch's writer never fsyncs.
    pub fn set_durable(&self, on: bool) {
        self.durable.store(on, Ordering::Relaxed);
    }

    pub fn stats(&self) -> WriteStats {
        WriteStats {
            storages_written: self.written.load(Ordering::Relaxed),
            storages_deduplicated: self.deduplicated.load(Ordering::Relaxed),
            tensors_written: self.tensors.load(Ordering::Relaxed),
            bytes_written: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Stores `data` under its hash unless the store has that content
    /// already; returns the hash.
    pub fn write_storage(&self, data: &[u8]) -> Result<String> {
        let hash = hash_hex(data, self.hash);
        self.store_hashed(&hash, data)?;
        Ok(hash)
    }

    /// [`write_storage`](Self::write_storage) with a hash the caller
    /// computed (PyTorch's default hash, say): it must be a digest of
    /// the length this store's names have, and is trusted to name `data`.
    pub fn write_storage_hashed(&self, hash: &str, data: &[u8]) -> Result<()> {
        self.check_name(hash)?;
        self.store_hashed(hash, data)
    }

    fn check_name(&self, hash: &str) -> Result<()> {
        let shape = match self.format {
            Format::Native => self.hash,
            // PyTorch's default hash has SHA-1's length.
            Format::Torch => HashMode::Stable,
        };
        if !is_digest(hash, shape) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{hash:?} is not a storage name of a {} store", self.format.name()),
            ));
        }
        Ok(())
    }

    /// Whether the store has the storage `hash` of `len` bytes already
    /// (counted as deduplicated if so). Nothing is read: a file under the
    /// name is complete, since files appear only by rename.
    pub(crate) fn has_storage(&self, hash: &str, len: usize) -> bool {
        let present = self.seen.lock().is_some_and(|seen| seen.contains(hash)) || {
            let expected = match self.format {
                Format::Native => Some(len as u64),
                Format::Torch => None,
            };
            // One of the wrong size was damaged later and is replaced.
            let path = self.root.join(layout::STORAGES).join(hash);
            std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && expected.map_or(true, |n| m.len() == n))
        };
        if present {
            self.deduplicated.fetch_add(1, Ordering::Relaxed);
        }
        present
    }

    /// Counts a storage another thread is storing as deduplicated.
    pub(crate) fn note_deduplicated(&self) {
        self.deduplicated.fetch_add(1, Ordering::Relaxed);
    }

    /// Before anything is written: in a child forked from the process
    /// that opened the writer, the child's own lock (see `store_lock`).
    fn hold_lock(&self) -> Result<()> {
        // A parent thread that held this at the fork leaves it held: the
        // child then writes under the lock it inherited.
        match self.lock.lock() {
            Some(mut lock) => lock.ensure_mine(),
            None => Ok(()),
        }
    }

    fn store_hashed(&self, hash: &str, data: &[u8]) -> Result<()> {
        self.hold_lock()?;
        if !self.has_storage(hash, data.len()) {
            let dir = self.root.join(layout::STORAGES);
            let durable = self.durable.load(Ordering::Relaxed);
            match self.format {
                Format::Native => fsio::write_atomic(&dir, hash, durable, |f| fsio::write_all(f, data))?,
                Format::Torch => fsio::write_atomic(&dir, hash, durable, |f| torch_glue::write_storage_file(f, data))?,
            }
            self.written.fetch_add(1, Ordering::Relaxed);
            self.bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        if let Some(mut seen) = self.seen.lock() {
            seen.insert(hash.to_string());
        }
        Ok(())
    }

    /// Stores `data` as a storage and a tensor entry `name` viewing it
    /// with `dtype`, `offset`, `shape` and `stride` (in elements). The view
    /// must lie inside `data`. `/` in `name` makes folders. An entry of the
    /// same name is replaced. Returns the storage's hash.
    pub fn write_tensor(&self, name: &str, data: &[u8], dtype: Dtype, offset: i64, shape: &[i64], stride: &[i64]) -> Result<String> {
        let hash = hash_hex(data, self.hash);
        self.write_tensor_unchecked(name, hash, data, dtype, offset, shape, stride)
    }

    /// [`write_tensor`](Self::write_tensor) with a hash the caller
    /// computed, as in [`write_storage_hashed`](Self::write_storage_hashed).
    #[allow(clippy::too_many_arguments)]
    pub fn write_tensor_hashed(
        &self,
        name: &str,
        hash: &str,
        data: &[u8],
        dtype: Dtype,
        offset: i64,
        shape: &[i64],
        stride: &[i64],
    ) -> Result<()> {
        self.check_name(hash)?;
        self.write_tensor_unchecked(name, hash.to_string(), data, dtype, offset, shape, stride).map(|_| ())
    }

    #[allow(clippy::too_many_arguments)]
    fn write_tensor_unchecked(
        &self,
        name: &str,
        hash: String,
        data: &[u8],
        dtype: Dtype,
        offset: i64,
        shape: &[i64],
        stride: &[i64],
    ) -> Result<String> {
        let meta = TensorMeta { dtype, storage_hash: hash.clone(), offset, shape: shape.to_vec(), stride: stride.to_vec() };
        check_tensor(name, &meta, data.len())?;
        self.store_hashed(&hash, data)?;
        self.write_entry(name, &meta)?;
        Ok(hash)
    }

    /// Writes the entry `name` for `meta`, whose storage is stored already
    /// (and was checked with [`check_tensor`]).
    pub(crate) fn write_entry(&self, name: &str, meta: &TensorMeta) -> Result<()> {
        let parts = tensor_name_parts(name)?;
        self.hold_lock()?;
        let entry = match self.format {
            Format::Native => record::encode(meta),
            Format::Torch => torch_glue::tensor_file(meta),
        };
        let (file, folders) = parts.split_last().expect("a valid name has a part");
        let dir = fsio::make_dirs(&self.root.join(layout::TENSORS), folders).map_err(|e| e.context(format!("tensor {name:?}")))?;
        fsio::write_atomic(&dir, file, self.durable.load(Ordering::Relaxed), |f| fsio::write_all(f, &entry))
            .map_err(|e| e.context(format!("tensor {name:?}")))?;
        self.tensors.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Checks a tensor entry before anything is written: a valid name, and a
/// view inside the storage's `nbytes`.
pub(crate) fn check_tensor(name: &str, meta: &TensorMeta, nbytes: usize) -> Result<()> {
    tensor_name_parts(name)?;
    check_fits(meta, nbytes as u64, ErrorKind::InvalidArgument).map_err(|e| e.context(format!("tensor {name:?}")))
}
