//! The embedded store for one host: a folder shared by the ranks.
//!
//! Each key is one file (name from [`super::file_key::file_name`]) holding the raw
//! value. A value is written to a temporary file in the same folder and
//! renamed over the key's file, so a reader sees the whole old value or
//! the whole new one, and a writer killed mid-write leaves only a stray
//! temporary file (swept by the next `open` once its writer is dead),
//! never half a value. `set` and `add` serialise their final step on an
//! `flock` of `.lock`, so an add's read-modify-write is never interleaved
//! with another write; the kernel drops the lock of a killed process.
//! `.lock` is created 0600 and refused when another user owns it (see
//! [`crate::lock_file`]), and a write waits for it no longer than the
//! store's lock timeout.
//! A wait sleeps on an inotify watch of the folder, so it wakes as soon
//! as a key file is renamed into place. All waits on a store share one
//! watch, closed soon after the last wait ends ([`SharedWatch`]). Where
//! inotify is unavailable (no instance or descriptor left) a wait polls
//! with a backoff (50 µs doubling to 5 ms); so does a wait that cannot
//! open a key for want of a descriptor, until one is free or it times out.
//!
//! Keys are opened without blocking and must be regular files: a FIFO or
//! device at a key's path (nothing this store writes) is `Corrupt`, never
//! a hang.
//!
//! The path must be a folder (created, with its parents, if missing). An
//! existing regular file is refused with `InvalidArgument`: it is not a
//! store we can share safely, and silently using a folder beside it would
//! split ranks that name the same path. The folder is not cleaned up: give
//! each job a fresh one (old keys would otherwise be seen by the new job).

use super::bounded_read::{Forward, ReadError};
use super::deadline::{deadline, expired, remaining, timeout_error, Backoff};
use super::file_key::{file_name, is_key_file};
use super::shared_watch::{SharedWatch, Waiter};
use super::show_key;
use super::torch_file_lock::{lock, Mode};
use super::{Store, Timeout};
use crate::error::{Error, ErrorKind, Result};
use std::fs::FileType;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind as IoKind, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LOCK_FILE: &str = ".lock";
/// How long a write waits for the folder's lock unless told otherwise
/// (c10d's default store timeout). Our own holders keep it for one rename.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(300);
const TMP_PREFIX: &str = ".tmp.";
const POLL_START: Duration = Duration::from_micros(50);
const POLL_CAP: Duration = Duration::from_millis(5);
/// Longest sleep on the watch before looking again anyway (a safety net
/// for file systems whose changes inotify does not see).
const WATCH_CAP: Duration = Duration::from_millis(100);

/// A store in a folder, shared by processes on one host.
pub struct FileStore {
    dir: PathBuf,
    lock: File,
    tmp_seq: AtomicU64,
    /// The longest wait for `.lock` (held by a slow or stuck writer).
    lock_timeout: Timeout,
    /// The inotify watch of the folder that waits share.
    watch: Arc<SharedWatch>,
}

/// This process's descriptor use, for messages.
fn fd_limit_text() -> String {
    crate::fdpass::fd_limit_text()
}

fn io_error(e: std::io::Error, context: impl std::fmt::Display) -> Error {
    match e.raw_os_error() {
        Some(errno) => {
            let err = Error::from_errno(errno, context);
            if err.kind() == ErrorKind::TooManyFiles {
                return Error::new(err.kind(), format!("{} ({})", err.message(), fd_limit_text()));
            }
            err
        }
        None => Error::new(ErrorKind::Io, format!("{context}: {e}")),
    }
}

/// One look at a key's file.
enum Attempt {
    Value(Vec<u8>),
    Missing,
    /// The file could not be opened: this process (or the system) has no
    /// descriptor free.
    NoDescriptor(std::io::Error),
}

/// What a key's path holds when it is not a regular file, for messages.
fn type_name(t: FileType) -> &'static str {
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a folder"
    } else {
        "something"
    }
}

impl FileStore {
    /// Opens (creating if needed) the store in folder `path`; writes wait
    /// for the folder's lock up to [`DEFAULT_LOCK_TIMEOUT`].
    pub fn open(path: impl AsRef<Path>) -> Result<FileStore> {
        FileStore::open_with_lock_timeout(path, Some(DEFAULT_LOCK_TIMEOUT))
    }

