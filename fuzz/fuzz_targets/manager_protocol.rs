//! Coverage-guided: any 68 bytes as a manager protocol record.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::manager::protocol::{AllocInfo, ALLOC_INFO_SIZE, FILENAME_FIELD};

fuzz_target!(|data: &[u8]| {
    let mut rec = [0u8; ALLOC_INFO_SIZE];
    let n = data.len().min(ALLOC_INFO_SIZE);
    rec[..n].copy_from_slice(&data[..n]);
    if let Ok(m) = AllocInfo::decode(&rec) {
        assert!(!m.filename.is_empty() && m.filename.len() < FILENAME_FIELD && !m.filename.contains('\0'));
        assert_eq!(AllocInfo::decode(&m.encode()).unwrap(), m);
    }
});
