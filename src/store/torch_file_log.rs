//! The record log of PyTorch's FileStore file, and the replay of it into a
//! key map (see docs/pytorch-filestore.md).
//!
//! A record is a key and a value, each a 32-bit length in the host's byte
//! order followed by that many bytes. Records are only ever appended; the
//! newest record of a key wins, and a record whose key starts with `-`
//! deletes the key that follows the dash.

use super::bounded_read::{Forward, ReadError};
use crate::error::{Error, ErrorKind, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;

/// The first byte of a deleting record's key.
pub const DELETE_MARK: u8 = b'-';

/// One record, encoded: `[len][key][len][value]`. Fails when a part does
/// not fit the 32-bit length.
pub fn encode(key: &[u8], value: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(8 + key.len() + value.len());
    for (what, part) in [("key", key), ("value", value)] {
        let len = u32::try_from(part.len()).map_err(|_| {
            Error::new(ErrorKind::InvalidArgument, format!("{what} is {} bytes: the FileStore format holds at most 4 GiB - 1", part.len()))
        })?;
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(part);
    }
    Ok(out)
}

/// What one process knows of the log: the keys replayed so far and where
/// it stopped, tied to the file it read (device, inode) so that a file
/// removed and created again is read from its start.
#[derive(Default)]
pub struct Replay {
    file: Option<(u64, u64)>,
    pos: u64,
    entries: HashMap<Vec<u8>, Vec<u8>>,
}

impl Replay {
    /// Reads the records appended since the last call. The caller holds a
    /// lock of the file, so no writer is mid-record: bytes that do not
    /// make whole records are corruption (a writer killed mid-write, a
    /// file grown by `truncate`, or a file that is not a FileStore) and
    /// reported with their offset. Reads go in bounded chunks; a length is
    /// believed only as far as the file reaches, so a huge claimed length
    /// or a huge sparse file costs no memory.
    pub fn catch_up(&mut self, file: &File, describe: &dyn Fn() -> String) -> Result<()> {
        let meta = file.metadata().map_err(|e| io_error(e, format_args!("unable to stat {}", describe())))?;
        let id = (meta.dev(), meta.ino());
        let size = meta.len();
        if self.file != Some(id) || size < self.pos {
            *self = Replay { file: Some(id), ..Replay::default() };
        }
        let mut log = Forward::new(file, self.pos, size);
        while log.left() > 0 {
            let record_start = log.pos();
            let bad = Bad { record_start, end: size, describe };
            let key = field(&mut log, &bad, "key")?;
            // PyTorch never writes an empty key (every key has a prefix):
            // zeros where a record should be are a file grown with
            // truncate, and would otherwise replay as billions of records.
            if key.is_empty() {
                return Err(bad.corrupt("has an empty key, which no FileStore writes (zero bytes: was the file grown with truncate?)"));
            }
            let value = field(&mut log, &bad, "value")?;
            match key.split_first() {
                Some((&DELETE_MARK, deleted)) => {
                    self.entries.remove(deleted);
                }
                _ => {
                    self.entries.insert(key, value);
                }
            }
            // Whole records only: a later call resumes after the last one.
            self.pos = log.pos();
        }
        Ok(())
    }

    /// Records a record this process appended at the end it had caught up
    /// to (only valid under the exclusive lock, right after `catch_up`).
    pub fn applied(&mut self, key: &[u8], value: &[u8], record_len: usize) {
        match key.split_first() {
            Some((&DELETE_MARK, deleted)) => {
                self.entries.remove(deleted);
            }
            _ => {
                self.entries.insert(key.to_vec(), value.to_vec());
            }
        }
        self.pos += record_len as u64;
    }

    /// The offset replayed up to (the end of the file, under a lock, right
    /// after `catch_up`).
    pub fn end(&self) -> u64 {
        self.pos
    }

    /// The value of a record key (with its prefix), if set.
    pub fn value(&self, key: &[u8]) -> Option<&[u8]> {
        self.entries.get(key).map(Vec::as_slice)
    }

    /// How many keys are set, PyTorch's bookkeeping keys included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is set.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Where a bad record starts, for messages naming the file and offset.
struct Bad<'a> {
    record_start: u64,
    end: u64,
    describe: &'a dyn Fn() -> String,
}

impl Bad<'_> {
    fn corrupt(&self, detail: impl std::fmt::Display) -> Error {
        Error::new(
            ErrorKind::Corrupt,
            format!(
                "{} is not a valid FileStore log: the record at offset {} {detail} (file ends at offset {}); a writer was killed mid-record or the file is not a FileStore",
                (self.describe)(),
                self.record_start,
                self.end
            ),
        )
    }
}

