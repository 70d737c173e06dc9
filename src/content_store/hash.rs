//! Content hashes: the names of stored storages.
//!
//! - [`HashMode::Stable`]: SHA-1 of the raw bytes, 40 lowercase hex
//!   characters: PyTorch's `hash_storage(stable_hash=True)`. The `sha1`
//!   crate picks its SHA-NI code at run time where the CPU has it.
//! - [`HashMode::Fast`]: XXH3-128 as a tree of 1 MiB chunks, 32 lowercase
//!   hex characters, the same on every machine:
//!   * `n <= 1 MiB`: `XXH3-128(bytes, seed 0)`;
//!   * otherwise: `XXH3-128(d_0 || d_1 || ... || d_k, seed n)` where `d_i`
//!     is `XXH3-128(chunk i, seed 0)` written as 16 big-endian bytes and
//!     chunk `i` is `bytes[i MiB .. min((i+1) MiB, n)]`.
//!
//!   The chunk hashes are independent, so big buffers are hashed on all
//!   cores; the digest does not depend on how many there are. In a child
//!   made by fork() they are hashed on the calling thread (the pool's
//!   threads stayed in the parent).

use super::fork_aware::hash_pool;
use crate::error::{Error, ErrorKind, Result};
use rayon::prelude::*;
use sha1::{Digest, Sha1};
use xxhash_rust::xxh3::{xxh3_128, xxh3_128_with_seed};

/// Which hash names a storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashMode {
    /// XXH3-128 tree (our format's default).
    Fast,
    /// SHA-1 (PyTorch's stable hash).
    Stable,
}

/// Chunk size of the fast hash's tree.
pub const FAST_CHUNK: usize = 1 << 20;

/// Below this many bytes the chunks are hashed on the calling thread
/// (spreading a few chunks over threads costs more than it saves).
const PARALLEL_FROM: usize = 4 << 20;

impl HashMode {
    /// The mode for the C constant (`SS_HASH_FAST` = 0, `SS_HASH_STABLE` = 1).
    pub fn from_code(code: i32) -> Result<HashMode> {
        match code {
            0 => Ok(HashMode::Fast),
            1 => Ok(HashMode::Stable),
            _ => Err(Error::new(ErrorKind::InvalidArgument, format!("unknown hash mode {code} (0 fast, 1 stable)"))),
        }
    }

    /// Length of the hex digest.
    pub fn hex_len(self) -> usize {
        match self {
            HashMode::Fast => 32,
            HashMode::Stable => 40,
        }
    }

    /// The name written in a native store's marker file.
    pub fn name(self) -> &'static str {
        match self {
            HashMode::Fast => "xxh3-128-tree",
            HashMode::Stable => "sha1",
        }
    }

    pub fn from_name(name: &str) -> Result<HashMode> {
        match name {
            "xxh3-128-tree" => Ok(HashMode::Fast),
            "sha1" => Ok(HashMode::Stable),
            _ => Err(Error::new(ErrorKind::Unsupported, format!("unknown hash algorithm {name:?}"))),
        }
    }
}

/// The lowercase hex digest of `data`.
pub fn hash_hex(data: &[u8], mode: HashMode) -> String {
    match mode {
        HashMode::Stable => hex(&Sha1::digest(data)),
        HashMode::Fast => hex(&fast_digest(data).to_be_bytes()),
    }
}

fn fast_digest(data: &[u8]) -> u128 {
    if data.len() <= FAST_CHUNK {
        return xxh3_128(data);
    }
    let pool = if data.len() >= PARALLEL_FROM { hash_pool() } else { None };
    let leaves: Vec<u128> = match pool {
        Some(pool) => pool.install(|| data.par_chunks(FAST_CHUNK).map(xxh3_128).collect()),
        None => data.chunks(FAST_CHUNK).map(xxh3_128).collect(),
    };
    let mut joined = Vec::with_capacity(leaves.len() * 16);
    for d in leaves {
        joined.extend_from_slice(&d.to_be_bytes());
    }
    xxh3_128_with_seed(&joined, data.len() as u64)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Whether `name` looks like a digest of `mode` (lowercase hex, right length).
pub fn is_digest(name: &str, mode: HashMode) -> bool {
    name.len() == mode.hex_len() && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_known_answers() {
        assert_eq!(hash_hex(b"", HashMode::Stable), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        assert_eq!(hash_hex(b"abc", HashMode::Stable), "a9993e364706816aba3e25717850c26c9cd0d89d");
    }

    #[test]
    fn fast_small_is_plain_xxh3_128() {
        // XXH3-128 of the empty input with seed 0 (xxHash's test vector).
        assert_eq!(hash_hex(b"", HashMode::Fast), "99aa06d3014798d86001c324468d497f");
        assert_eq!(hash_hex(b"abc", HashMode::Fast), hex(&xxh3_128(b"abc").to_be_bytes()));
    }

    #[test]
    fn fast_tree_matches_its_definition() {
        for n in [FAST_CHUNK + 1, 3 * FAST_CHUNK, 5 * FAST_CHUNK + 7] {
            let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4093) as u8).collect();
            let mut joined = Vec::new();
            for c in data.chunks(FAST_CHUNK) {
                joined.extend_from_slice(&xxh3_128(c).to_be_bytes());
            }
            let want = hex(&xxh3_128_with_seed(&joined, n as u64).to_be_bytes());
            assert_eq!(hash_hex(&data, HashMode::Fast), want, "n = {n}");
        }
    }

    /// Answers of an independent implementation (python-xxhash, the
    /// README's recipe), so the definition stays pinned.
    #[test]
    fn fast_known_answers() {
        assert_eq!(hash_hex(b"abc", HashMode::Fast), "06b05ab6733a618578af5f94892f3950");
        let data: Vec<u8> = (0..3 * FAST_CHUNK + 5).map(|i| (i * 7 + i / 4093) as u8).collect();
        assert_eq!(hash_hex(&data, HashMode::Fast), "b40c4669133888462cdb7de970050f3a");
    }

    #[test]
    fn fast_tree_depends_on_every_chunk_and_length() {
        let mut data = vec![0u8; 2 * FAST_CHUNK];
        let a = hash_hex(&data, HashMode::Fast);
        data[FAST_CHUNK + 5] = 1;
        assert_ne!(a, hash_hex(&data, HashMode::Fast));
        assert_ne!(hash_hex(&data[..FAST_CHUNK + 1], HashMode::Fast), hash_hex(&data[..FAST_CHUNK + 2], HashMode::Fast));
    }

    #[test]
    fn digest_shapes() {
        assert!(is_digest(&hash_hex(b"x", HashMode::Fast), HashMode::Fast));
        assert!(is_digest(&hash_hex(b"x", HashMode::Stable), HashMode::Stable));
        assert!(!is_digest("../etc/passwd", HashMode::Stable));
        assert!(!is_digest(&"A".repeat(40), HashMode::Stable));
        assert_eq!(HashMode::from_code(2).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
