//! The PyTorch format's file bodies, from [`super::torch_format`], in the
//! shapes the writer and reader use.

use super::meta::{TensorMeta, ViewBits};
use super::torch_format;
use crate::error::Result;
use std::io::Write;
use std::ops::Range;

/// Writes `torch.save(UntypedStorage)` of `data` to a new file (small
/// records buffered, the data passed straight through).
pub fn write_storage_file(f: &mut std::fs::File, data: &[u8]) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::with_capacity(64 << 10, f);
    torch_format::write_storage_file(&mut w, data)?;
    w.flush()
}

/// The bytes of a tensor entry.
pub fn tensor_file(meta: &TensorMeta) -> Vec<u8> {
    torch_format::tensor_file(meta)
}

/// Where the storage's bytes sit inside a storage file.
pub fn storage_data_range(file: &[u8]) -> Result<Range<usize>> {
    torch_format::storage_data_range(file)
}

/// A tensor entry, with its conjugate/negative bits, through the
/// restricted unpickler.
pub fn parse_tensor_file(file: &[u8]) -> Result<(TensorMeta, ViewBits)> {
    torch_format::parse_tensor_entry(file)
}