/// The next length-prefixed field: its length is checked against the bytes
/// left in the file before anything is allocated.
fn field(log: &mut Forward<'_>, bad: &Bad<'_>, what: &str) -> Result<Vec<u8>> {
    if log.left() < 4 {
        return Err(bad.corrupt(format_args!("is cut inside the length of its {what}")));
    }
    let len = log.u32_ne().map_err(|e| read_error(e, bad, what, 4))?;
    let left = log.left();
    if u64::from(len) > left {
        return Err(bad.corrupt(format_args!("claims a {what} of {len} bytes but only {left} follow")));
    }
    log.take(u64::from(len)).map_err(|e| read_error(e, bad, what, len))
}

fn read_error(e: ReadError, bad: &Bad<'_>, what: &str, len: u32) -> Error {
    match e {
        ReadError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            bad.corrupt(format_args!("claims a {what} of {len} bytes, but the file shrank while it was read"))
        }
        ReadError::Io(e) => io_error(e, format_args!("unable to read {} at offset {}", (bad.describe)(), bad.record_start)),
        ReadError::Hole(at) => bad.corrupt(format_args!(
            "claims a {what} of {len} bytes that runs into a hole at offset {at} (the file was grown with truncate, not written)"
        )),
        ReadError::NoMemory => Error::new(
            ErrorKind::NoSpace,
            format!(
                "unable to read {}: the record at offset {} claims a {what} of {len} bytes, more than this process can allocate",
                (bad.describe)(),
                bad.record_start
            ),
        ),
    }
}

fn io_error(e: std::io::Error, context: std::fmt::Arguments) -> Error {
    match e.raw_os_error() {
        Some(errno) => Error::from_errno(errno, context),
        None => Error::new(ErrorKind::Io, format!("{context}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_file(tag: &str, bytes: &[u8]) -> (File, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("ss-torchlog-{}-{tag}", std::process::id()));
        std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
        (File::open(&path).unwrap(), path)
    }

    #[test]
    fn replays_sets_overwrites_and_deletes() {
        let mut log = Vec::new();
        for (k, v) in [(&b"/a"[..], &b"1"[..]), (b"/b", b"x"), (b"/a", b"2"), (b"-/b", b""), (b"refcount/", b"1")] {
            log.extend(encode(k, v).unwrap());
        }
        let (file, path) = temp_file("replay", &log);
        let mut r = Replay::default();
        r.catch_up(&file, &|| "log".into()).unwrap();
        assert_eq!(r.value(b"/a"), Some(&b"2"[..]));
        assert_eq!(r.value(b"/b"), None);
        assert_eq!(r.len(), 2);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_cut_or_oversized_record_names_its_offset() {
        let good = encode(b"/a", b"1").unwrap();
        for (tag, tail) in [("cut-len", vec![3u8, 0]), ("huge", vec![0xf0, 0xff, 0xff, 0xff, b'k'])] {
            let mut log = good.clone();
            log.extend(tail);
            let (file, path) = temp_file(tag, &log);
            let e = Replay::default().catch_up(&file, &|| "log".into()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{tag}");
            assert!(e.message().contains(&format!("offset {}", good.len())), "{tag}: {}", e.message());
            std::fs::remove_file(path).unwrap();
        }
    }
}
