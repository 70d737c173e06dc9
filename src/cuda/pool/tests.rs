//! In-process tests of a pool on the host backend: the producer and a
//! consumer in one process (the server answers this process too).

use super::*;
use crate::content_store::dtype::Dtype;
use crate::error::{Error, ErrorKind};
use crate::test_support::soon;
use std::time::Duration;

fn host(kind: PoolKind) -> Pool {
    Pool::new(PoolOptions { device: PoolDevice::Host, kind, segment_size: 64 << 10, max_consumers: 4 }).unwrap()
}

fn spec(ptr: u64, nbytes: usize, sizes: Vec<i64>) -> TensorSpec {
    let mut strides = vec![1i64; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * sizes[i + 1];
    }
    TensorSpec { storage_ptr: ptr, storage_nbytes: nbytes, dtype: Dtype::Float32, sizes, strides, storage_offset: 0 }
}

const T: Option<Duration> = Some(Duration::from_secs(20));

#[test]
fn alloc_places_aligned_blocks_and_grows_by_segments() {
    let pool = host(PoolKind::Vmm);
    let a = pool.alloc(100).unwrap();
    let b = pool.alloc(100).unwrap();
    assert_eq!(a % 512, 0);
    assert_eq!(b, a + 512);
    assert_eq!(pool.segments().len(), 1);
    let big = pool.alloc(200 << 10).unwrap();
    let segs = pool.segments();
    assert_eq!(segs.len(), 2);
    assert_eq!(segs[1], (big, 200 << 10), "a large block gets a segment of its own size");
    pool.free_block(a).unwrap();
    assert_eq!(pool.alloc(512).unwrap(), a, "first fit reuses the freed block");
    let e = pool.free_block(a + 8).unwrap_err();
    assert!(e.message().contains("not the start of a block"), "{e}");
    assert_eq!(pool.free_block(12345).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[test]
fn add_tensor_checks_its_input() {
    let pool = host(PoolKind::Vmm);
    let p = pool.alloc(4096).unwrap();
    pool.add_tensor("w", &spec(p, 4096, vec![32, 32])).unwrap();
    pool.add_tensor("w.view", &TensorSpec { storage_offset: 32, ..spec(p, 4096, vec![31, 32]) }).unwrap();
    let cases = [
        ("w", spec(p, 4096, vec![1]), "already"),
        ("big", spec(p, 4096, vec![33, 32]), "reaches 4224 bytes"),
        ("other", spec(p, 2048, vec![1]), "added before with 4096 bytes"),
        ("outside", spec(p + 512, 1 << 20, vec![1]), "does not lie inside"),
        ("foreign", spec(0x1000, 4, vec![1]), "does not lie inside"),
        ("", spec(p, 4096, vec![1]), "a name must be"),
        ("neg", TensorSpec { strides: vec![-1], ..spec(p, 4096, vec![2]) }, "negative stride"),
    ];
    for (name, s, what) in cases {
        let e = pool.add_tensor(name, &s).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{name}");
        assert!(e.message().contains(what), "{what:?} not in {e}");
    }
    pool.add_tensor("empty", &TensorSpec { storage_ptr: 0, ..spec(0, 0, vec![0]) }).unwrap();
    let h = pool.export().unwrap();
    assert_eq!(pool.export().unwrap(), h, "export is once; later calls return the same handle");
    let e = pool.add_tensor("late", &spec(p, 4096, vec![1])).unwrap_err();
    assert!(e.message().contains("frozen after export"), "{e}");
    let e = pool.alloc(1 << 20).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
}

#[test]
fn export_open_read_and_update_in_one_process() {
    for kind in [PoolKind::Vmm, PoolKind::Legacy] {
        let pool = host(kind);
        let p = pool.alloc(4096).unwrap();
        // SAFETY: 4096 bytes of pool memory, ours.
        let data = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, 1024) };
        data.fill(1.0);
        pool.add_tensor("w", &spec(p, 4096, vec![1024])).unwrap();
        pool.add_tensor("w.T", &TensorSpec { strides: vec![1, 32], ..spec(p, 4096, vec![32, 32]) }).unwrap();
        let h = pool.export().unwrap();
        assert_eq!(pool.version(), 1);
        let h = PoolHandle::from_bytes(&h.to_bytes()).unwrap();
        let w = Weights::open(&h, T).unwrap();
        assert_eq!(w.tensors().len(), 2);
        assert_eq!(w.tensors()[1].storage_index, 0, "views of one storage share it");
        assert_eq!(pool.consumers(), 1);
        let v = w.acquire(0, T).unwrap();
        assert_eq!(v, 1);
        // SAFETY: the consumer's mapping of the same 4096 bytes.
        let seen = unsafe { std::slice::from_raw_parts(w.tensors()[0].storage_ptr as *const f32, 1024) };
        assert!(seen.iter().all(|x| *x == 1.0));
        let e = pool.begin_update(Some(Duration::from_millis(50))).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Timeout, "a held version blocks the update: {e}");
        assert!(e.message().contains(&format!("pid {}", std::process::id())), "{e}");
        w.release(0).unwrap();
        assert_eq!(w.release(0).unwrap_err().kind(), ErrorKind::InvalidArgument, "release without acquire");
        let u = pool.begin_update(T).unwrap();
        data.fill(2.0);
        assert_eq!(u.publish(0).unwrap(), 2);
        assert_eq!(w.acquire(0, T).unwrap(), 2);
        assert!(seen.iter().all(|x| *x == 2.0));
        w.release(0).unwrap();
        // An abandoned update tears the pool until the next publish.
        drop(pool.begin_update(T).unwrap());
        assert_eq!(w.acquire(0, T).unwrap_err().kind(), ErrorKind::Busy);
        pool.begin_update(T).unwrap().publish(0).unwrap();
        assert_eq!(w.acquire(0, T).unwrap(), 3, "an abandoned update bumps no version");
        w.release(0).unwrap();
        // The producer goes: the consumer is told, and its mapping stays.
        // (A Vmm consumer learns it from the hang-up, which a child that
        // another test thread is spawning delays while it holds a copy of
        // the server's end.)
        drop(pool);
        let mut last: Option<Error> = None;
        let told = soon(Duration::from_secs(10), || match w.acquire(0, T) {
            Ok(_) => {
                w.release(0).expect("release");
                false
            }
            Err(e) => last.insert(e).kind() == ErrorKind::PeerGone,
        });
        assert!(told, "{last:?}");
        assert!(seen.iter().all(|x| *x == 2.0));
        let refused = soon(Duration::from_secs(10), || Weights::open(&h, T).err().is_some_and(|e| e.kind() == ErrorKind::PeerGone));
        assert!(refused, "opening a pool whose producer went");
    }
}

