//! A store in PyTorch's own FileStore file, so that ranks using
//! `torch.distributed.FileStore` (or `init_process_group` with a `file://`
//! address) and ranks using this library share one file both ways.
//!
//! The file is an append-only log of records (see [`super::torch_file_log`]
//! and docs/pytorch-filestore.md). Every operation opens the path afresh,
//! takes an `flock` (shared to read, exclusive to write), reads the records
//! appended since its last visit, then appends its own. User keys carry
//! PyTorch's `/` prefix; `refcount/` counts the stores open and `cleanup/`
//! the stores closed, and the last store to close removes the file when
//! `world_size` of them have closed (never with `world_size` -1). A store
//! still open when the process exits is counted out then, as PyTorch's
//! are by their destructors.
//!
//! Waits poll (50 µs doubling to 10 ms, PyTorch polls every 10 ms): the
//! file may live on a shared file system where change notification does
//! not reach other hosts.

use super::deadline::{deadline, expired, timeout_error, Backoff};
use super::torch_file_exit::{self, Leave};
use super::torch_file_lock::{lock, Mode};
use super::torch_file_log::{encode, Replay, DELETE_MARK};
use super::{Store, Timeout};
use crate::error::{Error, ErrorKind, Result};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind as IoKind, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Counts the stores that opened the file and have not closed yet.
const REFCOUNT_KEY: &[u8] = b"refcount/";
/// Counts the stores that closed the file.
const CLEANUP_KEY: &[u8] = b"cleanup/";
/// Prefix of every user key in the file.
const USER_PREFIX: u8 = b'/';
const POLL_START: Duration = Duration::from_micros(50);
const POLL_CAP: Duration = Duration::from_millis(10);

/// One process's membership of a PyTorch FileStore file (dropping the last
/// reference counts it out).
pub struct TorchFileStore(Arc<Member>);

/// What a [`TorchFileStore`] shares with the exit hook.
struct Member {
    path: PathBuf,
    world_size: i64,
    timeout: Timeout,
    replay: Mutex<Replay>,
    /// The process that counted itself in (a forked child must not count
    /// its parent out).
    opener: u32,
    left: AtomicBool,
}

impl TorchFileStore {
    /// Opens (creating if missing) the FileStore file at `path`, as
    /// `torch.distributed.FileStore(path, world_size)` does: counts this
    /// store in `refcount/`. `world_size` -1 never removes the file;
    /// `timeout` bounds every lock wait, and waits for a removed file to
    /// come back in operations that do not create it.
    pub fn open(path: impl AsRef<Path>, world_size: i64, timeout: Timeout) -> Result<TorchFileStore> {
        let path = path.as_ref().to_path_buf();
        if path.as_os_str().is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, "FileStore path is empty"));
        }
        if world_size < -1 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("world_size is {world_size}: must be -1 (never remove the file) or the number of stores that close it"),
            ));
        }
        if std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("FileStore path <{}> is a folder: a PyTorch FileStore is one file", path.display()),
            ));
        }
        let member = Member {
            path,
            world_size,
            timeout,
            replay: Mutex::new(Replay::default()),
            opener: std::process::id(),
            left: AtomicBool::new(false),
        };
        member.add_raw(REFCOUNT_KEY, 1)?;
        let member = Arc::new(member);
        let weak: Weak<dyn Leave> = Arc::downgrade(&member) as Weak<dyn Leave>;
        torch_file_exit::register(weak);
        Ok(TorchFileStore(member))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.0.path
    }
}

