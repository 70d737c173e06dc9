//! The shareable CPU arena across processes: blocks sent both ways by fd
//! and by name, a held block not reused until released, a consumer killed
//! with -9 (its holds reclaimed on the next collection), a producer killed
//! (the consumer keeps reading; nothing left in /dev/shm), a full /dev/shm,
//! bad handles, double free and foreign pointers through the C API.

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, my_role, run_ok, use_built_manager, wait_until, Parent, Peer, ROLE_VAR};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;
use storage_sharing::arena::transport::{recv_block, send_block};
use storage_sharing::arena::{Arena, ArenaOptions, RemoteView, Strategy};
use storage_sharing::storage::{recv_fds, send_fds, Storage};
use storage_sharing::ErrorKind;

const ENTRY: &str = "child_entry";

#[test]
fn child_entry() {
    child_main(|role, mut parent| {
        let data = child_data_channel(&parent);
        match role {
            "consumer_then_producer" => consumer_then_producer(&mut parent, &data),
            "holder" => holder(&mut parent, &data),
            "producer" => producer(&mut parent, &data),
            "unshared_producer" => unshared_producer(&mut parent),
            other => panic!("unknown role {other}"),
        }
    });
}

fn strategy_of(arg: &str) -> Strategy {
    if arg == "name" {
        Strategy::Name
    } else {
        Strategy::Fd
    }
}

fn opts(strategy: Strategy) -> ArenaOptions {
    ArenaOptions { segment_size: 4 << 20, strategy, max_holds: 256, large_threshold: 1 << 20 }
}

/// The blocks go over their own socket pair, whose child end travels over
/// the line-based control connection before anything else.
fn parent_data_channel(peer: &Peer) -> UnixStream {
    let (mine, theirs) = UnixStream::pair().unwrap();
    send_fds(peer.stream.as_raw_fd(), b"d", &[theirs.as_raw_fd()]).unwrap();
    mine
}

fn child_data_channel(parent: &Parent) -> UnixStream {
    let mut b = [0u8; 1];
    let (_, mut fds) = recv_fds(parent.stream.as_raw_fd(), &mut b, 1).unwrap();
    UnixStream::from(fds.pop().expect("data channel fd"))
}

