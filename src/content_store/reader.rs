//! Reading a store, which may come from anyone: names are checked before
//! they touch the file system, no symbolic link below the root is
//! followed, records are size-limited and fully checked, and a view that
//! reaches past its storage is refused. A storage is mapped read-only
//! when nobody but us can shrink its file, and otherwise copied into
//! memory of our own and checked (see `storage_io.rs`); a storage
//! read twice while in use is one mapping or copy. [`Reader::open_storage_file`]
//! copies a storage straight from its file into the caller's memory with
//! its CRC-32 checked.

use super::bounds::check_fits;
use super::copy_out;
use super::fork_aware::CacheLock;
use super::fsio;
use super::hash::{hash_hex, is_digest, HashMode};
use super::layout::{self, Format};
use super::meta::{TensorMeta, ViewBits};
use super::names::{tensor_name_parts, TEMP_PREFIX};
use super::storage_io::{self, CopiedBytes};
use super::{record, torch_glue};
use crate::error::{Error, ErrorKind, Result};
use memmap2::{Mmap, MmapOptions};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// Largest tensor entry read in the PyTorch format (a torch.save zip of a
/// small tuple; real ones are under 2 KiB).
const TORCH_ENTRY_MAX: usize = 1 << 20;
/// Deepest folder nesting listed under `tensors/`.
const MAX_DEPTH: usize = 256;

/// A storage's bytes, read-only: mapped from a file nobody else can
/// shrink, or copied from any other.
pub struct StorageBytes {
    hash: String,
    data: Held,
    /// Where the bytes lie in what is held.
    range: Range<usize>,
    /// The CRC-32 the file's zip record gives for them (PyTorch format;
    /// 0: none).
    crc: u32,
    verified: AtomicBool,
}

/// How a storage's bytes are held.
enum Held {
    Empty,
    /// The whole file, mapped.
    Mapped(Mmap),
    /// The bytes alone, copied (already checked against the file's
    /// CRC-32 or, in the native format, against the name).
    Copied(CopiedBytes),
}

/// A storage's file, open and parsed, for copying its bytes out once
/// (see [`StorageFile::read_into`]); nothing of it is mapped.
pub struct StorageFile {
    hash: String,
    file: File,
    range: Range<usize>,
    /// The CRC-32 the file holds for the bytes (PyTorch format; 0: none).
    crc: u32,
    /// Hash the bytes copied and compare with the name.
    verify: Option<HashMode>,
}

impl StorageFile {
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// How many bytes the storage has.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Copies the bytes into `dst`, which must be exactly as long, with
    /// `pread` (one copy, no page faults on a mapping). In the PyTorch
    /// format they are checked against the CRC-32 of their zip record in
    /// the same pass: a damaged file is an error (`Corrupt`) here, where
    /// [`Reader::read_storage`] hands out whatever is stored, as
    /// PyTorch's own reader does. A file without a CRC (0), or in the
    /// native format (named by its content hash: see
    /// [`Reader::set_verify`]), is copied unchecked.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<()> {
        let len = self.range.len();
        if dst.len() != len {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("storage {} has {len} bytes; the destination has {}", self.hash, dst.len()),
            ));
        }
        copy_out::read_checked(&self.file, self.range.start as u64, dst, self.crc, &format!("storage {}", self.hash))?;
        if let Some(mode) = self.verify {
            check_bytes(&self.hash, dst, mode)?;
        }
        Ok(())
    }
}

impl StorageBytes {
    pub fn hash(&self) -> &str {
        &self.hash
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Held::Empty => &[],
            Held::Mapped(m) => &m[self.range.clone()],
            Held::Copied(c) => &c.as_slice()[self.range.clone()],
        }
    }

    /// The CRC-32 the file's zip record holds for the bytes (PyTorch
    /// format; 0: none, and always in the native format).
    pub fn stored_crc(&self) -> u32 {
        self.crc
    }

    /// Whether the bytes were copied into memory of our own (the file was
    /// not one only we can shrink) rather than mapped.
    pub fn is_copied(&self) -> bool {
        matches!(self.data, Held::Copied(_))
    }
}

/// A tensor entry with its storage.
#[derive(Clone)]
pub struct Tensor {
    pub meta: TensorMeta,
    /// PyTorch's lazy conjugate/negative bits: the storage holds the
    /// bytes before they apply, as `ContentStoreReader` hands them out.
    pub bits: ViewBits,
    pub storage: Arc<StorageBytes>,
}

/// Something under `tensors/` or `storages/` that is neither a regular
/// file nor a folder (a link, a FIFO, ...): nothing can be read from it,
/// yet it may stand for an entry that refers to a storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OddObject {
    /// Its path from the store's root, e.g. `tensors/a/b`.
    pub object: String,
    /// What it is: "a symbolic link", "a FIFO", ...
    pub kind: &'static str,
}

