//! PyTorch's on-disk encoding of content-store files: a storage file is
//! `torch.save(untyped_storage)` and a tensor entry is
//! `torch.save((dtype, hash, offset, torch.Size(shape), stride, {}))`, as
//! `torch.utils._content_store` writes and reads them. We write both
//! byte for byte as torch 2.x does (save for the archive folder name and
//! the serialization id), and read them back without running anything:
//! a checked zip reader and a restricted unpickler.
//! The facts this relies on, and how each was checked, are in
//! docs/torch-save-format.md.

pub mod image;
pub mod pickle;
pub mod unpickle;
pub mod zip;

use std::io::{self, Write};
use std::ops::Range;

use self::image::Image;
use self::pickle::Pickler;
use self::unpickle::{Allow, Global, Value};
use self::zip::{ZipEntry, ZipWriter};
use super::meta::{TensorMeta, ViewBits};
use crate::error::{Error, ErrorKind, Result};

/// The folder every record of our files sits in; torch.save uses this name
/// when it writes to a stream (from a path it uses the file's stem), and
/// torch.load accepts any.
const ARCHIVE: &str = "archive";

/// The serialization format version torch.save writes in `version`.
const VERSION_RECORD: &[u8] = b"3\n";
/// `.format_version` "1": storages may be located by offset arithmetic.
const FORMAT_VERSION_RECORD: &[u8] = b"1";
const ALIGNMENT_RECORD: &[u8] = b"64";
const BYTEORDER_RECORD: &[u8] = b"little";

/// Longest storage hash accepted in a tensor entry (hex digits).
const MAX_HASH_LEN: usize = 128;

/// Writes `torch.save(storage)` for a CPU UntypedStorage holding `data`.
/// The data is written once, in place, aligned to 64 bytes in the file.
pub fn write_storage_file(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    write_storage_file_with_crc(w, data, crc32fast::hash(data))
}

/// [`write_storage_file`] with the CRC-32 of `data` computed by the
/// caller, so the data is read once more only to be written.
pub fn write_storage_file_with_crc(w: &mut impl Write, data: &[u8], data_crc: u32) -> io::Result<()> {
    let pkl = storage_pickle(data.len() as u64);
    let id = serialization_id(&pkl, Some((data_crc, data.len() as u64)));
    write_archive(w, &pkl, Some((data, data_crc)), &id)
}

/// The bytes of [`write_storage_file`].
pub fn storage_file(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 1024);
    write_storage_file(&mut out, data).expect("writing to a Vec cannot fail");
    out
}

/// The bytes of `torch.save((dtype, hash, offset, torch.Size(shape),
/// stride, {}))`, the tensor entry ContentStoreWriter writes for a tensor
/// with neither the conjugate nor the negative bit set.
pub fn tensor_file(meta: &TensorMeta) -> Vec<u8> {
    tensor_file_with_bits(meta, ViewBits::default())
}

/// [`tensor_file`] for a tensor with the conjugate and/or negative bit
/// set: the metadata dict holds them as PyTorch writes it (`neg` first).
pub fn tensor_file_with_bits(meta: &TensorMeta, bits: ViewBits) -> Vec<u8> {
    debug_assert_eq!(meta.shape.len(), meta.stride.len(), "shape and stride of one tensor");
    let pkl = tensor_pickle(meta, bits);
    let id = serialization_id(&pkl, None);
    let mut out = Vec::with_capacity(1024);
    write_archive(&mut out, &pkl, None, &id).expect("writing to a Vec cannot fail");
    out
}