#[test]
fn a_consumer_that_goes_frees_its_slot() {
    let pool = host(PoolKind::Vmm);
    let p = pool.alloc(512).unwrap();
    pool.add_tensor("x", &spec(p, 512, vec![128])).unwrap();
    let h = pool.export().unwrap();
    let w = Weights::open(&h, T).unwrap();
    w.acquire(0, T).unwrap();
    drop(w);
    // The hold goes with the handle; the update goes on.
    pool.begin_update(T).unwrap().publish(0).unwrap();
    // The server frees the slot when it sees the hang-up, which a child
    // that another test thread is forking may delay: it holds a copy of
    // the socket until it execs.
    assert!(soon(Duration::from_secs(10), || pool.consumers() == 0), "the slot of the consumer that went");
    let ws: Vec<Weights> = (0..4).map(|_| Weights::open(&h, T).unwrap()).collect();
    let e = Weights::open(&h, T).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(e.message().contains("max_consumers"), "{e}");
    drop(ws);
}

#[test]
fn threads_share_a_hold_and_never_see_a_torn_version() {
    let pool = host(PoolKind::Vmm);
    let p = pool.alloc(1 << 16).unwrap();
    let n = (1 << 16) / 8;
    pool.add_tensor("x", &TensorSpec { dtype: Dtype::UInt64, ..spec(p, 1 << 16, vec![n as i64]) }).unwrap();
    // SAFETY: the block is ours; written only under an open update.
    let fill = |v: u64| unsafe { std::slice::from_raw_parts_mut(p as *mut u64, n) }.fill(v);
    fill(1);
    let h = pool.export().unwrap();
    let w = Weights::open(&h, T).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let ptr = w.tensors()[0].storage_ptr as *const u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let v = w.acquire(0, T).unwrap();
                    // SAFETY: the mapping is n words; held, nobody writes it.
                    let seen = unsafe { std::slice::from_raw_parts(ptr, n) };
                    assert!(seen.iter().all(|x| *x == v), "version {v} torn");
                    w.release(0).unwrap();
                }
            });
        }
        for _ in 0..50 {
            let u = pool.begin_update(T).unwrap();
            fill(pool.version() + 1);
            u.publish(0).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(pool.version(), 51);
}

#[test]
fn the_current_pool_serves_the_pluggable_allocator() {
    let pool = std::sync::Arc::new(host(PoolKind::Vmm));
    set_current(Some(pool.clone()));
    let p = alloc_in_current(1000, 0, 0).unwrap();
    assert!(pool.segments().iter().any(|(a, n)| p >= *a && p < a + *n as u64));
    assert_eq!(alloc_in_current(10, 3, 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
    set_current(None);
    free_anywhere(p).unwrap();
    assert_eq!(free_anywhere(p).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[test]
fn pools_and_weights_may_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Pool>();
    send_sync::<Weights>();
    send_sync::<PoolHandle>();
}

#[test]
fn a_pool_dropped_mid_update_tells_its_consumers_and_keeps_their_mapping() {
    let pool = host(PoolKind::Legacy);
    let p = pool.alloc(512).unwrap();
    pool.add_tensor("x", &spec(p, 512, vec![128])).unwrap();
    let h = pool.export().unwrap();
    let w = Weights::open(&h, T).unwrap();
    pool.start_update(T).unwrap();
    drop(pool);
    // The producer is gone (PeerGone comes first), and the memory stays mapped.
    assert_eq!(w.acquire(0, T).unwrap_err().kind(), ErrorKind::PeerGone);
    // SAFETY: the consumer's mapping of the 512-byte storage.
    assert_eq!(unsafe { (w.tensors()[0].storage_ptr as *const u8).read() }, 0);
}

#[test]
fn an_update_may_publish_a_version_of_the_callers_choosing() {
    let pool = host(PoolKind::Vmm);
    let p = pool.alloc(512).unwrap();
    pool.add_tensor("w", &spec(p, 512, vec![128])).unwrap();
    pool.export().unwrap();
    pool.start_update(T).unwrap();
    pool.abandon_update();
    assert!(pool.torn());
    pool.start_update(T).unwrap();
    for bad in [0, 1 << 62] {
        let e = pool.publish_update_as(0, Some(bad)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains(&bad.to_string()), "{e}");
    }
    assert_eq!(pool.publish_update_as(0, Some(17)).unwrap(), 17, "a refused version leaves the update open");
    assert_eq!(pool.version(), 17);
    assert!(!pool.torn(), "a publish mends a torn pool");
    let e = pool.publish_update_as(0, Some(5)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "no update open: {e}");
    pool.start_update(T).unwrap();
    assert_eq!(pool.publish_update_as(0, None).unwrap(), 18);
}
