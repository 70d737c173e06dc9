//! The PyTorch format's file bodies, from [`super::torch_format`], in the
//! shapes the writer and reader use.

use super::fork_aware::hash_pool;
use super::meta::{TensorMeta, ViewBits};
use super::torch_format;
use crate::error::Result;
use rayon::prelude::*;
use std::io::Write;

/// Writes `torch.save(UntypedStorage)` of `data` to a new file (small
/// records buffered, the data passed straight through).
pub fn write_storage_file(f: &mut std::fs::File, data: &[u8]) -> std::io::Result<()> {
    let crc = crc32(data);
    let mut w = std::io::BufWriter::with_capacity(64 << 10, f);
    torch_format::write_storage_file_with_crc(&mut w, data, crc)?;
    w.flush()
}

/// CRC-32 of `data`; a big buffer in 1 MiB pieces on the hashing pool,
/// their CRCs combined in order (the same value as one pass).
fn crc32(data: &[u8]) -> u32 {
    const PIECE: usize = 1 << 20;
    let pool = if data.len() >= 4 * PIECE { hash_pool() } else { None };
    let Some(pool) = pool else {
        return crc32fast::hash(data);
    };
    let pieces: Vec<crc32fast::Hasher> = pool
        .install(|| data.par_chunks(PIECE).map(|c| crc32fast::Hasher::new_with_initial_len(crc32fast::hash(c), c.len() as u64)).collect());
    let mut all = crc32fast::Hasher::new();
    for p in &pieces {
        all.combine(p);
    }
    all.finalize()
}

/// The bytes of a tensor entry.
pub fn tensor_file(meta: &TensorMeta) -> Vec<u8> {
    torch_format::tensor_file(meta)
}

/// A tensor entry, with its conjugate/negative bits, through the
/// restricted unpickler.
pub fn parse_tensor_file(file: &[u8]) -> Result<(TensorMeta, ViewBits)> {
    torch_format::parse_tensor_entry(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces' CRCs combined equal one pass, at and around the sizes
    /// where the pool takes over.
    #[test]
    fn crc_in_pieces_is_the_crc_of_the_whole() {
        for n in [0, 1, (4 << 20) - 1, 4 << 20, (9 << 20) + 7] {
            let data: Vec<u8> = (0..n).map(|i| (i * 31 + i / 1021) as u8).collect();
            assert_eq!(crc32(&data), crc32fast::hash(&data), "n = {n}");
        }
    }
}
