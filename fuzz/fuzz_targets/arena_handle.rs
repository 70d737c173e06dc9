//! Coverage-guided: the shareable arena's handle decoder. What decodes is a
//! valid handle that re-encodes to exactly the input (one spelling per
//! handle); everything else is a typed error naming the handle.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::arena::handle::ArenaHandle;
use storage_sharing::ErrorKind;

fuzz_target!(|data: &[u8]| {
    match ArenaHandle::decode(data) {
        Ok(h) => {
            assert_eq!(&h.encode()[..], data);
            h.validate().unwrap();
        }
        Err(e) => {
            assert!(matches!(e.kind(), ErrorKind::SizeMismatch | ErrorKind::Corrupt | ErrorKind::InvalidArgument), "{e}");
            assert!(e.message().contains("arena handle"), "{e}");
        }
    }
});
