//! Coverage-guided: segment-name validation against an independent model.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::shm::names::{validate_shm_name, MAX_SHM_NAME_LEN};

fuzz_target!(|data: &[u8]| {
    let Ok(name) = std::str::from_utf8(data) else { return };
    let b = name.as_bytes();
    let model = b.first() == Some(&b'/') && b.len() > 1 && !b[1..].contains(&b'/') && !b.contains(&0) && b.len() - 1 <= MAX_SHM_NAME_LEN;
    assert_eq!(validate_shm_name(name).is_ok(), model, "{name:?}");
});
