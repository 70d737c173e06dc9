//! Coverage-guided: any bytes as the content store's native tensor record.
//! Also with the checksum recomputed, so the field checks behind it run.
//! What decodes re-encodes to exactly the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::content_store::record;

fn check(bytes: &[u8]) {
    if let Ok(m) = record::decode(bytes) {
        assert_eq!(record::encode(&m), bytes);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 8 {
        let mut sealed = data.to_vec();
        let n = sealed.len() - 8;
        let sum = xxhash_rust::xxh3::xxh3_64(&sealed[..n]);
        sealed[n..].copy_from_slice(&sum.to_le_bytes());
        check(&sealed);
    }
});