impl Member {
    fn state(&self) -> MutexGuard<'_, Replay> {
        self.replay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens the path: for writing (created if missing, `create`), or for
    /// reading. `None` when it does not exist. Never blocks (a FIFO planted
    /// there would hold `open` until a writer came) nor follows a symbolic
    /// link (a dangling one would make us create the file where its maker
    /// chose), and the file must be a regular file we may trust
    /// ([`trusted_log`]).
    fn open_file(&self, write: bool, create: bool) -> Result<Option<File>> {
        let mut options = OpenOptions::new();
        options.read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_CLOEXEC);
        if write {
            options.append(true).create(create).mode(0o644);
        }
        match options.open(&self.path) {
            Ok(f) => trusted_log(f, &self.describe()).map(Some),
            Err(e) if e.kind() == IoKind::NotFound => Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(Error::new(
                ErrorKind::Permission,
                format!("{} is a symbolic link; refused (another user may have planted it to redirect our writes)", self.describe()),
            )),
            Err(e) => {
                // A socket cannot be opened at all: name what is there.
                if let Ok(meta) = std::fs::symlink_metadata(&self.path) {
                    if !meta.is_file() {
                        return Err(not_regular(&self.describe(), meta.file_type()));
                    }
                }
                Err(io_error(e, format_args!("unable to open {}", self.describe())))
            }
        }
    }

    /// Runs `f` on the replayed log under the shared lock; `None` when the
    /// file does not exist now.
    fn read_view<T>(&self, end: Option<Instant>, f: impl FnOnce(&Replay) -> T) -> Result<Option<T>> {
        let mut replay = self.state();
        let Some(file) = self.open_file(false, false)? else { return Ok(None) };
        let _held = lock(&file, Mode::Shared, end, &|| self.describe())?;
        replay.catch_up(&file, &|| self.describe())?;
        Ok(Some(f(&replay)))
    }

    /// Runs `f` on the replayed log under the exclusive lock, with a way to
    /// append; `None` when the file does not exist and `create` is false.
    fn write_view<T>(&self, create: bool, f: impl FnOnce(&mut Appender) -> Result<T>) -> Result<Option<T>> {
        let mut replay = self.state();
        let Some(file) = self.open_file(true, create)? else { return Ok(None) };
        let _held = lock(&file, Mode::Exclusive, deadline(self.timeout), &|| self.describe())?;
        replay.catch_up(&file, &|| self.describe())?;
        f(&mut Appender { store: self, file: &file, replay: &mut replay }).map(Some)
    }

    /// `read_view` (or a non-creating `write_view`), waiting up to the
    /// store's timeout for a missing file to appear.
    fn when_present<T>(&self, mut attempt: impl FnMut(Option<Instant>) -> Result<Option<T>>) -> Result<T> {
        let end = deadline(self.timeout);
        let mut backoff = Backoff::new(POLL_START, POLL_CAP);
        loop {
            if let Some(v) = attempt(end)? {
                return Ok(v);
            }
            if expired(end) {
                return Err(Error::new(ErrorKind::NotFound, format!("{} does not exist (its last user removed it?)", self.describe())));
            }
            backoff.sleep(end);
        }
    }

    /// Adds `delta` to the counter under record key `key`.
    fn add_raw(&self, key: &[u8], delta: i64) -> Result<i64> {
        let added = self.write_view(true, |log| log.add(key, delta))?;
        added.ok_or_else(|| Error::new(ErrorKind::NotFound, format!("{} vanished while being created", self.describe())))
    }

    /// What `Drop` does: counts this store out, and removes the file when
    /// it was the last of `world_size` stores to close.
    fn leave(&self) -> Result<()> {
        if !self.path.exists() {
            return Ok(());
        }
        let removed = self.write_view(false, |log| {
            let closed = log.add(CLEANUP_KEY, 1)?;
            let open = log.add(REFCOUNT_KEY, -1)?;
            if open == 0 && self.world_size >= 0 && closed >= self.world_size && log.path_is_this_file() {
                std::fs::remove_file(&self.path).map_err(|e| io_error(e, format_args!("unable to remove {}", self.describe())))?;
            }
            Ok(())
        });
        removed.map(|_| ())
    }
}

/// The exclusive view of the log: reads it and appends to it.
struct Appender<'a> {
    store: &'a Member,
    file: &'a File,
    replay: &'a mut Replay,
}

impl Appender<'_> {
    fn value(&self, key: &[u8]) -> Option<&[u8]> {
        self.replay.value(key)
    }

    /// Appends one record in one write; a failed write is cut off again so
    /// no reader ever sees half a record.
    fn append(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        let record = encode(key, value)?;
        if let Err(e) = (&*self.file).write_all(&record) {
            let _ = self.file.set_len(self.replay.end());
            return Err(io_error(e, format_args!("unable to append to {}", self.store.describe())));
        }
        self.replay.applied(key, value, record.len());
        Ok(())
    }

    /// c10d's add: a missing or empty value counts as 0; the sum is stored
    /// as decimal text.
    fn add(&mut self, key: &[u8], delta: i64) -> Result<i64> {
        let shown = || String::from_utf8_lossy(key.strip_prefix(&[USER_PREFIX]).unwrap_or(key)).into_owned();
        let old = match self.value(key) {
            None | Some([]) => 0,
            Some(bytes) => parse_counter(bytes).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("key {:?} in {} does not hold an integer, cannot add to it", shown(), self.store.describe()),
                )
            })?,
        };
        // Wraps past either end, as in every store of this library (and as
        // PyTorch's servers do).
        let new = old.wrapping_add(delta);
        self.append(key, new.to_string().as_bytes())?;
        Ok(new)
    }

    /// Whether the path still names the file we hold (not one created
    /// again since).
    fn path_is_this_file(&self) -> bool {
        match (std::fs::metadata(&self.store.path), self.file.metadata()) {
            (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
            _ => false,
        }
    }
}