/// The records in the order torch.save writes them.
fn write_archive(w: &mut impl Write, pkl: &[u8], data: Option<(&[u8], u32)>, id: &str) -> io::Result<()> {
    let mut z = ZipWriter::new(w);
    z.add(&format!("{ARCHIVE}/data.pkl"), pkl)?;
    z.add(&format!("{ARCHIVE}/.format_version"), FORMAT_VERSION_RECORD)?;
    z.add(&format!("{ARCHIVE}/.storage_alignment"), ALIGNMENT_RECORD)?;
    z.add(&format!("{ARCHIVE}/byteorder"), BYTEORDER_RECORD)?;
    if let Some((data, crc)) = data {
        z.add_with_crc(&format!("{ARCHIVE}/data/0"), data, crc)?;
    }
    z.add(&format!("{ARCHIVE}/version"), VERSION_RECORD)?;
    z.add(&format!("{ARCHIVE}/.data/serialization_id"), id.as_bytes())?;
    z.finish()?;
    Ok(())
}

/// torch writes 40 decimal digits of its own choosing that nothing in
/// torch.load reads; ours come from the records' CRC-32s and sizes, so
/// the same content always gives the same file: the pickle's CRC-32, the
/// CRC-32 of the pickle and the data together, and their total length.
/// `data` is the data's CRC-32 and length, if the file has data.
fn serialization_id(pkl: &[u8], data: Option<(u32, u64)>) -> String {
    let first = crc32fast::hash(pkl);
    let mut crc = crc32fast::Hasher::new_with_initial(first);
    let mut len = pkl.len() as u64;
    if let Some((data_crc, data_len)) = data {
        crc.combine(&crc32fast::Hasher::new_with_initial_len(data_crc, data_len));
        len += data_len;
    }
    format!("{:020}{:020}", ((first as u64) << 32) | crc.finalize() as u64, len)
}

/// `('storage', torch.storage.UntypedStorage, '0', 'cpu', nbytes)` as a
/// persistent id: what torch.save pickles for an untyped storage.
fn storage_pickle(nbytes: u64) -> Vec<u8> {
    let mut p = Pickler::new();
    p.persistent_id(|p| {
        p.tuple(5, |p| {
            p.str("storage");
            p.global("torch.storage", "UntypedStorage");
            p.str("0");
            p.str("cpu");
            p.int(nbytes as i64);
        })
    });
    p.finish()
}

fn tensor_pickle(meta: &TensorMeta, bits: ViewBits) -> Vec<u8> {
    let set: Vec<(&str, bool)> = [("neg", bits.neg), ("conj", bits.conj)].into_iter().filter(|b| b.1).collect();
    let mut p = Pickler::new();
    p.tuple(6, |p| {
        p.global("torch", meta.dtype.torch_name());
        p.str(&meta.storage_hash);
        p.int(meta.offset);
        p.reduce(|p| p.global("torch", "Size"), 1, |p| p.int_tuple(&meta.shape));
        p.int_tuple(&meta.stride);
        p.str_bool_dict(&set);
    });
    p.finish()
}

fn corrupt(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, what.into())
}

/// A parsed torch.save archive: its records and their common folder.
struct Archive<'a> {
    file: &'a Image<'a>,
    prefix: String,
    entries: Vec<ZipEntry>,
}

impl<'a> Archive<'a> {
    fn parse(file: &'a Image<'a>) -> Result<Self> {
        let entries = zip::read_entries_in(file)?;
        let first = entries.first().ok_or_else(|| corrupt("not a torch.save zip: it has no records"))?;
        let prefix = match first.name.split_once('/') {
            Some((p, _)) if !p.is_empty() => format!("{p}/"),
            _ => return Err(corrupt(format!("not a torch.save zip: record {} is not in an archive folder", first.name))),
        };
        if let Some(e) = entries.iter().find(|e| !e.name.starts_with(&prefix)) {
            return Err(corrupt(format!("not a torch.save zip: record {} is outside the folder {prefix}", e.name)));
        }
        let archive = Archive { file, prefix, entries };
        if let Some(order) = archive.record("byteorder") {
            let text = archive.data(order)?;
            if text != BYTEORDER_RECORD {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("torch.save file has byte order {:?}; only little-endian files are read", String::from_utf8_lossy(text)),
                ));
            }
        }
        Ok(archive)
    }

    fn record(&self, name: &str) -> Option<&ZipEntry> {
        let full = format!("{}{name}", self.prefix);
        self.entries.iter().find(|e| e.name == full)
    }

    /// A record's bytes (an error if they are not at hand).
    fn data(&self, rec: &ZipEntry) -> Result<&'a [u8]> {
        self.file
            .get(rec.data.start, rec.data.len())
            .map_err(|_| corrupt(format!("not a torch.save zip: record {} lies in the part of the file not read", rec.name)))
    }

    /// The unpickled `data.pkl`, whose CRC must match.
    fn pickle(&self, allow: Allow) -> Result<Value> {
        let rec = self.record("data.pkl").ok_or_else(|| corrupt(format!("torch.save zip has no {}data.pkl", self.prefix)))?;
        let bytes = self.data(rec)?;
        if !rec.crc_ok_in(self.file) {
            return Err(corrupt(format!("{} does not match its CRC-32", rec.name)));
        }
        unpickle::unpickle(bytes, allow).map_err(|e| e.context(&rec.name))
    }
}

