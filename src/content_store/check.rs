//! Whole-store checks and cleanup: `verify` (every storage hashed against
//! its name, every tensor entry parsed and bounds-checked) and `gc`
//! (storages no entry refers to, and temporary files of dead writers).

use super::layout::{self, Format};
use super::names::TEMP_PREFIX;
use super::reader::{check_hash, Reader};
use super::writer::flock;
use super::fsio;
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
    pub problems: Vec<Problem>,
}

/// Checks every storage and tensor entry of the store; `progress` gets
/// (bytes hashed so far, total bytes) after each storage.
pub fn verify(reader: &Reader, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
    let storages = reader.list_storages()?;
    let total: u64 = storages.iter().map(|s| s.1).sum();
    let mut report = VerifyReport::default();
    let mut done = 0u64;
    let hint = if reader.format() == Format::Torch { " (a PyTorch store written without stable_hash=True has unverifiable names)" } else { "" };
    for (hash, size) in &storages {
        let result = reader.read_storage(hash).and_then(|s| {
            report.bytes += s.bytes().len() as u64;
            check_hash(&s, reader.hash_mode())
        });
        if let Err(e) = result {
            let why = if e.message().contains("hash is") { format!("{}{hint}", e.message()) } else { e.message().to_string() };
            report.problems.push(Problem { object: format!("{}/{hash}", layout::STORAGES), why });
        }
        report.storages += 1;
        done += size;
        progress(done, total);
    }
    for name in reader.list_tensors()? {
        if let Err(e) = reader.read_tensor(&name) {
            report.problems.push(Problem { object: format!("{}/{name}", layout::TENSORS), why: e.message().to_string() });
        }
        report.tensors += 1;
    }
    Ok(report)
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
/// be about to write the entry for a storage), and when any entry cannot
/// be read (its storage might be needed).
pub fn gc(root: &Path, dry_run: bool) -> Result<GcReport> {
    let reader = Reader::open(root)?;
    let lock_path = root.join(layout::LOCK);
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| Error::new(ErrorKind::Io, format!("unable to open lock file {}: {e}", lock_path.display())))?;
    flock(&lock, libc::LOCK_EX | libc::LOCK_NB, &lock_path)?;
    let mut used = HashSet::new();
    for name in reader.list_tensors()? {
        let meta = reader.read_meta(&name).map_err(|e| {
            Error::new(e.kind(), format!("gc refused: tensor {name:?} cannot be read ({}); its storage might be needed", e.message()))
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
