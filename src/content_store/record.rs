//! The native format's tensor record: a small fixed binary layout, no
//! pickle, nothing executable. All integers little-endian.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `SSTENSOR` |
//! | 8 | 4 | version, u32 = 1 |
//! | 12 | 4 | dtype, i32 c10::ScalarType code |
//! | 16 | 4 | ndim, u32 <= 64 |
//! | 20 | 4 | hash length, u32, 1..=128 |
//! | 24 | 8 | storage offset, i64, in elements |
//! | 32 | 8·ndim | shape, i64 each |
//! | … | 8·ndim | stride, i64 each, in elements |
//! | … | hash length | storage hash, lowercase hex ASCII |
//! | end − 8 | 8 | XXH3-64 (seed 0) of every byte before it |

use super::bounds::{required_bytes, MAX_NDIM};
use super::dtype::Dtype;
use super::meta::TensorMeta;
use crate::error::{Error, ErrorKind, Result};
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: &[u8; 8] = b"SSTENSOR";
pub const VERSION: u32 = 1;
const HEADER: usize = 32;
const MAX_HASH_LEN: usize = 128;
/// No valid record is longer; readers refuse bigger files unread.
pub const MAX_RECORD_LEN: usize = HEADER + 16 * MAX_NDIM + MAX_HASH_LEN + 8;