/// Every object under `tensors/`: the entries that are regular files, by
/// name, and the odd ones.
#[derive(Clone, Debug, Default)]
pub struct EntryListing {
    pub names: Vec<String>,
    pub odd: Vec<OddObject>,
}

/// A reader of one store. Safe to share between threads.
pub struct Reader {
    root: PathBuf,
    root_fd: OwnedFd,
    format: Format,
    hash: HashMode,
    verify: AtomicBool,
    cache: CacheLock<HashMap<String, Weak<StorageBytes>>>,
}

impl Reader {
    /// Opens the store at `path`; its format is detected (see [`layout`]).
    pub fn open(path: &Path) -> Result<Reader> {
        let root_fd = fsio::open_root(path)?;
        let (format, hash) = layout::detect(&root_fd, path)?.ok_or_else(|| {
            Error::new(ErrorKind::NotFound, format!("no content store at {} (no storages/ or tensors/ folder)", path.display()))
        })?;
        Ok(Reader {
            root: path.to_path_buf(),
            root_fd,
            format,
            hash,
            verify: AtomicBool::new(false),
            cache: CacheLock::new(HashMap::new()),
        })
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn hash_mode(&self) -> HashMode {
        self.hash
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether storages are hashed and compared with their names before
    /// they are handed out (once per mapping; off by default).
    pub fn set_verify(&self, on: bool) {
        self.verify.store(on, Ordering::Relaxed);
    }

    /// The tensor entry `name` and its storage.
    pub fn read_tensor(&self, name: &str) -> Result<Tensor> {
        let (meta, bits) = self.read_entry(name)?;
        let storage = self.read_storage(&meta.storage_hash).map_err(|e| e.context(format!("tensor {name:?}")))?;
        check_fits(&meta, storage.bytes().len() as u64, ErrorKind::Corrupt).map_err(|e| e.context(format!("tensor {name:?}")))?;
        Ok(Tensor { meta, bits, storage })
    }

    /// The entry `name` without its storage.
    pub fn read_meta(&self, name: &str) -> Result<TensorMeta> {
        Ok(self.read_entry(name)?.0)
    }

    /// The entry `name` without its storage, with PyTorch's lazy
    /// conjugate/negative bits (always clear in the native format).
    pub fn read_entry(&self, name: &str) -> Result<(TensorMeta, ViewBits)> {
        let bytes = self.read_entry_file(name)?;
        let what = format!("tensor entry {name:?}");
        let (meta, bits) = match self.format {
            Format::Native => record::decode(&bytes).map(|m| (m, ViewBits::default())),
            Format::Torch => torch_glue::parse_tensor_file(&bytes),
        }
        .map_err(|e| e.context(&what))?;
        if !self.is_storage_name(&meta.storage_hash) {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("{what} names storage {:?}, which is not a {} hash", meta.storage_hash, self.hash.name()),
            ));
        }
        Ok((meta, bits))
    }