    /// [`open`](Self::open) with the longest wait of `set`, `add`,
    /// `compare_set` and `delete_key` for the folder's lock (`None`: no
    /// limit); expiry is `Timeout` naming the store.
    pub fn open_with_lock_timeout(path: impl AsRef<Path>, lock_timeout: Timeout) -> Result<FileStore> {
        let dir = path.as_ref().to_path_buf();
        if dir.as_os_str().is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, "file store path is empty"));
        }
        match std::fs::metadata(&dir) {
            Ok(m) if !m.is_dir() => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("file store <{}> exists and is not a folder (a store is a folder of key files)", dir.display()),
                ))
            }
            Ok(_) => {}
            Err(e) if e.kind() == IoKind::NotFound => std::fs::create_dir_all(&dir)
                .map_err(|e| io_error(e, format_args!("unable to create file store folder <{}>", dir.display())))?,
            Err(e) => return Err(io_error(e, format_args!("unable to open file store <{}>", dir.display()))),
        }
        let lock_path = dir.join(LOCK_FILE);
        let lock = crate::lock_file::open_own(&lock_path, &format!("lock file of file store <{}>", dir.display()))?;
        let watch = SharedWatch::new(dir.clone());
        let store = FileStore { dir, lock, tmp_seq: AtomicU64::new(0), lock_timeout, watch };
        store.sweep_dead_temps();
        Ok(store)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Removes temporary files whose writer process is gone (killed
    /// mid-write). Best effort: a file we cannot judge stays.
    fn sweep_dead_temps(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TMP_PREFIX)) else { continue };
            let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
            // SAFETY: kill with signal 0 only checks that the process exists.
            let gone = pid > 0 && unsafe { libc::kill(pid, 0) } != 0 && crate::error::errno() == libc::ESRCH;
            if gone {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    fn key_path(&self, key: &[u8]) -> PathBuf {
        self.dir.join(file_name(key))
    }

    /// The value of `key` if it is set now.
    fn read_now(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.attempt_read(key)? {
            Attempt::Value(v) => Ok(Some(v)),
            Attempt::Missing => Ok(None),
            Attempt::NoDescriptor(e) => Err(self.read_error(key, e)),
        }
    }

    fn read_error(&self, key: &[u8], e: std::io::Error) -> Error {
        io_error(e, format_args!("unable to read key {} in {}", show_key(key), self.describe()))
    }

    /// Reads `key`'s file, telling a missing key and a lack of descriptors
    /// (which a wait outlasts) from real errors.
    fn attempt_read(&self, key: &[u8]) -> Result<Attempt> {
        let path = self.key_path(key);
        // O_NONBLOCK: opening a FIFO would otherwise wait for a writer.
        let opened = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(&path);
        let file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == IoKind::NotFound => return Ok(Attempt::Missing),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => return Ok(Attempt::NoDescriptor(e)),
            Err(e) => {
                // A socket cannot be opened at all: name it like the others.
                if let Ok(meta) = std::fs::metadata(&path) {
                    self.check_regular(key, &path, meta.file_type())?;
                }
                return Err(self.read_error(key, e));
            }
        };
        let meta = file.metadata().map_err(|e| self.read_error(key, e))?;
        self.check_regular(key, &path, meta.file_type())?;
        self.read_value(key, &path, &file, meta.len()).map(Attempt::Value)
    }

    /// The `size` bytes of a key's file, read in bounded chunks: a file
    /// grown sparse to terabytes by another process is `Corrupt` (this
    /// store writes every byte of a value), and a value this process cannot
    /// hold is `NoSpace`, never an abort.
    fn read_value(&self, key: &[u8], path: &Path, file: &File, size: u64) -> Result<Vec<u8>> {
        let corrupt = |detail: String| {
            Error::new(ErrorKind::Corrupt, format!("key {} in {}: <{}> {detail}", show_key(key), self.describe(), path.display()))
        };
        match Forward::new(file, 0, size).take(size) {
            Ok(value) => Ok(value),
            Err(ReadError::Hole(at)) => Err(corrupt(format!(
                "is {size} bytes with a hole at offset {at}: it was grown with truncate, and this store writes every byte of a value"
            ))),
            Err(ReadError::Io(e)) if e.kind() == IoKind::UnexpectedEof => {
                Err(corrupt(format!("was {size} bytes and shrank while it was read: this store never rewrites a key's file in place")))
            }
            Err(ReadError::Io(e)) => Err(self.read_error(key, e)),
            Err(ReadError::NoMemory) => Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "key {} in {}: <{}> is {size} bytes, more than this process can allocate",
                    show_key(key),
                    self.describe(),
                    path.display()
                ),
            )),
        }
    }

    /// A key's file must be a regular file: this store writes nothing else.
    fn check_regular(&self, key: &[u8], path: &Path, t: FileType) -> Result<()> {
        if t.is_file() {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "key {} in {}: <{}> is {}, not a regular file (this store writes only regular files there)",
                show_key(key),
                self.describe(),
                path.display(),
                type_name(t)
            ),
        ))
    }

    /// Writes `value` to a new temporary file in the folder; the caller
    /// renames it into place.
    fn write_temp(&self, key: &[u8], value: &[u8]) -> Result<PathBuf> {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        let tmp = self.dir.join(format!("{TMP_PREFIX}{}.{tid}.{seq}", std::process::id()));
        let context = || format!("unable to write key {} in {}", show_key(key), self.describe());
        let mut file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| io_error(e, context()))?;
        if let Err(e) = file.write_all(value) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_error(e, context()));
        }
        Ok(tmp)
    }

    /// Renames a finished temporary file over `key`'s file.
    fn publish(&self, tmp: &Path, key: &[u8]) -> Result<()> {
        std::fs::rename(tmp, self.key_path(key)).map_err(|e| {
            let _ = std::fs::remove_file(tmp);
            io_error(e, format_args!("unable to write key {} in {}", show_key(key), self.describe()))
        })
    }

    /// Runs `f` holding the folder's exclusive lock, waiting for it no
    /// longer than the store's lock timeout.
    fn locked<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _held = lock(&self.lock, Mode::Exclusive, deadline(self.lock_timeout), &|| self.describe())?;
        f()
    }
}

