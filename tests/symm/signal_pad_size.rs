//! `set_signal_pad_size` / `get_signal_pad_size` (PyTorch's newest): the
//! pad of the blocks to come, settable before the process's first
//! allocation. Its own test binary: nothing may allocate before it.

use std::sync::Arc;
use std::time::Duration;
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::{self, group, registry, DeviceType};
use storage_sharing::ErrorKind;

#[test]
fn pad_size_is_settable_before_the_first_allocation_only() {
    assert_eq!(registry::signal_pad_size(), 9216);
    for bad in [0, 3, 6, (1 << 30) + 4, usize::MAX - 3] {
        let e = registry::set_signal_pad_size(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}: {e}");
        assert!(e.message().contains(&format!("(got {bad})")), "{e}");
    }
    assert_eq!(registry::signal_pad_size(), 9216);
    registry::set_signal_pad_size(20000).unwrap();
    registry::set_signal_pad_size(64).unwrap(); // the last one before use wins
    assert_eq!(registry::signal_pad_size(), 64);

    let dir = std::env::temp_dir().join(format!("ss-symm-pad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store: StoreRef = Arc::new(FileStore::open(dir.join("store")).unwrap());
    group::set_group_info("pad", 0, 1, store).unwrap();
    let p = symm::alloc(DeviceType::Cpu, 0, 100, Some("pad")).unwrap();
    let e = registry::set_signal_pad_size(128).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(e.message().contains("after the first allocation"), "{e}");
    assert_eq!(registry::signal_pad_size(), 64);

    let h = symm::rendezvous(p, None, Some(Duration::from_secs(5))).unwrap();
    assert_eq!(h.signal_pad_size(), 64);
    assert_eq!(h.max_channel(), 15); // 64 / 4 slots for one rank
    let t = Some(Duration::from_millis(50));
    h.barrier(15, t, 0).unwrap();
    let e = h.barrier(16, t, 0).unwrap_err();
    assert!(e.message().contains("is 15 (got 16)"), "{e}");
    // The buffer follows the small pad and works as before.
    let buf = h.get_buffer(0, 100, 0).unwrap();
    // SAFETY: 100 bytes of our own mapped buffer.
    unsafe { std::ptr::write_bytes(buf, 7, 100) };
    assert_eq!(h.buffer_ptr(0).unwrap(), p);
    symm::free(p).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
