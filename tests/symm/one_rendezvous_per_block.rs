//! Two threads rendezvous one block in two groups: the second waits for the
//! first (a block runs one rendezvous at a time), but no longer than its own
//! timeout (found in review: it waited without one).

use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::{self, group, DeviceType};
use storage_sharing::ErrorKind;

#[test]
fn a_second_rendezvous_of_a_busy_block_honours_its_timeout() {
    let dir = std::env::temp_dir().join(format!("ss-symm-same-block-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store: StoreRef = Arc::new(FileStore::open(dir.join("store")).unwrap());
    group::set_group_info("pair", 0, 2, store.clone()).unwrap(); // rank 1 never comes
    group::set_group_info("solo", 0, 1, store).unwrap();
    let p = symm::alloc(DeviceType::Cpu, 0, 4096, None).unwrap();
    let pv = p as usize;
    let first = std::thread::spawn(move || symm::rendezvous(pv as *mut u8, Some("pair"), Some(Duration::from_secs(3))));
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let e = symm::rendezvous(p, Some("solo"), Some(Duration::from_millis(200))).unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("solo"), "{e}");
    assert!(took < Duration::from_millis(2000), "waited {took:?} for a 200 ms timeout");
    assert_eq!(first.join().unwrap().unwrap_err().kind(), ErrorKind::Timeout);
    // Once the first is over, the block rendezvous in the other group.
    let h = symm::rendezvous(p, Some("solo"), Some(Duration::from_secs(5))).unwrap();
    assert_eq!(h.world_size(), 1);
    symm::free(p).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