impl Store for FileStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let tmp = self.write_temp(key, value)?;
        self.locked(|| self.publish(&tmp, key)).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            e
        })
    }

    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        let end = deadline(timeout);
        let mut sleeper: Option<Sleeper> = None;
        loop {
            // Taken before the check: a set after it wakes the sleep below.
            let seen = sleeper.as_ref().map_or(0, Sleeper::generation);
            let no_descriptor = match self.attempt_read(key)? {
                Attempt::Value(v) => return Ok(v),
                Attempt::Missing => None,
                Attempt::NoDescriptor(e) => Some(e),
            };
            if expired(end) {
                return Err(match no_descriptor {
                    Some(e) => {
                        let e = self.read_error(key, e);
                        let tried = timeout.unwrap_or_default().as_millis();
                        Error::new(e.kind(), format!("{}; retried for {tried} ms", e.message()))
                    }
                    None => timeout_error(timeout, &[key], &self.describe()),
                });
            }
            match &mut sleeper {
                // Check once more with the watch in place before sleeping.
                None => sleeper = Some(Sleeper::new(&self.watch)),
                // A freed descriptor makes no inotify event: poll for it.
                Some(s) => s.sleep(seen, end, no_descriptor.is_some()),
            }
        }
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.locked(|| {
            let old = match self.read_now(key)? {
                None => 0,
                Some(bytes) => parse_counter(&bytes).ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidArgument,
                        format!("key {} in {} does not hold an integer, cannot add to it", show_key(key), self.describe()),
                    )
                })?,
            };
            // Wraps past either end, as PyTorch's TCPStore servers do.
            let new = old.wrapping_add(delta);
            let tmp = self.write_temp(key, new.to_string().as_bytes())?;
            self.publish(&tmp, key)?;
            Ok(new)
        })
    }

    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        let end = deadline(timeout);
        let mut missing: Vec<&[u8]> = keys.iter().copied().filter(|k| !self.key_path(k).exists()).collect();
        if missing.is_empty() {
            return Ok(());
        }
        let mut sleeper = Sleeper::new(&self.watch);
        loop {
            // Taken before the check: a set after it wakes the sleep below.
            let seen = sleeper.generation();
            missing.retain(|k| !self.key_path(k).exists());
            if missing.is_empty() {
                return Ok(());
            }
            if expired(end) {
                return Err(timeout_error(timeout, &missing, &self.describe()));
            }
            sleeper.sleep(seen, end, false);
        }
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        Ok(keys.iter().all(|k| self.key_path(k).exists()))
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.locked(|| {
            match self.read_now(key)? {
                None if expected.is_empty() => {}
                None => return Ok(expected.to_vec()),
                Some(current) if current == expected => {}
                Some(current) => return Ok(current),
            }
            let tmp = self.write_temp(key, desired)?;
            self.publish(&tmp, key)?;
            Ok(desired.to_vec())
        })
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.locked(|| match std::fs::remove_file(self.key_path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == IoKind::NotFound => Ok(false),
            Err(e) => Err(io_error(e, format_args!("unable to delete key {} in {}", show_key(key), self.describe()))),
        })
    }

    fn num_keys(&self) -> Result<i64> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io_error(e, format_args!("unable to list {}", self.describe())))?;
        let mut n = 0;
        for entry in entries {
            let entry = entry.map_err(|e| io_error(e, format_args!("unable to list {}", self.describe())))?;
            if is_key_file(&entry.file_name()) {
                n += 1;
            }
        }
        Ok(n)
    }

    fn describe(&self) -> String {
        format!("file store <{}>", self.dir.display())
    }
}