    /// The bytes of the entry `name`, unparsed, read with every check
    /// but the parse: the name stays inside `tensors/`, no link is
    /// followed, only a regular file of bounded size is read. Errors
    /// here are refusals (or a missing entry), never "cannot parse".
    pub fn read_entry_file(&self, name: &str) -> Result<Vec<u8>> {
        let mut parts = vec![layout::TENSORS];
        parts.extend(tensor_name_parts(name)?);
        let file = fsio::open_regular(&self.root_fd, &self.root, &parts, "tensor entry").map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                // A folder of tensors, or a tensor where a folder would be,
                // is no tensor of that name either.
                Error::new(ErrorKind::NotFound, format!("no tensor {name:?} in {}: {}", self.root.display(), e.message()))
            } else {
                e
            }
        })?;
        let what = format!("tensor entry {name:?}");
        let max = match self.format {
            Format::Native => record::MAX_RECORD_LEN,
            Format::Torch => TORCH_ENTRY_MAX,
        };
        fsio::read_small(file, max, &what)
    }

    fn check_storage_name(&self, hash: &str) -> Result<()> {
        if !self.is_storage_name(hash) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{hash:?} is not a storage hash of this {} store", self.format.name()),
            ));
        }
        Ok(())
    }

    fn is_storage_name(&self, hash: &str) -> bool {
        match self.format {
            Format::Native => is_digest(hash, self.hash),
            // PyTorch's non-stable hash is 40 hex characters as well.
            Format::Torch => is_digest(hash, HashMode::Stable),
        }
    }

    /// The storage named `hash`, mapped read-only; the same mapping while
    /// any earlier result for it is alive.
    pub fn read_storage(&self, hash: &str) -> Result<Arc<StorageBytes>> {
        self.check_storage_name(hash)?;
        let cached = self.cache.lock().and_then(|cache| cache.get(hash).and_then(Weak::upgrade));
        let storage = match cached {
            Some(s) => s,
            None => {
                let fresh = Arc::new(self.map_storage(hash)?);
                match self.cache.lock() {
                    // Another thread may have mapped it meanwhile: keep one.
                    Some(mut cache) => match cache.get(hash).and_then(Weak::upgrade) {
                        Some(s) => s,
                        None => {
                            cache.retain(|_, w| w.strong_count() > 0);
                            cache.insert(hash.to_string(), Arc::downgrade(&fresh));
                            fresh
                        }
                    },
                    // A forked child whose cache a parent thread held.
                    None => fresh,
                }
            }
        };
        if self.verify.load(Ordering::Relaxed) && !storage.verified.load(Ordering::Relaxed) {
            check_hash(&storage, self.hash)?;
            storage.verified.store(true, Ordering::Relaxed);
        }
        Ok(storage)
    }

    /// The storage named `hash`, open and parsed, for copying its bytes
    /// out once with [`StorageFile::read_into`] (the way to read a
    /// storage into memory of one's own; no mapping is kept, and no
    /// cache). With [`Reader::set_verify`] on, the bytes copied are
    /// hashed and compared with the name as well.
    pub fn open_storage_file(&self, hash: &str) -> Result<StorageFile> {
        self.check_storage_name(hash)?;
        let (file, _meta, range, crc) = self.open_parsed(hash)?;
        let verify = self.verify.load(Ordering::Relaxed).then_some(self.hash);
        Ok(StorageFile { hash: hash.to_string(), file, range, crc, verify })
    }

    /// The storage's bytes: mapped when nobody but us can shrink the
    /// file, else copied and checked (CRC-32, or the name in the native
    /// format), so that what is handed out never faults.
    fn map_storage(&self, hash: &str) -> Result<StorageBytes> {
        let (file, meta, range, crc) = self.open_parsed(hash)?;
        let what = format!("storage {hash}");
        let mut verified = false;
        let (data, range) = if range.is_empty() {
            (Held::Empty, 0..0)
        } else if storage_io::only_we_can_shrink(&meta) {
            // SAFETY: a read-only private mapping of a regular file that
            // only this user (or root) can truncate; files in a store are
            // never modified in place, only replaced by rename.
            let map = unsafe { MmapOptions::new().len(meta.len() as usize).map(&file) }
                .map_err(|e| Error::new(ErrorKind::Io, format!("unable to map {what}: {e}")))?;
            (Held::Mapped(map), range)
        } else {
            let copied = storage_io::copy_range(&file, range.clone(), crc, &what)?;
            if self.format == Format::Native {
                // No CRC in the file: the name is the check.
                check_bytes(hash, copied.as_slice(), self.hash)?;
                verified = true;
            }
            (Held::Copied(copied), 0..range.len())
        };
        Ok(StorageBytes { hash: hash.to_string(), data, range, crc, verified: AtomicBool::new(verified) })
    }

    /// The storage's file, its metadata, where its bytes lie in it, and
    /// the CRC-32 it holds for them (0: none). Nothing is mapped.
    fn open_parsed(&self, hash: &str) -> Result<(File, std::fs::Metadata, Range<usize>, u32)> {
        let file = fsio::open_regular(&self.root_fd, &self.root, &[layout::STORAGES, hash], "storage").map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                Error::new(ErrorKind::NotFound, format!("no storage {hash} in {}", self.root.display()))
            } else {
                e
            }
        })?;
        let meta = file.metadata().map_err(|e| Error::new(ErrorKind::Io, format!("unable to stat storage {hash}: {e}")))?;
        let len = usize::try_from(meta.len()).map_err(|_| Error::new(ErrorKind::Corrupt, format!("storage {hash} is too big to read")))?;
        let (range, crc) = match self.format {
            Format::Native => (0..len, 0),
            Format::Torch => {
                let (r, crc) = storage_io::torch_data_record(&file, len, &format!("storage {hash}"))?;
                if r.start > r.end || r.end > len {
                    return Err(Error::new(ErrorKind::Corrupt, format!("storage {hash}: data range {r:?} outside its {len}-byte file")));
                }
                (r, crc)
            }
        };
        Ok((file, meta, range, crc))
    }

    /// Names of every tensor entry that is a regular file, sorted (links,
    /// FIFOs and temporary files are left out: see [`Reader::list_entries`]).
    pub fn list_tensors(&self) -> Result<Vec<String>> {
        Ok(self.list_entries()?.names)
    }

    /// Every object under `tensors/`, without following links: regular
    /// entries by name, sorted, and whatever else is there (links to
    /// files or folders, FIFOs, ...), which no entry can be read from.
    pub fn list_entries(&self) -> Result<EntryListing> {
        let mut listing = EntryListing::default();
        let top = self.root.join(layout::TENSORS);
        match std::fs::symlink_metadata(&top) {
            Ok(m) if m.is_dir() => walk(&top, "", 0, &mut listing)?,
            Ok(m) => listing.odd.push(OddObject { object: layout::TENSORS.to_string(), kind: fsio::file_kind(m.file_type()) }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::new(ErrorKind::Io, format!("unable to stat {}: {e}", top.display()))),
        }
        listing.names.sort();
        listing.odd.sort_by(|a, b| a.object.cmp(&b.object));
        Ok(listing)
    }

    /// Every storage: hash and size of its bytes (in the PyTorch format
    /// the file is a torch.save zip around them), sorted by hash.
    pub fn list_storages(&self) -> Result<Vec<(String, u64)>> {
        let files = self.scan_storages()?.0;
        if self.format == Format::Native {
            return Ok(files);
        }
        files
            .into_iter()
            .map(|(hash, file_len)| {
                // Parsed from the file's ends (no copy of the data); a file
                // that does not parse shows its file size, and verify names it.
                let size = self.open_parsed(&hash).map_or(file_len, |(_, _, range, _)| range.len() as u64);
                Ok((hash, size))
            })
            .collect()
    }

    /// Objects under `storages/` that are not regular files (a link, a
    /// FIFO, a folder): no storage can be read from them.
    pub fn odd_storages(&self) -> Result<Vec<OddObject>> {
        Ok(self.scan_storages()?.1)
    }

    /// Regular files under `storages/` (hash, file size), sorted, and the
    /// other objects there.
    fn scan_storages(&self) -> Result<StorageScan> {
        let dir = self.root.join(layout::STORAGES);
        let (mut files, mut odd) = (Vec::new(), Vec::new());
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(m) => {
                odd.push(OddObject { object: layout::STORAGES.to_string(), kind: fsio::file_kind(m.file_type()) });
                return Ok((files, odd));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((files, odd)),
            Err(e) => return Err(Error::new(ErrorKind::Io, format!("unable to stat {}: {e}", dir.display()))),
        }
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::new(ErrorKind::Io, format!("unable to list {}: {e}", dir.display())))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::new(ErrorKind::Io, format!("unable to list {}: {e}", dir.display())))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(TEMP_PREFIX) {
                continue;
            }
            // DirEntry::metadata does not follow links.
            let meta = entry.metadata().map_err(|e| Error::new(ErrorKind::Io, format!("unable to stat storage {name}: {e}")))?;
            if meta.is_file() {
                files.push((name, meta.len()));
            } else {
                odd.push(OddObject { object: format!("{}/{name}", layout::STORAGES), kind: fsio::file_kind(meta.file_type()) });
            }
        }
        files.sort();
        odd.sort_by(|a, b| a.object.cmp(&b.object));
        Ok((files, odd))
    }
}

