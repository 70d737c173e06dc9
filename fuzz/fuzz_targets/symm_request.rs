//! Coverage-guided: the symmetric-memory rendezvous request. What parses
//! re-encodes to the input with its padding zeroed (padding is ignored:
//! PyTorch leaves it unspecified) and parses again to the same value;
//! everything else is a `Protocol` error naming the rank.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::symm::request::RendezvousRequest;
use storage_sharing::ErrorKind;

fuzz_target!(|data: &[u8]| {
    match RendezvousRequest::from_bytes(data, 2) {
        Ok(r) => {
            let mut canonical = data.to_vec();
            for p in RendezvousRequest::PADDING {
                canonical[p].fill(0);
            }
            assert_eq!(r.to_bytes(), canonical);
            assert_eq!(RendezvousRequest::from_bytes(&r.to_bytes(), 2).unwrap(), r);
            assert!(r.pid > 0 && r.device_idx >= 0 && r.buffer_offset + r.buffer_size <= r.block_size);
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
            assert!(e.message().contains("rendezvous request of rank 2"), "{e}");
        }
    }
});