/// A block of `len` bytes: its length, then a pattern from `seed`.
fn fill(p: *mut u8, len: usize, seed: u8) {
    // SAFETY: the caller's block holds len >= 8 bytes.
    let b = unsafe { std::slice::from_raw_parts_mut(p, len) };
    b[..8].copy_from_slice(&(len as u64).to_le_bytes());
    for (i, x) in b[8..].iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// Checks a received block against [`fill`]; returns its seed.
fn check(v: &RemoteView) -> u8 {
    // SAFETY: the view's bytes.
    let b = unsafe { std::slice::from_raw_parts(v.data(), v.size()) };
    let len = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    assert!(len <= v.size(), "length {len} in a {}-byte view", v.size());
    let seed = b[8];
    for (i, x) in b[8..len].iter().enumerate() {
        assert_eq!(*x, (i as u8).wrapping_mul(31).wrapping_add(seed), "byte {i} of a {len}-byte block");
    }
    seed
}

fn sizes() -> Vec<usize> {
    vec![4096, 5000, 64 << 10, 100, 33_333, 2 << 20, 4096, 12_345]
}

fn consumer_then_producer(parent: &mut Parent, data: &UnixStream) {
    let views: Vec<RemoteView> = (0..sizes().len()).map(|_| recv_block(data.as_raw_fd()).unwrap()).collect();
    let seeds: Vec<String> = views.iter().map(|v| check(v).to_string()).collect();
    parent.send(&format!("got {}", seeds.join(",")));
    assert_eq!(parent.recv(), "release");
    drop(views);
    parent.send("released");
    // Now the other way round.
    let arena = Arena::new(opts(strategy_of(&parent.arg))).unwrap();
    for (i, len) in [7000usize, 3 << 20, 64].into_iter().enumerate() {
        let p = arena.alloc(len, 64).unwrap();
        fill(p, len, 100 + i as u8);
        send_block(&arena, data.as_raw_fd(), p).unwrap();
        arena.free(p).unwrap();
    }
    parent.send("sent");
    parent.wait_for_close();
}

#[test]
fn blocks_travel_both_ways_and_held_blocks_are_not_reused() {
    for strategy in ["fd", "name"] {
        let mut peer = Peer::spawn(ENTRY, "consumer_then_producer", strategy);
        let data = parent_data_channel(&peer);
        let arena = Arena::new(opts(strategy_of(strategy))).unwrap();
        let mut sent = Vec::new();
        for (i, len) in sizes().into_iter().enumerate() {
            let p = arena.alloc(len, 64).unwrap();
            fill(p, len, i as u8 * 3);
            send_block(&arena, data.as_raw_fd(), p).unwrap();
            sent.push(p as usize);
        }
        let want: Vec<String> = (0..sizes().len()).map(|i| (i as u8 * 3).to_string()).collect();
        assert_eq!(peer.recv(), format!("got {}", want.join(",")), "{strategy}");
        // The consumer holds every block: freed here, none is reused.
        for p in &sent {
            arena.free(*p as *mut u8).unwrap();
        }
        assert_eq!(arena.stats().unwrap().deferred_blocks, sent.len());
        let again: Vec<usize> = sizes().into_iter().map(|len| arena.alloc(len, 64).unwrap() as usize).collect();
        assert!(again.iter().all(|p| !sent.contains(p)), "{strategy}: a held block was reused");
        peer.send("release");
        assert_eq!(peer.recv(), "released");
        assert_eq!(arena.collect().unwrap().recycled_blocks, sent.len(), "{strategy}");
        assert_eq!(arena.stats().unwrap().deferred_blocks, 0);
        // Released blocks come back.
        let small = sizes().into_iter().filter(|l| *l <= 1 << 20).count();
        let reused = (0..small).map(|_| arena.alloc(4096, 64).unwrap() as usize).filter(|p| sent.contains(p)).count();
        assert!(reused > 0, "{strategy}: no released block was reused");
        // Blocks from the child.
        let back: Vec<RemoteView> = (0..3).map(|_| recv_block(data.as_raw_fd()).unwrap()).collect();
        assert_eq!(back.iter().map(check).collect::<Vec<_>>(), [100, 101, 102]);
        assert_eq!(peer.recv(), "sent");
        // Segments: a few, not one per block (the 2 and 3 MiB ones have their own).
        assert!(arena.stats().unwrap().segments <= 3, "{:?}", arena.stats().unwrap());
        peer.stream.shutdown(std::net::Shutdown::Both).unwrap();
        peer.finish();
        // The child is gone; its blocks still read.
        assert_eq!(back.iter().map(check).collect::<Vec<_>>(), [100, 101, 102]);
    }
}

fn holder(parent: &mut Parent, data: &UnixStream) {
    let views: Vec<RemoteView> = (0..10).map(|_| recv_block(data.as_raw_fd()).unwrap()).collect();
    views.iter().for_each(|v| {
        check(v);
    });
    parent.send("held");
    parent.wait_for_close();
    drop(views);
}

#[test]
fn consumer_killed_with_9_holds_are_reclaimed_on_collection() {
    let mut peer = Peer::spawn(ENTRY, "holder", "fd");
    let data = parent_data_channel(&peer);
    let arena = Arena::new(opts(Strategy::Fd)).unwrap();
    let blocks: Vec<*mut u8> = (0..10)
        .map(|i| {
            let p = arena.alloc(10_000, 64).unwrap();
            fill(p, 10_000, i);
            send_block(&arena, data.as_raw_fd(), p).unwrap();
            p
        })
        .collect();
    assert_eq!(peer.recv(), "held");
    for p in &blocks {
        arena.free(*p).unwrap();
    }
    assert_eq!(arena.collect().unwrap(), Default::default(), "a live consumer's holds stay");
    assert_eq!(arena.stats().unwrap().deferred_blocks, 10);
    peer.kill9();
    let r = arena.collect().unwrap();
    assert_eq!((r.reclaimed_holds, r.recycled_blocks), (10, 10));
    assert_eq!(arena.stats().unwrap().deferred_blocks, 0);
    let p = arena.alloc(10_000, 64).unwrap();
    assert!(blocks.contains(&p), "a reclaimed block is reused");
}

fn producer(parent: &mut Parent, data: &UnixStream) {
    let arena = Arena::new(opts(strategy_of(&parent.arg))).unwrap();
    for (i, len) in [5000usize, 2 << 20, 300].into_iter().enumerate() {
        let p = arena.alloc(len, 64).unwrap();
        fill(p, len, 50 + i as u8);
        send_block(&arena, data.as_raw_fd(), p).unwrap();
    }
    parent.send("sent");
    parent.wait_for_close();
}

fn arena_names_of(pid: i32) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("ss_arena_{pid}_")))
        .collect()
}