/// Regular files under `storages/` (hash, file size) and the odd objects.
type StorageScan = (Vec<(String, u64)>, Vec<OddObject>);

/// Hashes a storage's bytes and compares with its name.
pub fn check_hash(storage: &StorageBytes, mode: HashMode) -> Result<()> {
    check_bytes(&storage.hash, storage.bytes(), mode)
}

fn check_bytes(hash: &str, bytes: &[u8], mode: HashMode) -> Result<()> {
    let got = hash_hex(bytes, mode);
    if got != hash {
        return Err(Error::new(ErrorKind::Corrupt, format!("storage {hash} has bytes whose {} hash is {got}", mode.name())));
    }
    Ok(())
}

fn walk(dir: &Path, prefix: &str, depth: usize, out: &mut EntryListing) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(Error::new(ErrorKind::Corrupt, format!("{} nests folders deeper than {MAX_DEPTH}", dir.display())));
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && depth == 0 => return Ok(()),
        Err(e) => return Err(Error::new(ErrorKind::Io, format!("unable to list {}: {e}", dir.display()))),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::new(ErrorKind::Io, format!("unable to list {}: {e}", dir.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(TEMP_PREFIX) {
            continue;
        }
        // file_type does not follow links: a link is neither.
        let ty = entry.file_type().map_err(|e| Error::new(ErrorKind::Io, format!("unable to stat {name}: {e}")))?;
        let full = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
        if ty.is_dir() {
            walk(&entry.path(), &full, depth + 1, out)?;
        } else if ty.is_file() {
            out.names.push(full);
        } else {
            out.odd.push(OddObject { object: format!("{}/{full}", layout::TENSORS), kind: fsio::file_kind(ty) });
        }
    }
    Ok(())
}