/// The byte range of the storage data inside a `torch.save(storage)` file
/// (ours or PyTorch's), for slicing a mapping of the file without a copy.
/// Checks the zip structure, that nothing is compressed, and that
/// `data.pkl` names one untyped storage `0` of exactly that many bytes.
/// The data's own CRC is not read here (the content hash covers it).
pub fn storage_data_range(file: &[u8]) -> Result<Range<usize>> {
    Ok(storage_data_record(file)?.0)
}

/// [`storage_data_range`] and the CRC-32 the zip gives for the data (0:
/// none was stored), for checking the bytes as they are copied out.
pub fn storage_data_record(file: &[u8]) -> Result<(Range<usize>, u32)> {
    storage_data_record_in(&Image::whole(file))
}

/// [`storage_data_record`] from an image of the file: only its records
/// other than the data need be at hand (see [`Image`]).
pub fn storage_data_record_in(file: &Image) -> Result<(Range<usize>, u32)> {
    let archive = Archive::parse(file)?;
    let storage = match archive.pickle(Allow::StorageFile)? {
        Value::Storage(s) => s,
        other => return Err(corrupt(format!("storage file pickles {}, not a torch.storage.UntypedStorage", other.describe()))),
    };
    if storage.key != "0" {
        return Err(corrupt(format!("storage file names storage key {:?}, not \"0\"", storage.key)));
    }
    let rec = archive.record("data/0").ok_or_else(|| corrupt(format!("storage file has no {}data/0 record", archive.prefix)))?;
    if rec.data.len() as u64 != storage.nbytes {
        return Err(corrupt(format!("storage file's pickle says {} bytes but {} holds {}", storage.nbytes, rec.name, rec.data.len())));
    }
    Ok((rec.data.clone(), rec.crc))
}

/// How a storage file's data stands against the CRC-32 its zip record
/// holds: the one check of its bytes when its name is not their SHA-1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataCrc {
    Matches,
    /// The writer stored no CRC (0): nothing to check against.
    Absent,
    Differs,
}

/// Checks the `data/0` record of a `torch.save(storage)` file against its
/// CRC-32 (after the checks of [`storage_data_range`]).
pub fn storage_data_crc(file: &[u8]) -> Result<DataCrc> {
    storage_data_range(file)?;
    let img = Image::whole(file);
    let archive = Archive::parse(&img)?;
    let rec = archive.record("data/0").ok_or_else(|| corrupt(format!("storage file has no {}data/0 record", archive.prefix)))?;
    Ok(match (rec.crc, rec.crc_ok(file)) {
        (0, _) => DataCrc::Absent,
        (_, true) => DataCrc::Matches,
        (_, false) => DataCrc::Differs,
    })
}

/// Reads a plain tensor entry written by ContentStoreWriter (or by
/// [`tensor_file`]) through the restricted unpickler. An entry with the
/// conjugate or negative bit set is refused (`Unsupported`), so a caller
/// that knows nothing of the bits never misreads the values: read those
/// with [`parse_tensor_entry`].
pub fn parse_tensor_file(file: &[u8]) -> Result<TensorMeta> {
    let (meta, bits) = parse_tensor_entry(file)?;
    if bits != ViewBits::default() {
        let which = if bits.conj { "conj" } else { "neg" };
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("tensor entry: tensor has the {which} bit set (a lazy view); read it with parse_tensor_entry, which gives the bits"),
        ));
    }
    Ok(meta)
}