#[test]
fn producer_killed_consumer_keeps_reading_and_nothing_is_left() {
    for strategy in ["fd", "name"] {
        let mut peer = Peer::spawn(ENTRY, "producer", strategy);
        let pid = peer.pid();
        let data = parent_data_channel(&peer);
        let views: Vec<RemoteView> = (0..3).map(|_| recv_block(data.as_raw_fd()).unwrap()).collect();
        assert_eq!(peer.recv(), "sent");
        if strategy == "name" {
            assert_eq!(arena_names_of(pid).len(), 2, "one small-block segment, one large");
        }
        peer.kill9();
        assert_eq!(views.iter().map(check).collect::<Vec<_>>(), [50, 51, 52], "{strategy}");
        drop(views);
        assert_eq!(arena_names_of(pid), Vec::<String>::new(), "{strategy}: names of the dead producer left");
    }
}

/// Makes by-name segments (one of small blocks, one large block) and
/// shares nothing: no consumer will ever open, or unlink, its names.
fn unshared_producer(parent: &mut Parent) {
    let arena = Arena::new(opts(Strategy::Name)).unwrap();
    let small = arena.alloc(5000, 64).unwrap();
    let large = arena.alloc(2 << 20, 64).unwrap();
    fill(small, 5000, 1);
    fill(large, 2 << 20, 2);
    parent.send("made");
    parent.wait_for_close();
}

#[test]
fn producer_killed_before_any_consumer_leaves_no_name() {
    use_built_manager();
    let mut peer = Peer::spawn(ENTRY, "unshared_producer", "name");
    let pid = peer.pid();
    let _data = parent_data_channel(&peer);
    assert_eq!(peer.recv(), "made");
    assert_eq!(arena_names_of(pid).len(), 2, "one small-block segment, one large");
    peer.kill9();
    // The manager removes them when the producer's connection drops.
    let gone = wait_until(Duration::from_secs(10), || arena_names_of(pid).is_empty());
    assert!(gone, "names of the killed producer left in /dev/shm: {:?}", arena_names_of(pid));
}

#[test]
#[ignore = "entry point of the child process, run inside a private mount namespace"]
fn child_role() {
    let Some((role, _)) = my_role() else { return };
    assert_eq!(role, "small-tmpfs");
    let arena = Arena::new(ArenaOptions { segment_size: 4 << 20, strategy: Strategy::Name, ..opts(Strategy::Name) }).unwrap();
    let e = arena.alloc(4096, 64).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    println!("small: {e}");
    let e = arena.alloc(3 << 20, 64).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let left: Vec<_> = std::fs::read_dir("/dev/shm").unwrap().collect();
    assert!(left.is_empty(), "segments left after failed creates: {left:?}");
    // A segment that fits works, and its pages are there.
    let fits = Arena::new(ArenaOptions { segment_size: 256 << 10, large_threshold: 64 << 10, ..opts(Strategy::Name) }).unwrap();
    let p = fits.alloc(100_000, 64).unwrap();
    fill(p, 100_000, 1);
}