/// The record for `meta` (which the caller has validated).
pub fn encode(meta: &TensorMeta) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + 16 * meta.shape.len() + meta.storage_hash.len() + 8);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&meta.dtype.code().to_le_bytes());
    out.extend_from_slice(&(meta.shape.len() as u32).to_le_bytes());
    out.extend_from_slice(&(meta.storage_hash.len() as u32).to_le_bytes());
    out.extend_from_slice(&meta.offset.to_le_bytes());
    for v in meta.shape.iter().chain(&meta.stride) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(meta.storage_hash.as_bytes());
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Parses and checks a record: length, magic, checksum, version, dtype,
/// dimensions, hash text, and the view's own arithmetic (no negative or
/// overflowing extent). Every failure is an error naming what was wrong.
pub fn decode(bytes: &[u8]) -> Result<TensorMeta> {
    let corrupt = |why: String| Error::new(ErrorKind::Corrupt, format!("tensor record: {why}"));
    if bytes.len() > MAX_RECORD_LEN {
        return Err(corrupt(format!("{} bytes, more than the largest valid record ({MAX_RECORD_LEN})", bytes.len())));
    }
    if bytes.len() < HEADER + 8 {
        return Err(corrupt(format!("truncated: {} bytes, shorter than the {}-byte minimum", bytes.len(), HEADER + 8)));
    }
    if &bytes[..8] != MAGIC {
        return Err(corrupt("does not start with the SSTENSOR magic".into()));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if xxh3_64(body) != u64::from_le_bytes(sum.try_into().unwrap()) {
        return Err(corrupt("checksum does not match (truncated or altered)".into()));
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let i64_at = |at: usize| i64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let version = u32_at(8);
    if version != VERSION {
        return Err(Error::new(ErrorKind::Unsupported, format!("tensor record version {version}; this library reads version {VERSION}")));
    }
    let dtype = Dtype::from_code(u32_at(12) as i32).map_err(|e| e.context("tensor record"))?;
    let ndim = u32_at(16) as usize;
    if ndim > MAX_NDIM {
        return Err(corrupt(format!("{ndim} dimensions, more than {MAX_NDIM}")));
    }
    let hash_len = u32_at(20) as usize;
    if hash_len == 0 || hash_len > MAX_HASH_LEN {
        return Err(corrupt(format!("storage hash length {hash_len} not in 1..={MAX_HASH_LEN}")));
    }
    let want = HEADER + 16 * ndim + hash_len + 8;
    if bytes.len() != want {
        return Err(corrupt(format!("{} bytes but its fields say {want}", bytes.len())));
    }
    let offset = i64_at(24);
    let shape: Vec<i64> = (0..ndim).map(|i| i64_at(HEADER + 8 * i)).collect();
    let stride: Vec<i64> = (0..ndim).map(|i| i64_at(HEADER + 8 * (ndim + i))).collect();
    let hash = &bytes[HEADER + 16 * ndim..HEADER + 16 * ndim + hash_len];
    if !hash.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)) {
        return Err(corrupt("storage hash is not lowercase hex".into()));
    }
    let meta = TensorMeta { dtype, storage_hash: String::from_utf8(hash.to_vec()).unwrap(), offset, shape, stride };
    required_bytes(&meta, ErrorKind::Corrupt)?;
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> TensorMeta {
        TensorMeta { dtype: Dtype::BFloat16, storage_hash: "0123abcd".repeat(4), offset: 7, shape: vec![2, 3, 4], stride: vec![12, 1, 3] }
    }

    #[test]
    fn round_trip_and_layout() {
        let m = sample();
        let r = encode(&m);
        assert_eq!(r.len(), 32 + 48 + 32 + 8);
        assert_eq!(&r[..8], b"SSTENSOR");
        assert_eq!(r[12], 15);
        assert_eq!(decode(&r).unwrap(), m);
    }

    /// Re-seals a record after an edit, so the checks past the checksum run.
    fn reseal(mut r: Vec<u8>) -> Vec<u8> {
        let n = r.len() - 8;
        let sum = xxh3_64(&r[..n]);
        r[n..].copy_from_slice(&sum.to_le_bytes());
        r
    }

    #[test]
    fn every_bad_field_is_named() {
        let good = encode(&sample());
        let mut cases: Vec<(Vec<u8>, &str, ErrorKind)> = vec![
            (good[..good.len() - 1].to_vec(), "checksum", ErrorKind::Corrupt),
            (good[..20].to_vec(), "truncated", ErrorKind::Corrupt),
            (vec![0; MAX_RECORD_LEN + 1], "more than the largest", ErrorKind::Corrupt),
        ];
        let mut magic = good.clone();
        magic[0] = b'X';
        cases.push((magic, "magic", ErrorKind::Corrupt));
        let mut flipped = good.clone();
        flipped[40] ^= 1;
        cases.push((flipped, "checksum", ErrorKind::Corrupt));
        let edit = |at: usize, v: &[u8]| {
            let mut r = good.clone();
            r[at..at + v.len()].copy_from_slice(v);
            reseal(r)
        };
        cases.push((edit(8, &2u32.to_le_bytes()), "version 2", ErrorKind::Unsupported));
        cases.push((edit(12, &12i32.to_le_bytes()), "dtype code 12", ErrorKind::InvalidArgument));
        cases.push((edit(16, &65u32.to_le_bytes()), "more than 64", ErrorKind::Corrupt));
        cases.push((edit(16, &2u32.to_le_bytes()), "fields say", ErrorKind::Corrupt));
        cases.push((edit(20, &0u32.to_le_bytes()), "hash length 0", ErrorKind::Corrupt));
        cases.push((edit(24, &(-1i64).to_le_bytes()), "negative storage offset", ErrorKind::Corrupt));
        cases.push((edit(32, &(-3i64).to_le_bytes()), "negative size", ErrorKind::Corrupt));
        cases.push((edit(80, b"G"), "not lowercase hex", ErrorKind::Corrupt));
        for (bytes, why, kind) in cases {
            let e = decode(&bytes).unwrap_err();
            assert_eq!(e.kind(), kind, "{why}: {}", e.message());
            assert!(e.message().contains(why), "{why}: {}", e.message());
        }
    }

    fn any_meta() -> impl Strategy<Value = TensorMeta> {
        let dtypes = prop::sample::select(vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 23, 24, 27, 28, 29]);
        (dtypes, 0..1i64 << 40, prop::collection::vec((0..1i64 << 20, 0..1i64 << 20), 0..=8), "[0-9a-f]{1,128}").prop_map(
            |(code, offset, dims, hash)| TensorMeta {
                dtype: Dtype::from_code(code).unwrap(),
                storage_hash: hash,
                offset,
                shape: dims.iter().map(|d| d.0).collect(),
                stride: dims.iter().map(|d| d.1).collect(),
            },
        )
    }

    proptest! {
        #[test]
        fn valid_records_round_trip(m in any_meta()) {
            prop_assert_eq!(decode(&encode(&m)).unwrap(), m);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..1400)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn arbitrary_resealed_bodies_never_panic(m in any_meta(), at in 8usize..1200, v in any::<u8>()) {
            // Past the checksum, every field check has to hold on its own.
            let mut r = encode(&m);
            let at = at % (r.len() - 8);
            r[at] = v;
            let _ = decode(&reseal(r));
        }

        #[test]
        fn any_change_or_cut_is_refused(m in any_meta(), at in 0usize..1200, flip in 1u8..=255, cut in 1usize..50) {
            let r = encode(&m);
            let mut changed = r.clone();
            let at = at % r.len();
            changed[at] ^= flip;
            prop_assert!(decode(&changed).is_err());
            let keep = r.len().saturating_sub(cut);
            prop_assert!(decode(&r[..keep]).is_err());
        }
    }
}
