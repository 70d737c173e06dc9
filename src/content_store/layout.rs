//! Where things sit in a store and which format a folder holds.
//!
//! Both formats: `storages/<hash>` and `tensors/<name>` (PyTorch's
//! layout). A native store also has the text file `ss-content-store` at
//! its root:
//!
//! ```text
//! storage-sharing content store
//! version 1
//! hash xxh3-128-tree
//! ```
//!
//! A folder without it that has `storages/` or `tensors/` is a PyTorch
//! store (SHA-1 names if written with `stable_hash=True`).

use super::fsio;
use super::hash::HashMode;
use crate::error::{Error, ErrorKind, Result};
use std::os::fd::OwnedFd;
use std::path::Path;

pub const MARKER: &str = "ss-content-store";
pub const STORAGES: &str = "storages";
pub const TENSORS: &str = "tensors";
/// Writers hold a shared lock on this file; `gc` needs it exclusively.
pub const LOCK: &str = ".ss-lock";
const MARKER_MAX: usize = 4096;

/// On-disk format of a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Raw storage bytes and binary tensor records (this library's).
    Native,
    /// torch.save files that `torch.utils._content_store` reads.
    Torch,
}

impl Format {
    /// The format for the C constant (`SS_CONTENT_FORMAT_NATIVE` = 0,
    /// `SS_CONTENT_FORMAT_TORCH` = 1).
    pub fn from_code(code: i32) -> Result<Format> {
        match code {
            0 => Ok(Format::Native),
            1 => Ok(Format::Torch),
            _ => Err(Error::new(ErrorKind::InvalidArgument, format!("unknown content store format {code} (0 native, 1 torch)"))),
        }
    }

    pub fn code(self) -> i32 {
        match self {
            Format::Native => 0,
            Format::Torch => 1,
        }
    }

    /// The hash that names storages in this format.
    pub fn hash_mode(self) -> HashMode {
        match self {
            Format::Native => HashMode::Fast,
            Format::Torch => HashMode::Stable,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Native => "native",
            Format::Torch => "torch",
        }
    }
}

/// The marker file's text for a native store.
pub fn marker_text(hash: HashMode) -> String {
    format!("storage-sharing content store\nversion 1\nhash {}\n", hash.name())
}

fn parse_marker(text: &[u8], path: &Path) -> Result<HashMode> {
    let bad = |why: &str| Error::new(ErrorKind::Corrupt, format!("{}/{MARKER}: {why}", path.display()));
    let text = std::str::from_utf8(text).map_err(|_| bad("not UTF-8"))?;
    let mut lines = text.lines();
    if lines.next() != Some("storage-sharing content store") {
        return Err(bad("first line is not `storage-sharing content store`"));
    }
    match lines.next() {
        Some("version 1") => {}
        Some(v) => {
            return Err(Error::new(ErrorKind::Unsupported, format!("{}/{MARKER}: {v:?}; this library reads version 1", path.display())))
        }
        None => return Err(bad("no version line")),
    }
    let hash = lines.next().and_then(|l| l.strip_prefix("hash ")).ok_or_else(|| bad("no `hash <name>` line"))?;
    HashMode::from_name(hash)
}

/// What a folder holds: `Some(Native{hash})`, `Some(Torch)`, or `None`
/// for a folder with no store yet.
pub fn detect(root_fd: &OwnedFd, root: &Path) -> Result<Option<(Format, HashMode)>> {
    // The folders first, the marker second: a native writer writes its
    // marker before any folder, so folders seen before a marker that is
    // still missing are a torch store's, never a native store being made
    // by another writer at this moment (the other order saw its folders
    // but not its marker, and refused a concurrent native open).
    let has = |name: &str| std::fs::symlink_metadata(root.join(name)).is_ok_and(|m| m.is_dir());
    let folders = has(STORAGES) || has(TENSORS);
    match fsio::open_regular(root_fd, root, &[MARKER], "store marker") {
        Ok(f) => {
            let text = fsio::read_small(f, MARKER_MAX, "store marker")?;
            return Ok(Some((Format::Native, parse_marker(&text, root)?)));
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if folders {
        return Ok(Some((Format::Torch, HashMode::Stable)));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_round_trip_and_refusals() {
        let p = Path::new("/s");
        assert_eq!(parse_marker(marker_text(HashMode::Fast).as_bytes(), p).unwrap(), HashMode::Fast);
        assert_eq!(parse_marker(b"storage-sharing content store\nversion 2\nhash sha1\n", p).unwrap_err().kind(), ErrorKind::Unsupported);
        assert_eq!(parse_marker(b"something else\n", p).unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(parse_marker(b"storage-sharing content store\nversion 1\nhash md5\n", p).unwrap_err().kind(), ErrorKind::Unsupported);
        assert_eq!(Format::from_code(7).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