/// A consumer alone in its process (its remote cache is its own): a
/// by-name producer killed but not reaped (a zombie: `kill(pid, 0)` still
/// finds it, as it finds a process that reused the pid) keeps its idle
/// small-block segment cached after the views go (a large block's segment
/// goes with its view); `ss_arena_remote_cache_trim`
/// unmaps them and removes the names.
#[test]
#[ignore = "entry point of a consumer process, run by trim_remote_cache_drops_a_dead_producers_segments"]
fn trim_consumer_role() {
    use storage_sharing::ffi::arena::{ss_arena_remote_cache_size, ss_arena_remote_cache_trim};
    let Some((role, _)) = my_role() else { return };
    assert_eq!(role, "trim-consumer");
    let mut peer = Peer::spawn(ENTRY, "producer", "name");
    let pid = peer.pid();
    let data = parent_data_channel(&peer);
    let views: Vec<RemoteView> = (0..3).map(|_| recv_block(data.as_raw_fd()).unwrap()).collect();
    assert_eq!(peer.recv(), "sent");
    // SAFETY: a signal to our own child, reaped below.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let zombie = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
    };
    assert!(wait_until(Duration::from_secs(10), zombie), "producer {pid} did not become a zombie");
    assert_eq!(views.iter().map(check).collect::<Vec<_>>(), [50, 51, 52]);
    drop(views);
    let (mut cached, mut released) = (0usize, 0usize);
    // SAFETY: writable out-parameters.
    unsafe {
        assert_eq!(ss_arena_remote_cache_size(&mut cached), storage_sharing::ffi::ss_status::SS_OK);
        // The large block's segment went with its view; the small blocks'
        // one stays until trimmed.
        assert_eq!(cached, 1, "the zombie producer's small-block segment stays cached after the views");
        assert_eq!(ss_arena_remote_cache_trim(&mut released), storage_sharing::ffi::ss_status::SS_OK);
        assert_eq!(released, 1);
        assert_eq!(ss_arena_remote_cache_size(&mut cached), storage_sharing::ffi::ss_status::SS_OK);
        assert_eq!(cached, 0);
        assert_eq!(ss_arena_remote_cache_trim(std::ptr::null_mut()), storage_sharing::ffi::ss_status::SS_OK);
    }
    assert_eq!(arena_names_of(pid), Vec::<String>::new(), "names of the dead producer left");
    peer.kill9();
    println!("trimmed {released} segments");
}

#[test]
fn trim_remote_cache_drops_a_dead_producers_segments() {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "trim_consumer_role", "--nocapture"]).env(ROLE_VAR, "trim-consumer");
    let out = run_ok(cmd);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("trimmed 1 segments"), "{text}");
}

#[test]
fn full_dev_shm_is_no_space_not_sigbus() {
    let probe = Command::new("unshare").args(["-m", "--propagation", "private", "true"]).output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        println!("full_dev_shm_is_no_space_not_sigbus: skipped: mount namespaces are not allowed here (unshare -m failed)");
        return;
    }
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$0\" --ignored --exact child_role --nocapture")
        .arg(std::env::current_exe().unwrap())
        .env(ROLE_VAR, "small-tmpfs");
    let out = run_ok(cmd);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("no space"), "{text}");
}

#[test]
fn storage_in_arena_shares_its_own_segment_by_fd_without_a_copy() {
    let arena = Arena::new(opts(Strategy::Fd)).unwrap();
    let n = 3 << 20;
    let s = Storage::new_in_arena(&arena, n).unwrap();
    assert!(s.is_shared());
    let bytes = common::pattern(n, 9);
    s.write_at(0, &bytes).unwrap();
    let before = s.data();
    let (fd, len) = s.share_fd().unwrap();
    assert_eq!((s.data(), len), (before, n), "no copy, same size");
    // What PyTorch does with (fd, size): map [0, size) of the fd.
    let other = Storage::new_shared_fd(fd, n).unwrap();
    assert!(other.to_vec() == bytes);
    assert_eq!(s.get_shared_fd().unwrap(), fd);
    // A small block shares a segment with others: shared by a copy.
    let small = Storage::new_in_arena(&arena, 1000).unwrap();
    small.write_at(0, &bytes[..1000]).unwrap();
    let (fd2, _) = small.share_fd().unwrap();
    assert!(Storage::new_shared_fd(fd2, 1000).unwrap().to_vec() == bytes[..1000]);
    assert_eq!(arena.stats().unwrap().live_blocks, 1, "the small block went back when the storage moved");
    drop(s);
    drop(other);
    assert_eq!(arena.stats().unwrap().live_blocks, 0);
}

mod c_api {
    use super::*;
    use std::ffi::c_void;
    use std::ptr::null_mut;
    use storage_sharing::ffi::arena::*;
    use storage_sharing::ffi::ss_status::{self, *};