impl Leave for Member {
    fn leave_once(&self) {
        if std::process::id() != self.opener || self.left.swap(true, Ordering::AcqRel) {
            return;
        }
        // Best effort, as PyTorch's: a store that cannot count itself out
        // leaves the file for its other users.
        let _ = self.leave();
    }
}

impl Drop for TorchFileStore {
    fn drop(&mut self) {
        self.0.leave_once();
    }
}

impl Store for TorchFileStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.0.set(key, value)
    }

    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        self.0.get(key, timeout)
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.0.add(key, delta)
    }

    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        self.0.wait(keys, timeout)
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.0.check(keys)
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.0.compare_set(key, expected, desired)
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.0.delete_key(key)
    }

    fn num_keys(&self) -> Result<i64> {
        self.0.num_keys()
    }

    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// The record key of user key `key`.
fn user_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(USER_PREFIX);
    k.extend_from_slice(key);
    k
}

/// A counter (decimal text, optional sign, surrounding blanks allowed).
fn parse_counter(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

/// The log file `f` if it is a regular file owned by this user (or by
/// root): a FIFO or device is no log, and a file another user owns is one
/// they can rewrite, truncate or grow under us.
fn trusted_log(f: File, describe: &str) -> Result<File> {
    let meta = f.metadata().map_err(|e| io_error(e, format_args!("unable to stat {describe}")))?;
    if !meta.is_file() {
        return Err(not_regular(describe, meta.file_type()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(Error::new(
            ErrorKind::Permission,
            format!("{describe} belongs to uid {}, not to this user (uid {me}); refused: its owner could rewrite it under us", meta.uid()),
        ));
    }
    Ok(f)
}

fn not_regular(describe: &str, t: std::fs::FileType) -> Error {
    use std::os::unix::fs::FileTypeExt;
    let kind = if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_dir() {
        "a folder"
    } else {
        "not a regular file"
    };
    Error::new(ErrorKind::Permission, format!("{describe} is {kind}, not a regular file; refused (a FileStore is one regular file)"))
}

fn io_error(e: std::io::Error, context: std::fmt::Arguments) -> Error {
    match e.raw_os_error() {
        Some(errno) => Error::from_errno(errno, context),
        None => Error::new(ErrorKind::Io, format!("{context}: {e}")),
    }
}

impl Store for Member {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let k = user_key(key);
        self.write_view(true, |log| log.append(&k, value))?;
        Ok(())
    }

    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        let k = user_key(key);
        let end = deadline(timeout);
        let mut backoff = Backoff::new(POLL_START, POLL_CAP);
        loop {
            if let Some(Some(v)) = self.read_view(end, |r| r.value(&k).map(<[u8]>::to_vec))? {
                return Ok(v);
            }
            if expired(end) {
                return Err(timeout_error(timeout, &[key], &self.describe()));
            }
            backoff.sleep(end);
        }
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.add_raw(&user_key(key), delta)
    }

    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        let record_keys: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        let end = deadline(timeout);
        let mut backoff = Backoff::new(POLL_START, POLL_CAP);
        loop {
            let missing = self.read_view(end, |r| {
                keys.iter().zip(&record_keys).filter(|(_, rk)| r.value(rk).is_none()).map(|(k, _)| *k).collect::<Vec<&[u8]>>()
            })?;
            let missing = missing.unwrap_or_else(|| keys.to_vec());
            if missing.is_empty() {
                return Ok(());
            }
            if expired(end) {
                return Err(timeout_error(timeout, &missing, &self.describe()));
            }
            backoff.sleep(end);
        }
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        let record_keys: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        self.when_present(|end| self.read_view(end, |r| record_keys.iter().all(|k| r.value(k).is_some())))
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let k = user_key(key);
        let answer = self.write_view(true, |log| {
            match log.value(&k) {
                None if expected.is_empty() => {}
                None => return Ok(expected.to_vec()),
                Some(current) if current == expected => {}
                Some(current) => return Ok(current.to_vec()),
            }
            log.append(&k, desired)?;
            Ok(desired.to_vec())
        })?;
        answer.ok_or_else(|| Error::new(ErrorKind::NotFound, format!("{} vanished while being created", self.describe())))
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        let k = user_key(key);
        let mut deleting = Vec::with_capacity(k.len() + 1);
        deleting.push(DELETE_MARK);
        deleting.extend_from_slice(&k);
        self.when_present(|_| {
            self.write_view(false, |log| {
                let existed = log.value(&k).is_some();
                if existed {
                    log.append(&deleting, b"")?;
                }
                Ok(existed)
            })
        })
    }

    fn num_keys(&self) -> Result<i64> {
        self.when_present(|end| self.read_view(end, |r| r.len() as i64))
    }

    fn describe(&self) -> String {
        format!("PyTorch FileStore <{}>", self.path.display())
    }
}
