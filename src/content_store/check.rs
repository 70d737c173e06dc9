//! Whole-store checks and cleanup: `verify` (every storage hashed against
//! its name, every tensor entry parsed and bounds-checked) and `gc`
//! (storages no entry refers to, and temporary files of dead writers).

use super::fsio;
use super::hash::hash_hex;
use super::layout::{self, Format};
use super::names::TEMP_PREFIX;
use super::reader::{OddObject, Reader};
use super::store_lock::StoreLock;
use super::torch_default_hash::torch_default_hash_hex;
use crate::error::{Error, ErrorKind, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// One object that failed a check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// `storages/<hash>` or `tensors/<name>`.
    pub object: String,
    pub why: String,
}

/// What [`verify`] found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub storages: u64,
    pub tensors: u64,
    pub bytes: u64,
    /// Corrupt or unreadable objects.
    pub problems: Vec<Problem>,
}

/// Checks every storage and tensor entry of the store, and reports every
/// object under `tensors/` or `storages/` that cannot be read as a
/// regular record (a link, a FIFO, ...); `progress` gets (bytes hashed so
/// far, total bytes) after each storage.
pub fn verify(reader: &Reader, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
    let storages = reader.list_storages()?;
    let total: u64 = storages.iter().map(|s| s.1).sum();
    let mut report = VerifyReport::default();
    let mut done = 0u64;
    for (hash, size) in &storages {
        let object = format!("{}/{hash}", layout::STORAGES);
        match check_storage(reader, hash) {
            Ok(n) => report.bytes += n,
            Err(e) => report.problems.push(Problem { object, why: e.message().to_string() }),
        }
        report.storages += 1;
        done += size;
        progress(done, total);
    }
    for odd in reader.odd_storages()? {
        report.problems.push(Problem { why: format!("{} is {}, not a regular storage file", odd.object, odd.kind), object: odd.object });
    }
    let listing = reader.list_entries()?;
    for name in &listing.names {
        if let Err(e) = reader.read_tensor(name) {
            report.problems.push(Problem { object: format!("{}/{name}", layout::TENSORS), why: e.message().to_string() });
        }
        report.tensors += 1;
    }
    for odd in listing.odd {
        report.problems.push(Problem { why: odd_entry_text(&odd), object: odd.object });
        report.tensors += 1;
    }
    report.problems.sort_by(|a, b| a.object.cmp(&b.object));
    Ok(report)
}

fn odd_entry_text(odd: &OddObject) -> String {
    format!("{} is {}, not a regular tensor entry (it cannot be read, and the storage it stands for cannot be known)", odd.object, odd.kind)
}

/// Checks that the storage's name is the hash of its bytes; returns how
/// many bytes it has. In the PyTorch format a name is the SHA-1
/// (`stable_hash=True`) or PyTorch's default hash of the bytes (both 40
/// hex digits): anything else is corrupt, even when the bytes match their
/// zip CRC-32 (another storage's file put in its place).
fn check_storage(reader: &Reader, hash: &str) -> Result<u64> {
    let s = reader.read_storage(hash)?;
    let n = s.bytes().len() as u64;
    let mode = reader.hash_mode();
    let named = hash_hex(s.bytes(), mode);
    if named == hash {
        return Ok(n);
    }
    if reader.format() != Format::Torch {
        return Err(Error::new(ErrorKind::Corrupt, format!("storage {hash} has bytes whose {} hash is {named}", mode.name())));
    }
    let default = torch_default_hash_hex(s.bytes());
    if default == hash {
        return Ok(n);
    }
    let crc = s.stored_crc();
    let why = if crc == 0 {
        "the file holds no CRC-32 to tell damage from a swapped file"
    } else if crc32fast::hash(s.bytes()) == crc {
        "the bytes match their zip CRC-32: the file holds another storage (replaced or renamed)"
    } else {
        "nor do they match their zip CRC-32: the bytes are damaged"
    };
    Err(Error::new(
        ErrorKind::Corrupt,
        format!("storage {hash}: its name is neither the SHA-1 ({}) nor PyTorch's default hash ({default}) of its bytes; {why}", named),
    ))
}

/// What [`gc`] removed (or would remove, on a dry run).
#[derive(Clone, Debug, Default)]
pub struct GcReport {
    /// Unreferenced storages: hash and size.
    pub storages: Vec<(String, u64)>,
    /// Leftover temporary files of writers that died.
    pub temp_files: Vec<PathBuf>,
    pub kept_storages: u64,
}

/// Removes storages that no tensor entry names, and temporary files left
/// by killed writers. Refuses while a writer has the store open (it may
/// be about to write the entry for a storage), and, naming the entry,
/// when any entry cannot be read or any object under `tensors/` is not a
/// regular entry (a link, a FIFO, a linked folder): never on a partial
/// view of the references.
pub fn gc(root: &Path, dry_run: bool) -> Result<GcReport> {
    let reader = Reader::open(root)?;
    let lock = StoreLock::exclusive_now(&root.join(layout::LOCK))?;
    let listing = reader.list_entries().map_err(|e| e.context("gc refused: the tensor entries cannot all be listed"))?;
    if let Some(odd) = listing.odd.first() {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("gc refused: {}; remove it or put the entry back, then run gc again", odd_entry_text(odd)),
        ));
    }
    let mut used = HashSet::new();
    for name in listing.names {
        let meta = reader.read_meta(&name).map_err(|e| {
            Error::new(
                e.kind(),
                format!(
                    "gc refused: tensor {name:?} ({}/{name}) cannot be read ({}); its storage might be needed",
                    layout::TENSORS,
                    e.message()
                ),
            )
        })?;
        used.insert(meta.storage_hash);
    }
    let mut report = GcReport::default();
    let storages_dir = root.join(layout::STORAGES);
    for (hash, size) in reader.list_storages()? {
        if used.contains(&hash) {
            report.kept_storages += 1;
        } else {
            if !dry_run {
                std::fs::remove_file(storages_dir.join(&hash))
                    .map_err(|e| Error::new(ErrorKind::Io, format!("unable to remove storage {hash}: {e}")))?;
            }
            report.storages.push((hash, size));
        }
    }
    collect_temp_files(root, 0, &mut report.temp_files)?;
    if !dry_run {
        for t in &report.temp_files {
            std::fs::remove_file(t).map_err(|e| Error::new(ErrorKind::Io, format!("unable to remove {}: {e}", t.display())))?;
        }
        if !report.storages.is_empty() {
            fsio::sync_dir(&storages_dir)?;
        }
    }
    drop(lock);
    Ok(report)
}

fn collect_temp_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<()> {
    if depth > 256 {
        return Ok(());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::new(ErrorKind::Io, format!("unable to list {}: {e}", dir.display())))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::new(ErrorKind::Io, format!("unable to list {}: {e}", dir.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ty = entry.file_type().map_err(|e| Error::new(ErrorKind::Io, format!("unable to stat {name}: {e}")))?;
        if name.starts_with(TEMP_PREFIX) && ty.is_file() {
            out.push(entry.path());
        } else if ty.is_dir() && (depth > 0 || name == layout::STORAGES || name == layout::TENSORS) {
            collect_temp_files(&entry.path(), depth + 1, out)?;
        }
    }
    Ok(())
}
