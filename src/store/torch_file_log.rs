//! The record log of PyTorch's FileStore file, and the replay of it into a
//! key map (see docs/pytorch-filestore.md).
//!
//! A record is a key and a value, each a 32-bit length in the host's byte
//! order followed by that many bytes. Records are only ever appended; the
//! newest record of a key wins, and a record whose key starts with `-`
//! deletes the key that follows the dash.

use crate::error::{Error, ErrorKind, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};

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
    /// make whole records are corruption (a writer killed mid-write, or a
    /// file that is not a FileStore) and reported with their offset.
    pub fn catch_up(&mut self, file: &File, describe: &dyn Fn() -> String) -> Result<()> {
        let meta = file.metadata().map_err(|e| io_error(e, format_args!("unable to stat {}", describe())))?;
        let id = (meta.dev(), meta.ino());
        let size = meta.len();
        if self.file != Some(id) || size < self.pos {
            *self = Replay { file: Some(id), ..Replay::default() };
        }
        if size == self.pos {
            return Ok(());
        }
        let len = usize::try_from(size - self.pos).map_err(|_| {
            Error::new(ErrorKind::NoSpace, format!("{} grew by {} bytes, more than this process can read", describe(), size - self.pos))
        })?;
        let mut bytes = vec![0u8; len];
        file.read_exact_at(&mut bytes, self.pos)
            .map_err(|e| io_error(e, format_args!("unable to read {} at offset {}", describe(), self.pos)))?;
        let mut at = 0usize;
        while at < bytes.len() {
            let record_start = self.pos + at as u64;
            let (key, after_key) = field(&bytes, at, record_start, "key", describe)?;
            let (value, after_value) = field(&bytes, after_key, record_start, "value", describe)?;
            match key.split_first() {
                Some((&DELETE_MARK, deleted)) => {
                    self.entries.remove(deleted);
                }
                _ => {
                    self.entries.insert(key.to_vec(), value.to_vec());
                }
            }
            at = after_value;
        }
        self.pos = size;
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

/// One length-prefixed field at `at`: its bytes and the offset after it.
fn field<'a>(bytes: &'a [u8], at: usize, record_start: u64, what: &str, describe: &dyn Fn() -> String) -> Result<(&'a [u8], usize)> {
    let end_of_file = record_start + (bytes.len() - at) as u64;
    let corrupt = |detail: String| {
        Error::new(
            ErrorKind::Corrupt,
            format!("{} is not a valid FileStore log: the record at offset {record_start} {detail} (file ends at offset {end_of_file}); a writer was killed mid-record or the file is not a FileStore", describe()),
        )
    };
    let Some(len_bytes) = bytes.get(at..at + 4) else {
        return Err(corrupt(format!("is cut inside the length of its {what}")));
    };
    let len = u32::from_ne_bytes(len_bytes.try_into().expect("4 bytes")) as usize;
    let start = at + 4;
    match bytes.get(start..).filter(|rest| rest.len() >= len) {
        Some(rest) => Ok((&rest[..len], start + len)),
        None => Err(corrupt(format!("claims a {what} of {len} bytes but only {} follow", bytes.len() - start))),
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
