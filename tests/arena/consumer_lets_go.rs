//! A consumer lets go of remote segments by itself, and a producer gives
//! large blocks back as soon as both sides are done: a retired or dead
//! producer's idle segment is unmapped when the next segment arrives, a
//! large block's segment goes with its last view (its descriptor and
//! mapping), and a freed large block whose consumer let go is recycled at
//! the next large allocation. Producer and consumer share this process: the
//! remote cache is keyed by producer and segment, as across processes.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use storage_sharing::arena::remote::has_segment;
use storage_sharing::arena::transport::{recv_block, send_block};
use storage_sharing::arena::{import_segment_fd, open_remote, Arena, ArenaHandle, ArenaOptions, RemoteView, Strategy};

fn opts() -> ArenaOptions {
    ArenaOptions { segment_size: 1 << 20, strategy: Strategy::Fd, max_holds: 64, large_threshold: 64 << 10 }
}

/// A duplicate of the producer's descriptor of `h`'s segment, as a
/// consumer receives it.
fn received_fd(a: &Arena, h: &ArenaHandle) -> OwnedFd {
    let fd = a.segment_fd(h.key.segment_id).unwrap();
    // SAFETY: fcntl duplicates a descriptor the arena owns; the copy is ours.
    unsafe { OwnedFd::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)) }
}

fn open_by_fd(a: &Arena, p: *mut u8) -> (ArenaHandle, RemoteView) {
    let h = a.share(p).unwrap();
    import_segment_fd(&h, received_fd(a, &h)).unwrap();
    let v = open_remote(&h).unwrap();
    (h, v)
}

fn mapped_memfds(segment_id: u64) -> usize {
    let label = format!("memfd:ss_arena_{segment_id} ");
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| format!("{l} ").contains(&label)).count()
}

#[test]
fn a_retired_producers_idle_segment_goes_when_the_next_segment_is_imported() {
    let old = Arena::new(opts()).unwrap();
    let p = old.alloc(1000, 64).unwrap();
    let (h, v) = open_by_fd(&old, p);
    drop(v);
    assert!(has_segment(&h), "its producer is alive and may share more of it");
    old.free(p).unwrap();
    drop(old); // retires its segment
    assert!(has_segment(&h), "nothing has told the consumer yet");
    let new = Arena::new(opts()).unwrap();
    let q = new.alloc(1000, 64).unwrap();
    let h2 = new.share(q).unwrap();
    // Before: segments received by fd were mapped without this trim, so a
    // DataLoader kept every dead worker's segment mapped for good.
    import_segment_fd(&h2, received_fd(&new, &h2)).unwrap();
    assert!(!has_segment(&h), "the retired segment was unmapped when another one arrived");
    drop(open_remote(&h2).unwrap());
    new.free(q).unwrap();
}

#[test]
fn a_large_blocks_segment_goes_with_its_last_view_and_comes_back_on_the_next_share() {
    let a = Arena::new(opts()).unwrap();
    let p = a.alloc(200 << 10, 4096).unwrap();
    // SAFETY: 200 KiB of a live block.
    unsafe { std::ptr::write_bytes(p, 9, 200 << 10) };
    let (h, v) = open_by_fd(&a, p);
    let producer_only = {
        let both = mapped_memfds(h.key.segment_id);
        assert!(both >= 2, "the producer's mapping and the consumer's");
        both / 2
    };
    drop(v);
    // Before: the consumer kept the descriptor and the mapping until the
    // producer retired the segment and something trimmed the cache.
    assert!(!has_segment(&h), "unmapped with its last view");
    assert_eq!(mapped_memfds(h.key.segment_id), producer_only, "only the producer's mapping is left");
    let (_, again) = open_by_fd(&a, p);
    // SAFETY: the view's bytes.
    assert!(unsafe { std::slice::from_raw_parts(again.data(), again.size()) }.iter().all(|b| *b == 9));
    drop(again);
    a.free(p).unwrap();
}

#[test]
fn a_freed_large_block_is_recycled_at_the_next_large_alloc_once_its_consumer_let_go() {
    let a = Arena::new(opts()).unwrap();
    let p = a.alloc(100 << 10, 64).unwrap();
    let (h, v) = open_by_fd(&a, p);
    a.free(p).unwrap();
    assert_eq!(a.stats().unwrap().deferred_blocks, 1, "held by the view");
    drop(v);
    let q = a.alloc(100 << 10, 64).unwrap();
    let s = a.stats().unwrap();
    // Before: deferred large blocks waited for an explicit collect, one
    // segment (and descriptor) each meanwhile.
    assert_eq!((s.deferred_blocks, s.segments), (0, 1), "the first block's segment is gone");
    assert_eq!(mapped_memfds(h.key.segment_id), 0);
    a.free(q).unwrap();
    assert_eq!(a.stats().unwrap().segments, 0);
}

#[test]
fn a_large_block_sent_twice_to_one_peer_carries_its_fd_each_time() {
    let a = Arena::new(opts()).unwrap();
    let (tx, rx) = UnixStream::pair().unwrap();
    use std::os::fd::AsRawFd;
    let p = a.alloc(300 << 10, 64).unwrap();
    let small = a.alloc(100, 64).unwrap();
    for _ in 0..3 {
        send_block(&a, tx.as_raw_fd(), p).unwrap();
        send_block(&a, tx.as_raw_fd(), small).unwrap();
        let v = recv_block(rx.as_raw_fd()).unwrap();
        let s = recv_block(rx.as_raw_fd()).unwrap();
        assert_eq!((v.size(), s.size() >= 100), (300 << 10, true));
        drop(v); // unmaps the large block's segment: the next send brings the fd again
    }
    a.free(p).unwrap();
    a.free(small).unwrap();
}