    fn open(strategy: u32) -> *mut SsArena {
        let mut o = std::mem::MaybeUninit::uninit();
        // SAFETY: out-parameters of the calls under test.
        unsafe {
            assert_eq!(ss_arena_options_default(o.as_mut_ptr()), SS_OK);
            let mut o = o.assume_init();
            o.strategy = strategy;
            o.segment_size = 4 << 20;
            let mut a = null_mut();
            assert_eq!(ss_arena_open(&o, &mut a), SS_OK);
            a
        }
    }

    fn share(a: *mut SsArena, p: *mut c_void) -> ss_arena_handle {
        let mut h = std::mem::MaybeUninit::uninit();
        // SAFETY: a live arena and block.
        unsafe {
            assert_eq!(ss_arena_share(a, p, h.as_mut_ptr()), SS_OK);
            h.assume_init()
        }
    }

    fn open_remote(h: &ss_arena_handle) -> Result<*mut SsArenaView, ss_status> {
        let mut v = null_mut();
        // SAFETY: h is a readable handle.
        match unsafe { ss_arena_view_open(h, &mut v) } {
            SS_OK => Ok(v),
            e => Err(e),
        }
    }

    #[test]
    fn bad_handles_double_free_and_foreign_pointers_are_typed_errors() {
        let a = open(SS_ARENA_BY_NAME);
        let mut p = null_mut();
        // SAFETY: every call below gets valid or deliberately bad arguments
        // that the API must reject without touching memory.
        unsafe {
            assert_eq!(ss_arena_alloc(a, 1000, 64, &mut p), SS_OK);
            assert_eq!(ss_arena_alloc(a, 0, 64, &mut p), SS_ERR_INVALID_ARGUMENT);
            assert_eq!(ss_arena_alloc(a, 10, 48, &mut p), SS_ERR_INVALID_ARGUMENT);
            assert_eq!(ss_arena_alloc(null_mut(), 10, 8, &mut p), SS_ERR_NULL_POINTER);
            assert_eq!(ss_arena_alloc(a, 10, 8, null_mut()), SS_ERR_NULL_POINTER);
            std::ptr::write_bytes(p.cast::<u8>(), 0xAB, 1000);
            let good = share(a, p);
            // Bad handles, each rejected with a status, none opening.
            let mut h = good;
            h.strategy = 7;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT));
            let mut h = good;
            h.offset = h.segment_size;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT));
            let mut h = good;
            h.size = 0;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT));
            let mut h = good;
            h.segment_name = [b'x' as i8; SS_ARENA_NAME_LEN];
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT), "no NUL in the name");
            let mut h = good;
            h.segment_name[SS_ARENA_NAME_LEN - 1] = b'x' as i8;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT), "a byte after the name's NUL");
            let mut h = good;
            h.segment_name[10] = b'/' as i8;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT), "not an arena segment name");
            // A well-formed name that no segment has: the last hex digit of
            // the random part changed (changing pid digits could leave the
            // name as it was when the pid already has those digits).
            let mut h = good;
            let last = h.segment_name.iter().position(|&c| c == 0).unwrap() - 1;
            h.segment_name[last] = if h.segment_name[last] == b'0' as i8 { b'1' } else { b'0' } as i8;
            assert_eq!(open_remote(&h), Err(SS_ERR_NOT_FOUND), "a name no segment has");
            let mut h = good;
            h.segment_id += 1000;
            assert_eq!(open_remote(&h), Err(SS_ERR_CORRUPT), "the named segment is another one");
            let mut h = good;
            h.hold_generation += 1;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT), "stale generation");
            let mut h = good;
            h.hold_slot = 1 << 30;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT));
            let mut h = good;
            h.offset += 64;
            assert_eq!(open_remote(&h), Err(SS_ERR_INVALID_ARGUMENT), "offset of another block");
            assert_eq!(ss_arena_view_open(null_mut(), &mut null_mut()), SS_ERR_NULL_POINTER);
            // The good one opens once.
            let v = open_remote(&good).unwrap();
            assert_eq!(*ss_arena_view_data(v).cast::<u8>(), 0xAB);
            assert!(ss_arena_view_size(v) >= 1000);
            assert_eq!(open_remote(&good), Err(SS_ERR_INVALID_ARGUMENT), "opened twice");
            assert_eq!(ss_arena_unshare(a, &good), SS_ERR_INVALID_ARGUMENT, "opened, cannot be cancelled");
            ss_arena_view_free(v);
            ss_arena_view_free(null_mut());
            // By fd, a segment that was never imported.
            let b = open(SS_ARENA_BY_FD);
            let mut q = null_mut();
            assert_eq!(ss_arena_alloc(b, 64, 8, &mut q), SS_OK);
            let hb = share(b, q);
            assert_eq!(open_remote(&hb), Err(SS_ERR_NOT_FOUND));
            let mut fd = -1;
            assert_eq!(ss_arena_segment_fd(b, hb.segment_id, &mut fd), SS_OK);
            assert_eq!(ss_arena_segment_fd(a, good.segment_id, &mut fd), SS_ERR_UNSUPPORTED, "by name: no fd");
            assert_eq!(ss_arena_segment_fd(b, 123_456, &mut fd), SS_ERR_NOT_FOUND);
            assert_eq!(ss_arena_import_segment_fd(&hb, -1), SS_ERR_INVALID_ARGUMENT);
            // Double free, foreign and interior pointers.
            assert_eq!(ss_arena_dealloc(a, p), SS_OK);
            assert_eq!(ss_arena_dealloc(a, p), SS_ERR_INVALID_ARGUMENT);
            let mut local = 0u64;
            assert_eq!(ss_arena_dealloc(a, (&mut local as *mut u64).cast()), SS_ERR_INVALID_ARGUMENT);
            assert_eq!(ss_arena_dealloc(a, q), SS_ERR_INVALID_ARGUMENT, "another arena's block");
            assert_eq!(ss_arena_dealloc(b, q.cast::<u8>().add(1).cast()), SS_ERR_INVALID_ARGUMENT);
            assert_eq!(ss_arena_share(b, q.cast::<u8>().add(1).cast(), &mut std::mem::zeroed()), SS_ERR_INVALID_ARGUMENT);
            assert_eq!(ss_arena_dealloc(b, null_mut()), SS_ERR_NULL_POINTER);
            let msg = std::ffi::CStr::from_ptr(storage_sharing::ffi::errors::ss_last_error_message()).to_string_lossy().into_owned();
            assert!(msg.contains("NULL"), "{msg}");
            let mut st = std::mem::zeroed();
            assert_eq!(ss_arena_stats_get(b, &mut st), SS_OK);
            assert_eq!((st.segments, st.live_blocks), (1, 1));
            let (mut held, mut recycled) = (9usize, 9usize);
            assert_eq!(ss_arena_collect(a, &mut held, &mut recycled), SS_OK);
            assert_eq!((held, recycled), (0, 0));
            assert_eq!(ss_arena_collect(a, null_mut(), null_mut()), SS_OK);
            let mut s = null_mut();
            assert_eq!(storage_sharing::ffi::arena::ss_storage_new_in_arena(b, 0, &mut s), SS_ERR_INVALID_ARGUMENT);
            ss_arena_close(a);
            ss_arena_close(b);
            ss_arena_close(null_mut());
        }
    }

    fn last_message() -> String {
        // SAFETY: the library's thread-local message, NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(storage_sharing::ffi::errors::ss_last_error_message()) }.to_string_lossy().into_owned()
    }

    /// A handle whose fields differ from what the segment records for the
    /// share (the block's offset and size, the hold's slot and generation,
    /// the segment itself) opens nothing and takes no hold, nor does it
    /// cancel the real share: the real handle opens afterwards.
    #[test]
    fn altered_handles_are_refused_without_taking_the_hold() {
        for strategy in [SS_ARENA_BY_NAME, SS_ARENA_BY_FD] {
            let a = open(strategy);
            let (mut p, mut q) = (null_mut(), null_mut());
            // SAFETY: valid arguments; the blocks are 4096 bytes each.
            unsafe {
                assert_eq!(ss_arena_alloc(a, 4096, 4096, &mut p), SS_OK);
                assert_eq!(ss_arena_alloc(a, 4096, 4096, &mut q), SS_OK);
                assert_eq!(q as usize, p as usize + 4096, "neighbouring blocks");
                std::ptr::write_bytes(p.cast::<u8>(), 1, 4096);
                std::ptr::write_bytes(q.cast::<u8>(), 2, 4096);
            }
            let good = share(a, p);
            let neighbour = share(a, q);
            if strategy == SS_ARENA_BY_FD {
                let mut fd = -1;
                // SAFETY: valid arguments; the dup is taken over.
                unsafe {
                    assert_eq!(ss_arena_segment_fd(a, good.segment_id, &mut fd), SS_OK);
                    assert_eq!(ss_arena_import_segment_fd(&good, libc::dup(fd)), SS_OK);
                }
            }
            type Alter = fn(&mut ss_arena_handle);
            let cases: [(&str, Alter); 14] = [
                ("size 1", |h| h.size = 1),
                ("size 4095", |h| h.size = 4095),
                ("size 4097", |h| h.size = 4097),
                ("size 8192 (reaches the neighbour)", |h| h.size = 8192),
                ("offset of the neighbour", |h| h.offset += 4096),
                ("offset inside the block", |h| h.offset += 64),
                ("offset and size of the neighbour", |h| {
                    h.offset += 4096;
                    h.size = 4096
                }),
                ("next generation", |h| h.hold_generation += 1),
                ("previous generation", |h| h.hold_generation -= 1),
                ("the neighbour's hold slot", |h| h.hold_slot += 1),
                ("segment size", |h| h.segment_size *= 2),
                ("producer start time", |h| h.producer_start += 1),
                ("producer pid", |h| h.producer_pid += 1),
                ("segment id", |h| h.segment_id += 1),
            ];
            for (what, alter) in cases {
                let mut h = good;
                alter(&mut h);
                let got = open_remote(&h);
                assert!(
                    matches!(got, Err(SS_ERR_INVALID_ARGUMENT) | Err(SS_ERR_NOT_FOUND) | Err(SS_ERR_CORRUPT) | Err(SS_ERR_SIZE_MISMATCH)),
                    "{strategy} {what}: {got:?}"
                );
                if what.starts_with("size") {
                    assert_eq!(got, Err(SS_ERR_INVALID_ARGUMENT), "{strategy} {what}");
                    let msg = last_message();
                    assert!(msg.contains("size"), "{strategy} {what}: {msg}");
                }
                // SAFETY: a live arena and a readable handle.
                let cancelled = unsafe { ss_arena_unshare(a, &h) };
                assert_ne!(cancelled, SS_OK, "{strategy} {what}: cancelled the real share");
            }
            // The real handles still hold their blocks and open, each its own.
            let v = open_remote(&good).unwrap();
            let w = open_remote(&neighbour).unwrap();
            // SAFETY: live views.
            unsafe {
                assert_eq!(ss_arena_view_size(v), 4096);
                assert_eq!(ss_arena_view_data(v).cast::<u8>().read(), 1);
                assert_eq!(ss_arena_view_data(w).cast::<u8>().read(), 2);
                ss_arena_view_free(v);
                ss_arena_view_free(w);
                ss_arena_close(a);
            }
        }
    }

    /// Setting only `segment_size` (below 4 MiB) works: `large_threshold`
    /// left at its default follows it; one set by hand is still checked.
    #[test]
    fn a_small_segment_size_alone_is_accepted() {
        let mut o = std::mem::MaybeUninit::uninit();
        // SAFETY: out-parameters of the calls under test.
        unsafe {
            assert_eq!(ss_arena_options_default(o.as_mut_ptr()), SS_OK);
            let mut o = o.assume_init();
            o.segment_size = 1 << 20;
            let mut a = null_mut();
            assert_eq!(ss_arena_open(&o, &mut a), SS_OK, "{}", last_message());
            let (mut small, mut large) = (null_mut(), null_mut());
            assert_eq!(ss_arena_alloc(a, 200 << 10, 64, &mut small), SS_OK);
            assert_eq!(ss_arena_alloc(a, 300 << 10, 64, &mut large), SS_OK);
            let mut st = std::mem::zeroed();
            assert_eq!(ss_arena_stats_get(a, &mut st), SS_OK);
            assert_eq!(st.segments, 2, "a block above a quarter of the segment gets its own");
            ss_arena_close(a);
            o.large_threshold = 0;
            o.segment_size = 64 << 10;
            assert_eq!(ss_arena_open(&o, &mut a), SS_OK, "0 means automatic: {}", last_message());
            ss_arena_close(a);
            o.large_threshold = 512 << 10;
            o.segment_size = 1 << 20;
            assert_eq!(ss_arena_open(&o, &mut a), SS_ERR_INVALID_ARGUMENT);
            assert!(last_message().contains("large_threshold"), "{}", last_message());
        }
        let a = Arena::new(ArenaOptions { segment_size: 1 << 20, ..ArenaOptions::default() }).unwrap();
        assert_eq!(a.options().large_threshold, 256 << 10);
        assert_eq!(Arena::new(ArenaOptions::default()).unwrap().options().large_threshold, 1 << 20);
    }

    #[test]
    fn import_takes_the_fd_over_and_a_second_import_closes_it() {
        let b = open(SS_ARENA_BY_FD);
        let mut q = null_mut();
        // SAFETY: valid arguments.
        unsafe {
            assert_eq!(ss_arena_alloc(b, 64, 8, &mut q), SS_OK);
            *q.cast::<u8>() = 42;
            let h = share(b, q);
            let mut fd = -1;
            assert_eq!(ss_arena_segment_fd(b, h.segment_id, &mut fd), SS_OK);
            // Imported in the producer's own process: it maps it once more.
            let dup = libc::dup(fd);
            assert_eq!(ss_arena_import_segment_fd(&h, dup), SS_OK);
            // Closed, or (a sibling test thread may reuse the number at once)
            // no longer this segment.
            let same_file = |x: i32, y: i32| {
                let (mut sx, mut sy) = (std::mem::zeroed::<libc::stat>(), std::mem::zeroed::<libc::stat>());
                libc::fstat(x, &mut sx) == 0 && libc::fstat(y, &mut sy) == 0 && (sx.st_dev, sx.st_ino) == (sy.st_dev, sy.st_ino)
            };
            assert!(!same_file(dup, fd), "the imported fd was taken over and closed");
            let v = open_remote(&h).unwrap();
            assert_eq!(*ss_arena_view_data(v).cast::<u8>(), 42);
            assert_ne!(ss_arena_view_data(v), q, "a second mapping of the same segment");
            ss_arena_view_free(v);
            drop(OwnedFd::from_raw_fd(libc::dup(fd)));
            ss_arena_close(b);
        }
    }
}