/// How a waiting call sleeps: on the store's shared inotify watch, else
/// by polling with a backoff.
struct Sleeper {
    watch: Option<Waiter>,
    backoff: Backoff,
}

impl Sleeper {
    fn new(shared: &Arc<SharedWatch>) -> Sleeper {
        Sleeper { watch: shared.join(), backoff: Backoff::new(POLL_START, POLL_CAP) }
    }

    fn generation(&self) -> u64 {
        self.watch.as_ref().map_or(0, Waiter::generation)
    }

    /// Sleeps until the folder changed after generation `seen` (or a
    /// polling interval passed, with `poll` or without a watch), never past
    /// `end`.
    fn sleep(&mut self, seen: u64, end: Option<Instant>, poll: bool) {
        match &self.watch {
            Some(w) if !poll => w.wait_past(seen, remaining(end).map_or(WATCH_CAP, |r| r.min(WATCH_CAP))),
            _ => self.backoff.sleep(end),
        }
    }
}

/// A counter as `add` stores it (decimal text, optional sign).
fn parse_counter(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_store(tag: &str) -> (FileStore, PathBuf) {
        let dir = std::env::temp_dir().join(format!("ss-filestore-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        (FileStore::open(&dir).unwrap(), dir)
    }

    #[test]
    fn set_get_add_wait() {
        let (s, dir) = temp_store("basic");
        s.set(b"a/b", b"hello").unwrap();
        assert_eq!(s.get(b"a/b", Some(Duration::from_millis(10))).unwrap(), b"hello");
        s.set(b"a/b", b"").unwrap();
        assert_eq!(s.get(b"a/b", None).unwrap(), b"");
        assert_eq!(s.add(b"n", 5).unwrap(), 5);
        assert_eq!(s.add(b"n", -7).unwrap(), -2);
        assert_eq!(s.get(b"n", None).unwrap(), b"-2");
        s.wait(&[b"a/b".as_slice(), b"n"], Some(Duration::from_millis(10))).unwrap();
        let e = s.wait(&[b"a/b".as_slice(), b"x", b"y/z"], Some(Duration::from_millis(20))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.message().contains("\"x\", \"y/z\""), "{}", e.message());
        assert!(!e.message().contains("a/b"), "{}", e.message());
        let e = s.get(b"late", Some(Duration::from_millis(5))).unwrap_err();
        assert!(e.message().contains("\"late\"") && e.message().contains(&dir.display().to_string()), "{}", e.message());
        // Nothing but key files and the lock file: no temporaries left.
        let mut names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, [".lock", "k.a%2Fb", "k.n"]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn add_refuses_non_integers_and_wraps_past_the_ends() {
        let (s, dir) = temp_store("addbad");
        s.set(b"t", b"text").unwrap();
        assert_eq!(s.add(b"t", 1).unwrap_err().kind(), ErrorKind::InvalidArgument);
        s.add(b"m", i64::MAX).unwrap();
        assert_eq!(s.add(b"m", 1).unwrap(), i64::MIN);
        assert_eq!(s.get(b"m", None).unwrap(), i64::MIN.to_string().as_bytes());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn refuses_a_regular_file_and_sweeps_dead_temps() {
        let (s, dir) = temp_store("file");
        let f = dir.join("plain");
        std::fs::write(&f, b"x").unwrap();
        let e = FileStore::open(&f).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("not a folder"), "{}", e.message());
        // A temporary of a process that no longer exists is removed on open;
        // one of a live process (ours) stays.
        let dead = dir.join(".tmp.2147483600.1.0");
        let live = dir.join(format!(".tmp.{}.1.0", std::process::id()));
        std::fs::write(&dead, b"half").unwrap();
        std::fs::write(&live, b"half").unwrap();
        drop(s);
        let _s = FileStore::open(&dir).unwrap();
        assert!(!dead.exists());
        assert!(live.exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn get_waits_for_a_later_set_from_another_thread() {
        let (s, dir) = temp_store("wait");
        let s = std::sync::Arc::new(s);
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            s2.set(b"k", b"v").unwrap();
        });
        assert_eq!(s.get(b"k", Some(Duration::from_secs(10))).unwrap(), b"v");
        t.join().unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}