/// Reads any tensor entry ContentStoreWriter writes, with its conjugate
/// and negative bits, as `ContentStoreReader.read_tensor` does.
pub fn parse_tensor_entry(file: &[u8]) -> Result<(TensorMeta, ViewBits)> {
    let img = Image::whole(file);
    let archive = Archive::parse(&img)?;
    let value = archive.pickle(Allow::TensorEntry)?;
    tensor_meta(&value).map_err(|e| e.context("tensor entry"))
}

fn tensor_meta(value: &Value) -> Result<(TensorMeta, ViewBits)> {
    let items = value
        .as_tuple()
        .filter(|t| t.len() == 6)
        .ok_or_else(|| corrupt(format!("pickle holds {}, not (dtype, hash, offset, shape, stride, metadata)", value.describe())))?;
    let dtype = match &items[0] {
        Value::Global(Global::Dtype(d)) => *d,
        other => return Err(corrupt(format!("dtype is {}, not a torch dtype", other.describe()))),
    };
    let storage_hash = match &items[1] {
        Value::Str(s) if is_hash(s) => s.to_string(),
        other => return Err(corrupt(format!("storage hash is {}, not 1 to {MAX_HASH_LEN} lowercase hex digits", other.describe()))),
    };
    let offset = match &items[2] {
        Value::Int(v) if *v >= 0 => *v,
        other => return Err(corrupt(format!("storage offset is {}, not an int >= 0", other.describe()))),
    };
    let shape = match &items[3] {
        Value::Size(dims) => dims.to_vec(),
        t @ Value::Tuple(_) => ints(t, "shape")?,
        other => return Err(corrupt(format!("shape is {}, not a torch.Size", other.describe()))),
    };
    let stride = ints(&items[4], "stride")?;
    if shape.len() != stride.len() {
        return Err(corrupt(format!("shape has {} dims but stride has {}", shape.len(), stride.len())));
    }
    if let Some(d) = shape.iter().find(|d| **d < 0) {
        return Err(corrupt(format!("shape has a negative size {d}")));
    }
    if let Some(s) = stride.iter().find(|s| **s < 0) {
        return Err(corrupt(format!("stride has a negative step {s}")));
    }
    let bits = view_bits(&items[5])?;
    Ok((TensorMeta { dtype, storage_hash, offset, shape, stride }, bits))
}

fn ints(v: &Value, what: &str) -> Result<Vec<i64>> {
    let items = v.as_tuple().ok_or_else(|| corrupt(format!("{what} is {}, not a tuple", v.describe())))?;
    items
        .iter()
        .map(|i| match i {
            Value::Int(x) => Ok(*x),
            other => Err(corrupt(format!("{what} holds {}, not an int", other.describe()))),
        })
        .collect()
}

fn is_hash(s: &str) -> bool {
    (1..=MAX_HASH_LEN).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The metadata dict: the tensor's conjugate and negative bits, each
/// present only when set (a `False` value is accepted too); any other key
/// or value is refused.
fn view_bits(v: &Value) -> Result<ViewBits> {
    let pairs = match v {
        Value::Dict(d) => &d.pairs,
        other => return Err(corrupt(format!("metadata is {}, not a dict", other.describe()))),
    };
    let mut bits = ViewBits::default();
    for (k, v) in pairs {
        match (k, v) {
            (Value::Str(k), Value::Bool(on)) if &**k == "conj" => bits.conj = *on,
            (Value::Str(k), Value::Bool(on)) if &**k == "neg" => bits.neg = *on,
            (k, v) => return Err(corrupt(format!("metadata has {} = {}, not a conj or neg bit", k.describe(), v.describe()))),
        }
    }
    Ok(bits)
}

#[cfg(test)]
mod tests;