/// PyTorch maps the (fd, size) tuple of an arena storage that owns its
/// segment, sees its bytes and writes back into them.
#[test]
fn torch_opens_the_fd_tuple_of_an_arena_storage() {
    use std::os::unix::process::CommandExt;
    if !common::torch_available("torch_opens_the_fd_tuple_of_an_arena_storage") {
        return;
    }
    let arena = Arena::new(opts(Strategy::Fd)).unwrap();
    let n = 2 << 20;
    let s = Storage::new_in_arena(&arena, n).unwrap();
    let bytes = common::pattern(n, 3);
    s.write_at(0, &bytes).unwrap();
    let (fd, len) = s.share_fd().unwrap();
    let script = "import sys, torch\n\
n = int(sys.argv[1])\n\
s = torch.UntypedStorage._new_shared_fd_cpu(3, n)\n\
t = torch.empty(0, dtype=torch.uint8).set_(s)\n\
print(int(t.to(torch.int64).sum()))\n\
t[0] = 0xEE\n";
    let mut cmd = Command::new(common::python());
    cmd.args(["-c", script, &len.to_string()]);
    // SAFETY: dup2 and fcntl are async-signal-safe; fd 3 is the segment
    // for the script (dup2 onto itself would keep close-on-exec).
    unsafe {
        cmd.pre_exec(move || {
            let rc = if fd == 3 { libc::fcntl(3, libc::F_SETFD, 0) } else { libc::dup2(fd, 3) };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = run_ok(cmd);
    let sum: u64 = bytes.iter().map(|b| *b as u64).sum();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), sum.to_string());
    assert_eq!(s.to_vec()[0], 0xEE, "PyTorch's write is in our block");
}
