//! Symmetric memory on the CPU backend across real processes: each rank is
//! this test binary run again as a child (`child_role`), the ranks meet
//! through a file store in the test's own folder, and that folder is also
//! the children's TMPDIR (where the descriptor sockets live).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/symm_ranks.rs"]
mod symm_ranks;

use common::{child_command, my_role, pattern};
use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::FileStore;
use storage_sharing::symm::{self, group, registry, DeviceType, SymmetricMemory};
use storage_sharing::ErrorKind;
use symm_ranks::{finish, rank_command, sockets_left, Rank};

const MS: u64 = 1;

fn test_dir(tag: &str) -> PathBuf {
    symm_ranks::test_dir("ss-symm", tag)
}

/// Starts `ws` ranks of `role` (or the ranks in `only`), each with
/// arguments [dir, rank, ws, extra...].
fn spawn_ranks(role: &str, dir: &Path, ws: usize, only: &[usize], extra: &[&str]) -> Vec<(usize, Child)> {
    let ranks: Vec<usize> = if only.is_empty() { (0..ws).collect() } else { only.to_vec() };
    ranks.into_iter().map(|r| (r, rank_command(role, dir, r, ws, extra).spawn().expect("spawn rank"))).collect()
}

fn assert_all_ok(outs: &[(usize, Output)]) {
    for (r, o) in outs {
        assert!(
            o.status.success(),
            "rank {r} failed: {}\nstdout:\n{}\nstderr:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

fn run_ranks(role: &str, tag: &str, ws: usize, extra: &[&str]) -> Vec<(usize, Output)> {
    let dir = test_dir(tag);
    let outs = finish(spawn_ranks(role, &dir, ws, &[], extra));
    assert_all_ok(&outs);
    assert_no_sockets_left(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    outs
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// No `symm_mem-<pid>` socket may outlive a rendezvous.
fn assert_no_sockets_left(dir: &Path) {
    let left = sockets_left(dir);
    assert!(left.is_empty(), "sockets left in {}: {left:?}", dir.display());
}

// ---------------------------------------------------------------- children

/// A CPU block of `size` bytes in group `name`, rendezvoused.
fn block(name: &str, size: usize) -> (*mut u8, Arc<SymmetricMemory>) {
    let p = symm::alloc(DeviceType::Cpu, 0, size, Some(name)).unwrap();
    let h = symm::rendezvous(p, None, Some(Duration::from_secs(30))).unwrap();
    (p, h)
}

fn t(ms: u64) -> Option<Duration> {
    Some(Duration::from_millis(ms * MS))
}

fn pad_is_zero(h: &SymmetricMemory, rank: usize) -> bool {
    let p = h.signal_pad_ptr(rank as i64).unwrap();
    // SAFETY: the pad is mapped for signal_pad_size bytes; read as bytes.
    let pad = unsafe { std::slice::from_raw_parts(p, h.signal_pad_size()) };
    pad.iter().all(|&b| b == 0)
}

fn buffer<'a>(h: &SymmetricMemory, rank: usize) -> &'a mut [u8] {
    let p = h.buffer_ptr(rank as i64).unwrap();
    // SAFETY: every rank's buffer is mapped for buffer_size bytes; the
    // roles below only write their own buffer between barriers.
    unsafe { std::slice::from_raw_parts_mut(p, h.buffer_size()) }
}

fn role_exchange(me: Rank) {
    me.join("world");
    let size: usize = me.extra[0].parse().unwrap();
    let (p, h) = block("world", size);
    assert_eq!((h.rank(), h.world_size(), h.buffer_size()), (me.rank, me.ws, size));
    assert_eq!(h.buffer_ptr(me.rank as i64).unwrap(), p, "own buffer is the allocation");
    buffer(&h, me.rank).copy_from_slice(&pattern(size, me.rank as u8));
    h.barrier(0, t(20_000), 0).unwrap();
    for peer in 0..me.ws {
        assert!(buffer(&h, peer) == &pattern(size, peer as u8)[..], "rank {} read a wrong buffer of rank {peer}", me.rank);
    }
    // Write into the next rank's buffer through its peer pointer.
    let next = (me.rank + 1) % me.ws;
    h.barrier(0, t(20_000), 0).unwrap();
    buffer(&h, next)[..8].copy_from_slice(&(1000 + me.rank as u64).to_ne_bytes());
    h.barrier(1, t(20_000), 0).unwrap();
    let prev = (me.rank + me.ws - 1) % me.ws;
    assert_eq!(u64::from_ne_bytes(buffer(&h, me.rank)[..8].try_into().unwrap()), 1000 + prev as u64);
    h.barrier(0, t(20_000), 0).unwrap();
    // Peers may still be consuming our last signals; our own pad is final.
    assert!(pad_is_zero(&h, me.rank), "pad of rank {} not zero after clean syncs", me.rank);
    let again = symm::rendezvous(p, Some("world"), t(1000)).unwrap();
    assert!(Arc::ptr_eq(&again, &h), "second rendezvous must return the same object");
    assert_eq!(symm::get_alloc_size(p).unwrap(), size);
    symm::free(p).unwrap();
    println!("rank {} ok", me.rank);
}

fn role_ordering(me: Rank) {
    me.join("world");
    let (_p, h) = block("world", 64 * me.ws);
    for round in 1..=500u64 {
        buffer(&h, me.rank)[..8].copy_from_slice(&round.to_ne_bytes());
        h.barrier(0, t(20_000), 0).unwrap();
        for peer in 0..me.ws {
            let seen = u64::from_ne_bytes(buffer(&h, peer)[..8].try_into().unwrap());
            assert_eq!(seen, round, "rank {} saw round {seen} of rank {peer} in round {round}", me.rank);
        }
        h.barrier(1, t(20_000), 0).unwrap();
    }
    println!("rank {} ok", me.rank);
}

fn role_signals(me: Rank) {
    me.join("pair");
    let (_p, h) = block("pair", 4096);
    let max = h.max_channel();
    let channels = [0usize, 3, 7, max];
    if me.rank == 0 {
        for (i, &c) in channels.iter().enumerate() {
            buffer(&h, 1)[c * 8 % 4096..][..8].copy_from_slice(&(77 + i as u64).to_ne_bytes());
            h.put_signal(1, c as i64, t(20_000), 0).unwrap();
        }
        h.wait_signal(1, 5, t(20_000), 0).unwrap();
    } else {
        // Waits in the reverse order: each channel is its own slot.
        for (i, &c) in channels.iter().enumerate().rev() {
            h.wait_signal(0, c as i64, t(20_000), 0).unwrap();
            let v = u64::from_ne_bytes(buffer(&h, 1)[c * 8 % 4096..][..8].try_into().unwrap());
            assert_eq!(v, 77 + i as u64, "channel {c}");
        }
        h.put_signal(0, 5, t(20_000), 0).unwrap();
    }
    h.barrier(0, t(20_000), 0).unwrap();
    assert!(pad_is_zero(&h, me.rank));
    println!("rank {} ok max_channel={max}", me.rank);
}

fn role_timeouts(me: Rank) {
    me.join("pair");
    let (_p, h) = block("pair", 64);
    if me.rank == 0 {
        let start = Instant::now();
        let e = h.wait_signal(1, 2, t(200), 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(start.elapsed() >= Duration::from_millis(200));
        assert!(e.message().contains("rank 0 failed to receive signal from rank 1 on channel 2 after 200 ms"), "{}", e.message());
        let e = h.barrier(3, t(150), 0).unwrap_err();
        assert!(e.message().contains("barrier: rank 0 failed to receive signal from rank 1 on channel 3"), "{}", e.message());
        // Our barrier put a signal into rank 1's pad: a full slot makes the
        // next put wait, and time out.
        let e = h.put_signal(1, 3, t(100), 0).unwrap_err();
        assert!(e.message().contains("rank 0 failed to send signal to rank 1 on channel 3 after 100 ms"), "{}", e.message());
        assert!(pad_is_zero(&h, 0), "a timed-out wait leaves no mark");
        me.store.set(b"timeouts/done", b"1").unwrap();
    } else {
        me.store.wait(&[b"timeouts/done".as_slice()], t(30_000)).unwrap();
        // Consume the signal rank 0's failed barrier left, so the pads are
        // clean again, and finish with a good barrier.
        h.wait_signal(0, 3, t(1000), 0).unwrap();
    }
    h.barrier(0, t(20_000), 0).unwrap();
    assert!(pad_is_zero(&h, me.rank));
    println!("rank {} ok", me.rank);
}

fn role_kill9(me: Rank) {
    me.join("trio");
    let (_p, h) = block("trio", 4096);
    h.barrier(0, t(20_000), 0).unwrap();
    if me.rank == 2 {
        println!("rank 2 in barrier");
        // Blocks for good: ranks 0 and 1 enter only after it is killed.
        h.barrier(1, None, 0).unwrap();
        h.barrier(1, None, 0).unwrap();
        unreachable!("rank 2 passed a barrier the others never entered");
    }
    me.store.wait(&[b"kill9/dead".as_slice()], t(30_000)).unwrap();
    let mut outcome = Ok(());
    for _ in 0..2 {
        outcome = h.barrier(1, t(500), 0);
        if outcome.is_err() {
            break;
        }
    }
    let e = outcome.expect_err("a barrier with a dead rank must time out");
    assert_eq!(e.kind(), ErrorKind::Timeout);
    // Rank 2 had put its signals before it died: the first barrier may pass;
    // then either our signal to it stays unconsumed or its signal is missing.
    let m = e.message();
    assert!(m.contains(&format!("rank {} failed to ", me.rank)) && m.contains("rank 2 on channel 1"), "{m}");
    println!("rank {} timed out: {}", me.rank, e.message());
}

fn role_mismatch(me: Rank) {
    me.join("world");
    let size = 4096 * (me.rank + 1);
    let p = symm::alloc(DeviceType::Cpu, 0, size, Some("world")).unwrap();
    let e = symm::rendezvous(p, None, t(20_000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{}", e.message());
    assert!(e.message().contains("rank 1 allocated 8192 bytes") && e.message().contains("rank 0 allocated 4096 bytes"), "{}", e.message());
    println!("rank {} mismatch: {}", me.rank, e.message());
}

fn role_missing(me: Rank) {
    me.join("world");
    let p = symm::alloc(DeviceType::Cpu, 0, 64, Some("world")).unwrap();
    let e = symm::rendezvous(p, None, t(400)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{}", e.message());
    assert!(e.message().contains("rank(s) 2 never arrived"), "{}", e.message());
    println!("rank {} missing: {}", me.rank, e.message());
}

/// Enters a rendezvous whose rank 2 never comes, and is killed there.
fn role_waits_to_be_killed(me: Rank) {
    me.join("world");
    let p = symm::alloc(DeviceType::Cpu, 0, 64, Some("world")).unwrap();
    println!("entering");
    let _ = symm::rendezvous(p, None, t(60_000));
    unreachable!("the rendezvous cannot complete without rank 2");
}

fn role_two_groups(me: Rank) {
    // Group "all" has every rank; group "low" only ranks 0 and 1, which
    // rendezvous in it first, so with one sequence for all groups rank 2's
    // keys in "all" would not match theirs.
    let in_low = me.rank < 2;
    group::set_group_info("all", me.rank as i64, me.ws as i64, me.store.clone()).unwrap();
    if in_low {
        group::set_group_info("low", me.rank as i64, 2, me.store.clone()).unwrap();
    }
    let mut low = None;
    if in_low {
        let (p, h) = block("low", 256);
        buffer(&h, me.rank)[0] = 10 + me.rank as u8;
        h.barrier(0, t(20_000), 0).unwrap();
        assert_eq!(buffer(&h, 1 - me.rank)[0], 11 - me.rank as u8);
        low = Some((p, h));
    }
    let (_pa, all) = block("all", 512);
    buffer(&all, me.rank)[0] = 20 + me.rank as u8;
    all.barrier(0, t(20_000), 0).unwrap();
    for r in 0..me.ws {
        assert_eq!(buffer(&all, r)[0], 20 + r as u8);
    }
    if let Some((_p, h)) = &low {
        // A second block in "low" after "all": the sequences stay apart.
        let (_p2, h2) = block("low", 128);
        h2.barrier(0, t(20_000), 0).unwrap();
        h.barrier(0, t(20_000), 0).unwrap();
    }
    all.barrier(0, t(20_000), 0).unwrap();
    println!("rank {} ok", me.rank);
}

fn role_persistent(me: Rank) {
    me.join("solo");
    let p = symm::alloc_persistent(DeviceType::Cpu, 0, 100, Some("solo"), 7).unwrap();
    let h = symm::rendezvous(p, None, t(10_000)).unwrap();
    let e = symm::alloc_persistent(DeviceType::Cpu, 0, 100, Some("solo"), 7).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert_eq!(
        e.message(),
        "ss_symm_alloc_persistent: can not allocate with alloc_id == 7 because a previous allocation with the same alloc_id is still active."
    );
    symm::free(p).unwrap();
    assert_eq!(symm::get_alloc_size(p).unwrap_err().kind(), ErrorKind::NotFound);
    let e = symm::alloc_persistent(DeviceType::Cpu, 0, 200, Some("solo"), 7).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::SizeMismatch);
    assert_eq!(
        e.message(),
        "ss_symm_alloc_persistent: requested allocation size (200) is different from the size of a previous allocation with the same alloc_id 100"
    );
    let q = symm::alloc_persistent(DeviceType::Cpu, 0, 100, None, 7).unwrap();
    assert_eq!(q, p, "same alloc_id gives the same block");
    let h2 = symm::rendezvous(q, None, t(10_000)).unwrap();
    assert!(Arc::ptr_eq(&h, &h2), "rendezvous is cached per block and group");
    let other = symm::alloc_persistent(DeviceType::Cpu, 0, 100, None, 8).unwrap();
    assert_ne!(other, p);
    symm::free(q).unwrap();
    assert_eq!(symm::free(q).unwrap_err().kind(), ErrorKind::NotFound, "double free");
    println!("ok");
}

/// The descriptor broadcast of the rendezvous socket (used by the CUDA
/// backend's multicast set-up): rank 0 sends a memfd, then nothing.
fn role_broadcast(me: Rank) {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    use storage_sharing::symm::{
        exchange,
        ipc_channel::{IpcChannel, PeerSocket},
    };
    me.join("bcast");
    let info = group::get_group_info("bcast").unwrap();
    let channel = IpcChannel::open().unwrap();
    let mine = format!("{} {} {}", std::process::id(), storage_sharing::proc_identity::me().1, channel.name());
    let peers: Vec<PeerSocket> = exchange::all_gather(&info, "bcast", mine.as_bytes(), t(20_000))
        .unwrap()
        .iter()
        .map(|b| {
            let mut words = std::str::from_utf8(b).unwrap().splitn(3, ' ');
            let mut next = || words.next().unwrap();
            let (pid, start, name) = (next().parse().unwrap(), next().parse().unwrap(), next().to_string());
            PeerSocket { pid, start, name }
        })
        .collect();
    let deadline = Some(Instant::now() + Duration::from_secs(20));
    let mut own = None;
    if me.rank == 0 {
        // SAFETY: memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"bcast".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: the descriptor was just created and is ours alone.
        let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.write_all(b"from rank 0").unwrap();
        own = Some(f);
    }
    let got = channel.broadcast(own.as_ref().map(|f| f.as_raw_fd()), 0, me.rank, &peers, deadline).unwrap();
    if me.rank == 0 {
        assert!(got.is_none(), "the source gets nothing back");
    } else {
        let mut f = std::fs::File::from(got.expect("a descriptor from rank 0"));
        f.rewind().unwrap();
        let mut text = String::new();
        f.read_to_string(&mut text).unwrap();
        assert_eq!(text, "from rank 0");
    }
    // A broadcast of nothing: a message without a descriptor.
    let got = channel.broadcast(None, 0, me.rank, &peers, deadline).unwrap();
    assert!(got.is_none());
    exchange::all_gather(&info, "bcast", &[0], t(20_000)).unwrap();
    drop(channel);
    println!("rank {} ok", me.rank);
}

fn role_registry(me: Rank) {
    let e = registry::set_backend("NVSHMEM").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_eq!(e.message(), "SymmetricMemory does not find allocation backend NVSHMEM");
    registry::set_backend("CPU").unwrap();
    assert_eq!(registry::get_backend().as_deref(), Some("CPU"));
    assert!(registry::has_allocator(DeviceType::Cpu));
    assert!(registry::has_allocator(DeviceType::Cuda), "the CUDA backend is registered");
    let cuda = symm::alloc(DeviceType::Cuda, 0, 64, None);
    if me.extra.first().map(String::as_str) == Some("bad-env") {
        let e = cuda.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(e.message(), "TORCH_SYMMMEM environment variable must be one of 'CUDA', 'NVSHMEM', 'NCCL'.");
    } else {
        match storage_sharing::cuda::check_available() {
            // No driver or device here: the allocation says so, with the reason.
            Err(why) => {
                let e = cuda.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::CudaUnavailable);
                assert_eq!(e.message(), why.message());
                assert!(e.message().starts_with("CUDA is not available: "), "{}", e.message());
            }
            Ok(()) => symm::free(cuda.unwrap()).unwrap(),
        }
    }
    let p = symm::alloc(DeviceType::Cpu, 0, 64, None).unwrap();
    let e = registry::set_backend("CPU").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert_eq!(e.message(), "Backend can not be changed after use.");
    assert!(!registry::is_finalizing());
    symm::free(p).unwrap();
    let _ = me.dir;
    println!("ok");
}

fn role_bad_args(me: Rank) {
    let e = group::get_group_info("nope").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_eq!(e.message(), "get_group_info: no group info associated with the group name nope");
    me.join("solo");
    let dup = group::set_group_info("solo", 0, 1, me.store.clone()).unwrap_err();
    assert_eq!(dup.kind(), ErrorKind::AlreadyExists);
    for (rank, ws) in [(1, 1), (-1, 2), (0, 0)] {
        let e = group::set_group_info("bad", rank, ws, me.store.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "rank {rank} ws {ws}");
    }
    let info = group::get_group_info("solo").unwrap();
    assert_eq!((info.rank, info.world_size), (0, 1));

    assert_eq!(symm::alloc(DeviceType::Cpu, 3, 64, None).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(symm::alloc(DeviceType::Cpu, 0, usize::MAX - 10, None).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let p = symm::alloc(DeviceType::Cpu, 0, 1000, None).unwrap();
    let e = symm::rendezvous(p, None, t(1000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("`group_name` is neither specified during allocation nor passed to rendezvous()"));
    assert_eq!(symm::rendezvous(p, Some("nope"), t(1000)).unwrap_err().kind(), ErrorKind::NotFound);
    // SAFETY: 1 byte past the start of a live 1000-byte buffer.
    let inside = unsafe { p.add(1) };
    assert_eq!(symm::rendezvous(inside, Some("solo"), t(1000)).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(symm::free(inside).unwrap_err().kind(), ErrorKind::NotFound);

    let h = symm::rendezvous(p, Some("solo"), t(10_000)).unwrap();
    for bad in [1i64, -1, 99] {
        let e = h.buffer_ptr(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().starts_with(&format!("Invalid peer rank: {bad}")), "{}", e.message());
        assert!(h.signal_pad_ptr(bad).is_err() && h.put_signal(bad, 0, t(10), 0).is_err() && h.wait_signal(bad, 0, t(10), 0).is_err());
    }
    let e = h.get_buffer(0, 1001, 0).unwrap_err();
    assert_eq!(e.message(), "SymmetricMemory::get_buffer: the requested size (1001 bytes) exceeds the allocated size (1000 bytes)");
    let e = h.get_buffer(0, 10, 995).unwrap_err();
    assert_eq!(e.message(), "SymmetricMemory::get_buffer: the requested size (1005 bytes) exceeds the allocated size (1000 bytes)");
    assert_eq!(h.get_buffer(0, usize::MAX, 2).unwrap_err().kind(), ErrorKind::InvalidArgument);
    // SAFETY: offset 990 of a 1000-byte buffer.
    assert_eq!(h.get_buffer(0, 10, 990).unwrap(), unsafe { p.add(990) });
    assert_eq!(h.get_buffer(0, 0, 1000).unwrap(), unsafe { p.add(1000) });

    let max = h.max_channel();
    assert_eq!(max, h.signal_pad_size() / 4 - 1, "one rank: one slot per channel");
    let e = h.barrier(max as i64 + 1, t(10), 0).unwrap_err();
    assert_eq!(
        e.message(),
        format!("The maximum supported channel for barrier(), put_signal() and wait_signal() is {max} (got {})", max + 1)
    );
    let e = h.put_signal(0, -1, t(10), 0).unwrap_err();
    assert!(e.message().contains("must not be negative (got -1)"), "{}", e.message());
    // One rank: put to itself and wait for itself on the last channel.
    h.put_signal(0, max as i64, t(1000), 0).unwrap();
    h.wait_signal(0, max as i64, t(1000), 0).unwrap();
    h.barrier(0, t(1000), 0).unwrap();
    symm::free(p).unwrap();
    println!("ok");
}

fn role_c_api(me: Rank) {
    use std::ffi::c_void;
    use std::ptr::{null, null_mut};
    use storage_sharing::ffi::ss_status::*;
    use storage_sharing::ffi::symm::*;
    let dir = std::ffi::CString::new(me.dir.join("store").to_str().unwrap()).unwrap();
    let mut store = null_mut();
    // SAFETY (all calls below): valid strings, out-pointers to locals, NULLs
    // where the test checks that NULL is refused.
    unsafe {
        assert_eq!(storage_sharing::ffi::store::ss_store_file_open(dir.as_ptr(), &mut store), SS_OK);
        assert_eq!(ss_symm_set_group_info(c"capi".as_ptr(), 0, 1, null()), SS_ERR_NULL_POINTER);
        assert_eq!(ss_symm_set_group_info(null(), 0, 1, store), SS_ERR_NULL_POINTER);
        assert_eq!(ss_symm_set_group_info(c"capi".as_ptr(), 0, 1, store), SS_OK);
        assert_eq!(ss_symm_set_group_info(c"capi".as_ptr(), 0, 1, store), SS_ERR_ALREADY_EXISTS);
        storage_sharing::ffi::store::ss_store_free(store); // the group keeps its own
        let (mut r, mut ws) = (-1, -1);
        assert_eq!(ss_symm_get_group_info(c"capi".as_ptr(), &mut r, &mut ws), SS_OK);
        assert_eq!((r, ws), (0, 1));
        assert_eq!(ss_symm_get_group_info(c"other".as_ptr(), &mut r, &mut ws), SS_ERR_NOT_FOUND);
        assert_eq!(ss_symm_get_group_info(c"capi".as_ptr(), null_mut(), &mut ws), SS_ERR_NULL_POINTER);

        let mut p: *mut c_void = null_mut();
        assert_eq!(ss_symm_alloc(7, 0, 64, null(), &mut p), SS_ERR_INVALID_ARGUMENT);
        if storage_sharing::cuda::check_available().is_err() {
            assert_eq!(ss_symm_alloc(SS_DEVICE_CUDA, 0, 64, null(), &mut p), SS_ERR_CUDA_UNAVAILABLE);
            let msg = std::ffi::CStr::from_ptr(storage_sharing::ffi::errors::ss_last_error_message()).to_string_lossy().into_owned();
            assert!(msg.contains("CUDA is not available: "), "{msg}");
        }
        assert_eq!(ss_symm_alloc(SS_DEVICE_CPU, 0, 64, null(), null_mut()), SS_ERR_NULL_POINTER);
        assert!(p.is_null(), "out written only on success");
        assert_eq!(ss_symm_alloc(SS_DEVICE_CPU, 0, 64, c"capi".as_ptr(), &mut p), SS_OK);
        let mut n = 0usize;
        assert_eq!(ss_symm_get_alloc_size(p, &mut n), SS_OK);
        assert_eq!(n, 64);
        let mut h = null();
        assert_eq!(ss_symm_mem_rendezvous(p, null(), -5, &mut h), SS_ERR_INVALID_ARGUMENT);
        assert_eq!(ss_symm_mem_rendezvous(null_mut(), null(), 1000, &mut h), SS_ERR_NULL_POINTER);
        assert_eq!(ss_symm_mem_rendezvous(p, null(), 10_000, &mut h), SS_OK);
        let mut h2 = null();
        assert_eq!(ss_symm_mem_rendezvous(p, c"capi".as_ptr(), 10_000, &mut h2), SS_OK);
        assert_eq!(h, h2, "same block and group: same handle");
        assert_eq!((ss_symm_mem_rank(h), ss_symm_mem_world_size(h), ss_symm_mem_buffer_size(h)), (0, 1, 64));
        assert_eq!(ss_symm_mem_signal_pad_size(h), 9216);
        assert_eq!((ss_symm_mem_rank(null()), ss_symm_mem_world_size(null()), ss_symm_mem_buffer_size(null())), (-1, -1, 0));
        let mut q: *mut c_void = null_mut();
        assert_eq!(ss_symm_mem_buffer_ptr(h, 0, &mut q), SS_OK);
        assert_eq!(q, p);
        assert_eq!(ss_symm_mem_buffer_ptr(h, 1, &mut q), SS_ERR_INVALID_ARGUMENT);
        assert_eq!(ss_symm_mem_signal_pad_ptr(h, 0, &mut q), SS_OK);
        assert_eq!(q as usize + 12288, p as usize, "layout [pad | buffer], buffer on its own page");
        assert_eq!(ss_symm_mem_get_buffer(h, 0, 65, 0, &mut q), SS_ERR_INVALID_ARGUMENT);
        // The pointer arrays of a CPU block are host arrays of world_size entries.
        let mut arr: *mut c_void = null_mut();
        assert_eq!(ss_symm_mem_buffer_ptrs_dev(h, &mut arr), SS_OK);
        assert_eq!(*(arr as *const usize), p as usize);
        assert_eq!(ss_symm_mem_signal_pad_ptrs_dev(h, &mut arr), SS_OK);
        assert_eq!(*(arr as *const usize) + 12288, p as usize);
        assert_eq!(ss_symm_mem_buffer_ptrs_dev(null(), &mut arr), SS_ERR_NULL_POINTER);
        assert_eq!(ss_symm_mem_signal_pad_ptrs_dev(h, null_mut()), SS_ERR_NULL_POINTER);
        assert!(!ss_symm_mem_has_multicast(h));
        assert!(!ss_symm_mem_has_multicast(null()));
        assert_eq!(ss_symm_mem_multicast_ptr(h, &mut arr), SS_ERR_UNSUPPORTED);
        let msg = std::ffi::CStr::from_ptr(storage_sharing::ffi::errors::ss_last_error_message()).to_string_lossy().into_owned();
        assert!(msg.contains("has no multicast: the CPU backend has no multicast"), "{msg}");
        assert_eq!(ss_symm_mem_get_buffer(null(), 0, 1, 0, &mut q), SS_ERR_NULL_POINTER);
        assert_eq!(ss_symm_mem_barrier(h, 0, -1, null_mut()), SS_ERR_INVALID_ARGUMENT);
        assert_eq!(ss_symm_mem_barrier(h, 0, 0, null_mut()), SS_OK, "one rank: nothing to wait for");
        assert_eq!(ss_symm_mem_put_signal(h, 0, 1, 100, null_mut()), SS_OK);
        assert_eq!(ss_symm_mem_put_signal(h, 0, 1, 30, null_mut()), SS_ERR_TIMEOUT, "slot still full");
        assert_eq!(ss_symm_mem_wait_signal(h, 0, 1, 100, null_mut()), SS_OK);
        assert_eq!(ss_symm_mem_wait_signal(h, 0, 1, 30, null_mut()), SS_ERR_TIMEOUT);
        assert_eq!(ss_symm_set_backend(c"CPU".as_ptr()), SS_ERR_BUSY);
        assert_eq!(ss_symm_free(null_mut()), SS_OK);
        assert_eq!(ss_symm_free(p), SS_OK);
        assert_eq!(ss_symm_free(p), SS_ERR_NOT_FOUND);
        assert_eq!(ss_symm_get_alloc_size(p, &mut n), SS_ERR_NOT_FOUND);
    }
    println!("ok");
}

/// Sets this rank's signal pad to `extra[rank]` bytes, then meets a peer
/// whose pad differs: refused on both ranks, naming both pads.
fn role_pad_mismatch(me: Rank) {
    let pads: Vec<usize> = me.extra.iter().map(|a| a.parse().unwrap()).collect();
    registry::set_signal_pad_size(pads[me.rank]).unwrap();
    me.join("world");
    let p = symm::alloc(DeviceType::Cpu, 0, 4096, Some("world")).unwrap();
    let e = symm::rendezvous(p, None, t(20_000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{}", e.message());
    let want = format!("rank 1 has a signal pad of {} bytes but rank 0 has {} bytes", pads[1], pads[0]);
    assert!(e.message().contains(&want), "{}", e.message());
    println!("rank {} pad mismatch: {}", me.rank, e.message());
}

/// World sizes no host can hold are refused when the group is set; a
/// rendezvous of a large world whose ranks never come times out with a
/// short message.
fn role_world_bounds(me: Rank) {
    for ws in [i32::MAX as i64, 1_000_000, 4097] {
        let e = group::set_group_info("huge", 0, ws, me.store.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{ws}: {}", e.message());
        assert!(e.message().contains(&format!("world_size {ws}")) && e.message().contains("at most 4096"), "{}", e.message());
    }
    // SAFETY: a valid group name and store handle, as in role_c_api.
    unsafe {
        use storage_sharing::ffi::ss_status::*;
        let dir = std::ffi::CString::new(me.dir.join("store").to_str().unwrap()).unwrap();
        let mut store = std::ptr::null_mut();
        assert_eq!(storage_sharing::ffi::store::ss_store_file_open(dir.as_ptr(), &mut store), SS_OK);
        let st = storage_sharing::ffi::symm::ss_symm_set_group_info(c"huge".as_ptr(), 0, i32::MAX, store);
        storage_sharing::ffi::store::ss_store_free(store);
        assert_eq!(st, SS_ERR_INVALID_ARGUMENT);
    }
    group::set_group_info("wide", 0, 4096, me.store.clone()).unwrap();
    let p = symm::alloc(DeviceType::Cpu, 0, 64, Some("wide")).unwrap();
    let e = symm::rendezvous(p, None, t(300)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{}", e.message());
    let m = e.message();
    assert!(m.len() < 1000, "a {}-byte message: {}", m.len(), &m[..300]);
    assert!(m.contains("rank(s) 1, 2, 3, 4, 5, 6, 7, 8 and 4087 more never arrived"), "{m}");
    symm::free(p).unwrap();
    println!("ok");
}

/// Rank 0 of a two-rank group whose rank 1 the test plays by hand: what
/// this rank maps as rank 1's buffer must be what the test sent, not what
/// a stranger sent first.
fn role_meets_the_test(me: Rank) {
    me.join("world");
    let p = symm::alloc(DeviceType::Cpu, 0, 64, Some("world")).unwrap();
    let h = symm::rendezvous(p, None, t(30_000)).unwrap();
    assert_eq!(&buffer(&h, 1)[..6], b"honest");
    symm::free(p).unwrap();
    println!("ok");
}

/// Rank 0 of a two-rank group whose rank 1 published a socket that some
/// other process listens on: the descriptor is not sent.
fn role_refuses_a_stranger_socket(me: Rank) {
    me.join("world");
    let p = symm::alloc(DeviceType::Cpu, 0, 64, Some("world")).unwrap();
    let e = symm::rendezvous(p, None, t(30_000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("its block descriptor was not sent"), "{}", e.message());
    println!("ok");
}

/// Connects to the socket named by `extra[0]` and sends a block that says
/// "forged", as rank 1 would.
fn role_stranger(me: Rank) {
    use std::os::fd::AsRawFd;
    let conn = storage_sharing::symm::abstract_socket::connect(&me.extra[0]).unwrap();
    let block = memfd_block(b"forged");
    // The rank may have closed the connection already (EPIPE): refused either way.
    match storage_sharing::storage::send_fds(conn.as_raw_fd(), &1u32.to_ne_bytes(), &[block.as_raw_fd()]) {
        Ok(_) => println!("sent"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::PeerGone, "{}", e.message()),
    }
}

/// A memfd as large as a 64-byte CPU block, `text` at its buffer, sealed
/// against shrinking as the backend's own blocks are.
fn memfd_block(text: &[u8]) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = unsealed_memfd_block(text);
    // SAFETY: fcntl on our own memfd.
    assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
    f
}

/// The same block without the seal: its sender could still shrink it.
fn unsealed_memfd_block(text: &[u8]) -> std::fs::File {
    use std::io::{Seek, SeekFrom, Write};
    let layout = storage_sharing::symm::cpu_backend::layout_for(64, registry::DEFAULT_SIGNAL_PAD_SIZE).unwrap();
    // SAFETY: memfd_create with a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"test-block".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is ours alone.
    let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    f.set_len(layout.block_size as u64).unwrap();
    f.seek(SeekFrom::Start(layout.buffer_offset as u64)).unwrap();
    f.write_all(text).unwrap();
    f
}

/// Rank 0 of a two-rank group whose true rank 1 (the test) sends a block
/// that is not sealed against shrinking: refused, nothing mapped.
fn role_refuses_an_unsealed_block(me: Rank) {
    me.join("world");
    let p = symm::alloc(DeviceType::Cpu, 0, 64, Some("world")).unwrap();
    let e = symm::rendezvous(p, None, t(30_000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{}", e.message());
    assert!(e.message().contains("the block of rank 1") && e.message().contains("not sealed"), "{}", e.message());
    symm::free(p).unwrap();
    println!("ok");
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    let me = Rank::from_args(args);
    match role.as_str() {
        "exchange" => role_exchange(me),
        "ordering" => role_ordering(me),
        "signals" => role_signals(me),
        "timeouts" => role_timeouts(me),
        "kill9" => role_kill9(me),
        "mismatch" => role_mismatch(me),
        "missing" => role_missing(me),
        "waits_to_be_killed" => role_waits_to_be_killed(me),
        "two_groups" => role_two_groups(me),
        "persistent" => role_persistent(me),
        "registry" => role_registry(me),
        "broadcast" => role_broadcast(me),
        "bad_args" => role_bad_args(me),
        "c_api" => role_c_api(me),
        "pad_mismatch" => role_pad_mismatch(me),
        "world_bounds" => role_world_bounds(me),
        "meets_the_test" => role_meets_the_test(me),
        "refuses_a_stranger_socket" => role_refuses_a_stranger_socket(me),
        "stranger" => role_stranger(me),
        "refuses_an_unsealed_block" => role_refuses_an_unsealed_block(me),
        other => panic!("unknown role {other}"),
    }
}

// ------------------------------------------------------------------- tests

#[test]
fn descriptor_broadcast_reaches_every_rank() {
    run_ranks("broadcast", "broadcast3", 3, &[]);
}

#[test]
fn two_ranks_read_each_others_buffers() {
    run_ranks("exchange", "exchange2", 2, &["65536"]);
}

#[test]
fn four_ranks_read_each_others_buffers() {
    run_ranks("exchange", "exchange4", 4, &["10000"]);
}

#[test]
fn barrier_orders_writes_on_three_ranks() {
    run_ranks("ordering", "ordering3", 3, &[]);
}

/// More ranks than this machine may have cores: ranks sleep on the futex
/// and are woken by their peers' puts.
#[test]
fn barrier_orders_writes_on_five_ranks() {
    run_ranks("ordering", "ordering5", 5, &[]);
}

#[test]
fn signals_on_several_channels() {
    let outs = run_ranks("signals", "signals", 2, &[]);
    // 9216-byte pad, 2 ranks: 2304 slots, 1152 channels (0..=1151).
    assert!(stdout(&outs[0].1).contains("max_channel=1151"), "{}", stdout(&outs[0].1));
}

#[test]
fn timeouts_name_rank_peer_and_channel() {
    run_ranks("timeouts", "timeouts", 2, &[]);
}

#[test]
fn size_mismatch_fails_on_every_rank() {
    let dir = test_dir("mismatch");
    let outs = finish(spawn_ranks("mismatch", &dir, 2, &[], &[]));
    assert_all_ok(&outs);
    assert_no_sockets_left(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_rank_times_out_naming_it() {
    let dir = test_dir("missing");
    let outs = finish(spawn_ranks("missing", &dir, 3, &[0, 1], &[]));
    assert_all_ok(&outs);
    assert_no_sockets_left(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank killed with -9 while it waits in a rendezvous leaves no
/// `symm_mem-<pid>` socket behind (found in review: the socket was bound
/// for the whole wait, so a kill left it in the temporary folder).
#[test]
fn rank_killed_while_waiting_in_rendezvous_leaves_no_socket() {
    use std::io::BufRead;
    let dir = test_dir("killed-waiting");
    let mut killed = spawn_ranks("waits_to_be_killed", &dir, 3, &[1], &[]);
    let mut line = String::new();
    let mut out = std::io::BufReader::new(killed[0].1.stdout.take().unwrap());
    while !line.contains("entering") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "rank 1 ended before its rendezvous");
    }
    std::thread::sleep(Duration::from_millis(300)); // inside the rendezvous, waiting
    killed[0].1.kill().unwrap();
    killed[0].1.wait().unwrap();
    assert_no_sockets_left(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_groups_interleaved_keep_their_own_sequence() {
    run_ranks("two_groups", "groups", 3, &[]);
}

#[test]
fn persistent_allocation_rules() {
    run_ranks("persistent", "persistent", 1, &[]);
}

#[test]
fn registry_rules_and_messages() {
    run_ranks("registry", "registry", 1, &[]);
    // A fresh process with a TORCH_SYMMMEM that PyTorch would reject.
    let dir = test_dir("registry-env");
    let mut cmd = child_command("registry", &[dir.to_str().unwrap(), "0", "1", "bad-env"]);
    cmd.env("TMPDIR", &dir).env("TORCH_SYMMMEM", "bogus");
    common::run_ok(cmd);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_ranks_channels_sizes_offsets_and_groups() {
    run_ranks("bad_args", "bad", 1, &[]);
}

#[test]
fn c_api_statuses() {
    run_ranks("c_api", "capi", 1, &[]);
}

fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm").unwrap().filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn rank_killed_mid_barrier_makes_the_others_time_out() {
    let dir = test_dir("kill9");
    let before = shm_entries();
    let mut children = spawn_ranks("kill9", &dir, 3, &[], &[]);
    let pids: Vec<u32> = children.iter().map(|(_, c)| c.id()).collect();
    // Wait until rank 2 is inside its barrier, then kill it.
    let (_, victim) = children.iter_mut().find(|(r, _)| *r == 2).unwrap();
    let mut out = victim.stdout.take().unwrap();
    let mut seen = String::new();
    let end = Instant::now() + Duration::from_secs(60);
    while !seen.contains("rank 2 in barrier") {
        let mut buf = [0u8; 256];
        let n = std::io::Read::read(&mut out, &mut buf).unwrap();
        assert!(n > 0 && Instant::now() < end, "rank 2 ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    std::thread::sleep(Duration::from_millis(100));
    victim.kill().unwrap();
    victim.wait().unwrap();
    let store = FileStore::open(dir.join("store")).unwrap();
    storage_sharing::store::Store::set(&store, b"kill9/dead", b"1").unwrap();
    let outs = finish(children.into_iter().filter(|(r, _)| *r != 2).collect());
    assert_all_ok(&outs);
    for (_, o) in &outs {
        assert!(stdout(o).contains("rank 2 on channel 1 after 500 ms"), "{}", stdout(o));
    }
    let new: Vec<String> = shm_entries()
        .into_iter()
        .filter(|n| !before.contains(n))
        .filter(|n| n.contains("symm") || pids.iter().any(|p| n.contains(&p.to_string())))
        .collect();
    assert!(new.is_empty(), "left in /dev/shm: {new:?}");
    assert_no_sockets_left(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Pads of 12288 and 9216 bytes give blocks of one size (the buffer starts
/// on the same page), yet a put to a rank whose pad is smaller can never be
/// waited for: the rendezvous compares the pads themselves.
#[test]
fn signal_pad_mismatch_is_refused_naming_both_pads() {
    for (tag, pads) in [("pad-same-block", ["9216", "12288"]), ("pad-other-block", ["9216", "4096"])] {
        let dir = test_dir(tag);
        let outs = finish(spawn_ranks("pad_mismatch", &dir, 2, &[], &pads));
        assert_all_ok(&outs);
        assert_no_sockets_left(&dir);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn world_size_is_bounded_and_missing_ranks_are_summed_up() {
    run_ranks("world_bounds", "world-bounds", 1, &[]);
}

/// The abstract-namespace descriptor sockets of process `pid`, as the
/// kernel lists them (`@symm_mem-<pid>-...`).
fn abstract_sockets_of(pid: u32) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    let mine = format!("@symm_mem-{pid}");
    table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|name| *name == mine || name.starts_with(&format!("{mine}-")))
        .map(str::to_string)
        .collect()
}

/// A rank killed with -9 while its descriptor socket is open (its peers
/// published their requests, but never open their sockets) leaves nothing
/// behind: no file in its TMPDIR, no socket in the kernel's table.
#[test]
fn rank_killed_with_its_descriptor_socket_open_leaves_nothing() {
    let dir = test_dir("killed-socket");
    let store = FileStore::open(dir.join("store")).unwrap();
    let mut sleeper = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    let layout = storage_sharing::symm::cpu_backend::layout_for(64, registry::DEFAULT_SIGNAL_PAD_SIZE).unwrap();
    let mut fake = storage_sharing::symm::request::RendezvousRequest::new(0, &layout);
    fake.pid = sleeper.id() as i32;
    for r in [0, 2] {
        storage_sharing::store::Store::set(&store, format!("symmetric_memory-world/CPUSymmetricMemory/0/{r}").as_bytes(), &fake.to_bytes())
            .unwrap();
    }
    let mut ranks = spawn_ranks("waits_to_be_killed", &dir, 3, &[1], &[]);
    let pid = ranks[0].1.id();
    let file = dir.join(format!("symm_mem-{pid}"));
    let end = Instant::now() + Duration::from_secs(60);
    while !file.exists() && abstract_sockets_of(pid).is_empty() {
        assert!(Instant::now() < end, "rank 1 never opened its descriptor socket");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    ranks[0].1.kill().unwrap();
    ranks[0].1.wait().unwrap();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_no_sockets_left(&dir);
    assert_eq!(abstract_sockets_of(pid), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TMPDIR longer than a Unix socket path can be (108 bytes) does not
/// stop a rendezvous.
#[test]
fn long_tmpdir_does_not_stop_a_rendezvous() {
    let mut dir = test_dir("long-tmpdir");
    while dir.as_os_str().len() < 160 {
        dir.push("a-rather-long-folder-name-for-a-temporary-folder");
    }
    std::fs::create_dir_all(&dir).unwrap();
    let outs = finish(spawn_ranks("exchange", &dir, 2, &[], &["4096"]));
    assert_all_ok(&outs);
    let _ = std::fs::remove_dir_all(test_dir("long-tmpdir"));
}

/// Publishes, as rank 1 of group "world", a request for process `pid` and
/// the descriptor socket `socket`.
fn publish_rank1(store: &FileStore, pid: u32, socket: &str) {
    use storage_sharing::store::Store;
    let layout = storage_sharing::symm::cpu_backend::layout_for(64, registry::DEFAULT_SIGNAL_PAD_SIZE).unwrap();
    let mut req = storage_sharing::symm::request::RendezvousRequest::new(0, &layout);
    req.pid = pid as i32;
    // The side details: pad size, the process's start time, socket name.
    let mut side = (registry::DEFAULT_SIGNAL_PAD_SIZE as u64).to_le_bytes().to_vec();
    side.extend_from_slice(&storage_sharing::proc_identity::start_ticks(pid as i32).unwrap().to_le_bytes());
    side.extend_from_slice(socket.as_bytes());
    let key = "symmetric_memory-world/CPUSymmetricMemory/0/1";
    store.set(format!("{key}/side").as_bytes(), &side).unwrap();
    store.set(key.as_bytes(), &req.to_bytes()).unwrap();
}

/// Waits until `fd` is readable; panics after 30 s.
fn readable(fd: std::os::fd::RawFd) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd on the stack for the duration of the call.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 30_000) }, 1, "nothing came in 30 s");
}

/// The descriptor sockets are abstract names anyone may connect to: a rank
/// closes unread a connection of any process but the peer it waits for
/// (here a stranger sends a forged block before the true rank 1 does).
#[test]
fn a_stranger_connection_is_not_taken_for_a_peer() {
    use std::os::fd::AsRawFd;
    use storage_sharing::store::Store;
    use storage_sharing::symm::abstract_socket;
    let dir = test_dir("stranger-conn");
    let store = FileStore::open(dir.join("store")).unwrap();
    let name = abstract_socket::unique_name();
    let listener = abstract_socket::listen(&name).unwrap();
    publish_rank1(&store, std::process::id(), &name);
    let rank0 = spawn_ranks("meets_the_test", &dir, 2, &[0], &[]);
    // Ring step 1: rank 0 sends us its block.
    readable(listener.as_raw_fd());
    let conn = abstract_socket::accept(listener.as_raw_fd()).unwrap();
    assert_eq!(abstract_socket::peer(conn.as_raw_fd()).unwrap().0, rank0[0].1.id() as i32);
    let mut origin = [0u8; 4];
    let (_, fds) = storage_sharing::storage::recv_fds(conn.as_raw_fd(), &mut origin, 1).unwrap();
    assert_eq!((u32::from_ne_bytes(origin), fds.len()), (0, 1));
    // Rank 0 now waits for rank 1: a stranger comes first.
    let side = store.get(b"symmetric_memory-world/CPUSymmetricMemory/0/0/side", Some(Duration::from_secs(30))).unwrap();
    let socket0 = String::from_utf8(side[16..].to_vec()).unwrap();
    let d = dir.to_str().unwrap().to_string();
    common::run_ok(child_command("stranger", &[d.as_str(), "9", "2", socket0.as_str()]));
    let honest = memfd_block(b"honest");
    let out = abstract_socket::connect(&socket0).unwrap();
    storage_sharing::storage::send_fds(out.as_raw_fd(), &1u32.to_ne_bytes(), &[honest.as_raw_fd()]).unwrap();
    // The closing barrier of the rendezvous (exchange 1).
    store.set(b"symmetric_memory-world/CPUSymmetricMemory/1/1", &0i32.to_ne_bytes()).unwrap();
    let outs = finish(rank0);
    assert_all_ok(&outs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Blocks are sealed against shrinking when made, and a rank maps a
/// peer's block only sealed: an unsealed one, even from the true peer
/// process, could be truncated under the mapping (SIGBUS).
#[test]
fn an_unsealed_block_from_the_true_peer_is_refused() {
    use std::os::fd::AsRawFd;
    use storage_sharing::store::Store;
    use storage_sharing::symm::abstract_socket;
    let dir = test_dir("unsealed");
    let store = FileStore::open(dir.join("store")).unwrap();
    let name = abstract_socket::unique_name();
    let listener = abstract_socket::listen(&name).unwrap();
    publish_rank1(&store, std::process::id(), &name);
    let rank0 = spawn_ranks("refuses_an_unsealed_block", &dir, 2, &[0], &[]);
    // Ring step 1: rank 0 sends us its block, sealed.
    readable(listener.as_raw_fd());
    let conn = abstract_socket::accept(listener.as_raw_fd()).unwrap();
    let mut origin = [0u8; 4];
    let (_, fds) = storage_sharing::storage::recv_fds(conn.as_raw_fd(), &mut origin, 1).unwrap();
    assert_eq!(fds.len(), 1);
    // SAFETY: F_GET_SEALS only reads.
    let seals = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GET_SEALS) };
    assert!(seals >= 0 && seals & libc::F_SEAL_SHRINK != 0, "rank 0's block is not sealed: {seals:#x}");
    // We are rank 1's process, but our block could shrink.
    let side = store.get(b"symmetric_memory-world/CPUSymmetricMemory/0/0/side", Some(Duration::from_secs(30))).unwrap();
    let socket0 = String::from_utf8(side[16..].to_vec()).unwrap();
    let unsealed = unsealed_memfd_block(b"unsealed");
    let out = abstract_socket::connect(&socket0).unwrap();
    storage_sharing::storage::send_fds(out.as_raw_fd(), &1u32.to_ne_bytes(), &[unsealed.as_raw_fd()]).unwrap();
    let outs = finish(rank0);
    assert_all_ok(&outs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank sends its block only to the peer's own process: a socket name
/// published for rank 1 that another process listens on gets nothing.
#[test]
fn a_block_is_not_sent_to_a_stranger_socket() {
    use std::os::fd::AsRawFd;
    use storage_sharing::symm::abstract_socket;
    let dir = test_dir("stranger-socket");
    let store = FileStore::open(dir.join("store")).unwrap();
    let mut sleeper = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    let name = abstract_socket::unique_name();
    let listener = abstract_socket::listen(&name).unwrap();
    // Rank 1 is the sleeper, but this process listens on its socket.
    publish_rank1(&store, sleeper.id(), &name);
    let outs = finish(spawn_ranks("refuses_a_stranger_socket", &dir, 2, &[0], &[]));
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_all_ok(&outs);
    // Rank 0 connected, saw who listens, and closed without sending.
    let conn = abstract_socket::accept(listener.as_raw_fd()).unwrap();
    let mut buf = [0u8; 4];
    let (n, fds) = storage_sharing::storage::recv_fds(conn.as_raw_fd(), &mut buf, 1).unwrap();
    assert_eq!((n, fds.len()), (0, 0), "rank 0 sent something to a stranger");
    let _ = std::fs::remove_dir_all(&dir);
}
