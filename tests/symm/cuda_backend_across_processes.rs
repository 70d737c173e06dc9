//! Symmetric memory on the CUDA backend across real processes (each rank
//! is this test binary run again, all on device 0 with
//! TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, as a one-GPU machine needs).
//! Where there is no driver or device every GPU test prints
//! `skipped: no CUDA device (reason)` and passes; the tests that need no
//! GPU (the typed CUDA-unavailable statuses, the PTX assembling with
//! ptxas where one is found) run everywhere.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/cuda_ctx.rs"]
mod cuda_ctx;
#[path = "../common/symm_ranks.rs"]
mod symm_ranks;

use common::{my_role, pattern};

use cuda_ctx::{make_primary_current, ok};
use cudarc::driver::sys;
use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::symm::{self, group, DeviceType, SymmetricMemory};
use storage_sharing::ErrorKind;
use symm_ranks::{finish, rank_command, sockets_left, Rank};

/// True where CUDA can be used by several processes on device 0; prints
/// the skip line where not.
fn gpu(test: &str) -> bool {
    if let Err(e) = storage_sharing::cuda::check_available() {
        println!("{test}: skipped: no CUDA device ({})", e.message());
        return false;
    }
    let mut mode = 0;
    // SAFETY: the driver is loaded and initialised (check_available); out-pointers ours.
    unsafe {
        let mut dev = 0;
        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        ok(sys::cuDeviceGetAttribute(&mut mode, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev), "compute mode");
    }
    match one_device_blocker(mode) {
        None => true,
        Some(why) => {
            println!("{test}: skipped: {why}");
            false
        }
    }
}

/// Why the ranks (separate processes, all on device 0) cannot run, given
/// device 0's compute mode: only the default mode lets several processes
/// make a context on one device (exclusive-process, common on clusters,
/// refuses the second one with CUDA_ERROR_DEVICES_UNAVAILABLE).
fn one_device_blocker(compute_mode: i32) -> Option<String> {
    match compute_mode {
        0 => None,
        2 => Some("device 0 is in the prohibited compute mode (no context can be made)".to_string()),
        3 => Some(
            "device 0 is in the exclusive-process compute mode: these tests run every rank on device 0 as a \
             separate process (set the default mode with `nvidia-smi -c DEFAULT`)"
                .to_string(),
        ),
        m => Some(format!("device 0 is in compute mode {m}, which these multi-process tests do not know")),
    }
}

/// Runs everywhere: the compute modes that keep the ranks off one device.
#[test]
fn compute_modes_that_keep_ranks_off_one_device() {
    assert_eq!(one_device_blocker(0), None);
    assert!(one_device_blocker(3).unwrap().contains("exclusive-process"));
    assert!(one_device_blocker(2).unwrap().contains("prohibited"));
    assert!(one_device_blocker(7).unwrap().contains("compute mode 7"));
}

fn test_dir(tag: &str) -> PathBuf {
    symm_ranks::test_dir("ss-symm-cuda", tag)
}

fn spawn_ranks(role: &str, dir: &Path, ws: usize, allow_overlap: bool, extra: &[&str]) -> Vec<(usize, Child)> {
    (0..ws)
        .map(|r| {
            let mut cmd = rank_command(role, dir, r, ws, extra);
            if allow_overlap {
                cmd.env("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1");
            } else {
                cmd.env_remove("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES");
            }
            (r, cmd.spawn().expect("spawn rank"))
        })
        .collect()
}

fn show(o: &Output) -> String {
    format!("{}\nstdout:\n{}\nstderr:\n{}", o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// What is named in /dev/shm, apart from the driver's own `cuda.*` files
/// (this backend names nothing there; what the driver keeps is its affair).
fn dev_shm() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.retain(|n| !n.starts_with("cuda."));
    v.sort();
    v
}

/// Runs `ws` ranks of `role`; every rank must succeed, leave no socket
/// file and name nothing in /dev/shm.
fn run_ranks(role: &str, ws: usize, extra: &[&str]) -> Vec<(usize, Output)> {
    let dir = test_dir(&format!("{role}{ws}"));
    let shm_before = dev_shm();
    let outs = finish(spawn_ranks(role, &dir, ws, true, extra));
    for (r, o) in &outs {
        assert!(o.status.success(), "rank {r} of {role} failed: {}", show(o));
        print!("{}", String::from_utf8_lossy(&o.stdout));
    }
    assert_eq!(dev_shm(), shm_before, "nothing may appear in /dev/shm");
    let left = sockets_left(&dir);
    assert!(left.is_empty(), "sockets left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
    outs
}

// ---------------------------------------------------------------- children

/// Joins group "world", allocates `size` bytes on device 0 and
/// rendezvouses; makes device 0's primary context current here.
fn cuda_block(me: &Rank, size: usize) -> (*mut u8, Arc<SymmetricMemory>) {
    me.join("world");
    let p = symm::alloc(DeviceType::Cuda, 0, size, Some("world")).unwrap();
    let h = symm::rendezvous(p, None, t(60_000)).unwrap();
    make_primary_current();
    (p, h)
}

fn t(ms: u64) -> Option<Duration> {
    Some(Duration::from_millis(ms))
}

fn sync() {
    // SAFETY: context current (make_primary_current).
    ok(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize");
}

fn new_stream() -> usize {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: context current; out-pointer ours.
    ok(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate(non-blocking)");
    s as usize
}

/// Copies host bytes to device address `dst` on `stream` and waits for it.
fn upload(dst: *mut u8, bytes: &[u8], stream: usize) {
    // SAFETY: dst is device memory of at least bytes.len() (a buffer).
    unsafe {
        ok(sys::cuMemcpyHtoDAsync_v2(dst as u64, bytes.as_ptr().cast(), bytes.len(), stream as sys::CUstream), "HtoD");
        ok(sys::cuStreamSynchronize(stream as sys::CUstream), "cuStreamSynchronize");
    }
}

fn download(src: *const u8, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: src is device memory of at least len bytes.
    ok(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src as u64, len) }, "DtoH");
    v
}

fn pad_is_zero(h: &SymmetricMemory, rank: usize) -> bool {
    download(h.signal_pad_ptr(rank as i64).unwrap(), h.signal_pad_size()).iter().all(|&b| b == 0)
}

fn role_exchange(me: Rank) {
    let size: usize = me.extra[0].parse().unwrap();
    let (p, h) = cuda_block(&me, size);
    assert_eq!((h.rank(), h.world_size(), h.buffer_size()), (me.rank, me.ws, size));
    assert_eq!(symm::get_alloc_size(p).unwrap(), size);
    assert!(!h.has_multicast(), "ranks share a device: no multicast");
    let why = h.multicast_ptr().unwrap_err();
    assert_eq!(why.kind(), ErrorKind::Unsupported);
    // The device pointer arrays hold what the host sees.
    let arr = download(h.buffer_ptrs_dev().unwrap(), 8 * me.ws);
    let pads = download(h.signal_pad_ptrs_dev().unwrap(), 8 * me.ws);
    for r in 0..me.ws {
        assert_eq!(u64::from_ne_bytes(arr[8 * r..][..8].try_into().unwrap()), h.buffer_ptr(r as i64).unwrap() as u64);
        assert_eq!(u64::from_ne_bytes(pads[8 * r..][..8].try_into().unwrap()), h.signal_pad_ptr(r as i64).unwrap() as u64);
    }
    // Each rank writes its pattern with a copy on a side stream.
    let side = new_stream();
    upload(p, &pattern(size, me.rank as u8), side);
    h.barrier(0, t(20_000), side).unwrap();
    // SAFETY: our stream.
    ok(unsafe { sys::cuStreamSynchronize(side as sys::CUstream) }, "sync side");
    for peer in 0..me.ws {
        let got = download(h.buffer_ptr(peer as i64).unwrap(), size);
        assert!(got == pattern(size, peer as u8), "rank {} read a wrong buffer of rank {peer}", me.rank);
    }
    // Write into the next rank's buffer through its mapping.
    h.barrier(0, t(20_000), side).unwrap();
    let next = (me.rank + 1) % me.ws;
    upload(h.buffer_ptr(next as i64).unwrap(), &(1000 + me.rank as u64).to_ne_bytes(), side);
    h.barrier(1, t(20_000), side).unwrap();
    ok(unsafe { sys::cuStreamSynchronize(side as sys::CUstream) }, "sync side");
    let prev = (me.rank + me.ws - 1) % me.ws;
    assert_eq!(u64::from_ne_bytes(download(p, 8).try_into().unwrap()), 1000 + prev as u64);
    // 200 more barriers on alternating channels, then the pads are clean.
    let started = Instant::now();
    for i in 0..200 {
        h.barrier(i % 2, t(20_000), side).unwrap();
    }
    ok(unsafe { sys::cuStreamSynchronize(side as sys::CUstream) }, "sync side");
    let per = started.elapsed() / 200;
    h.barrier(0, t(20_000), side).unwrap(); // also: no timeout was recorded
    sync();
    assert!(pad_is_zero(&h, me.rank), "pad of rank {} not zero after clean syncs", me.rank);
    symm::free(p).unwrap();
    println!("rank {} ok ({} ranks, {size} bytes, {per:?} per barrier)", me.rank, me.ws);
}

fn role_signals(me: Rank) {
    let (_p, h) = cuda_block(&me, 4096);
    let s = new_stream();
    let max = h.max_channel();
    let channels = [0usize, 3, 7, max];
    if me.rank == 0 {
        for (i, &c) in channels.iter().enumerate() {
            let dst = h.get_buffer(1, 8, (c * 8) % 4096).unwrap();
            upload(dst, &(77 + i as u64).to_ne_bytes(), s);
            h.put_signal(1, c as i64, t(20_000), s).unwrap();
        }
        h.wait_signal(1, 5, t(20_000), s).unwrap();
    } else {
        for (i, &c) in channels.iter().enumerate().rev() {
            h.wait_signal(0, c as i64, t(20_000), s).unwrap();
            ok(unsafe { sys::cuStreamSynchronize(s as sys::CUstream) }, "sync");
            let got = download(h.get_buffer(1, 8, (c * 8) % 4096).unwrap(), 8);
            assert_eq!(u64::from_ne_bytes(got.try_into().unwrap()), 77 + i as u64, "channel {c}");
        }
        h.put_signal(0, 5, t(20_000), s).unwrap();
    }
    h.barrier(0, t(20_000), s).unwrap();
    ok(unsafe { sys::cuStreamSynchronize(s as sys::CUstream) }, "sync");
    h.barrier(0, t(20_000), s).unwrap(); // reports any recorded timeout
    sync();
    assert!(pad_is_zero(&h, me.rank));
    println!("rank {} ok (channels {channels:?})", me.rank);
}

fn role_timeout(me: Rank) {
    let (_p, h) = cuda_block(&me, 4096);
    if me.rank == 0 {
        // Rank 1 never signals on channel 2: the kernel gives up after 300 ms.
        h.wait_signal(1, 2, t(300), 0).unwrap();
        sync(); // the kernel ended: the context is not wedged
        let e = h.barrier(0, t(20_000), 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(
            e.message().starts_with("CUDASymmetricMemory::wait_signal: rank 0 failed to receive signal from rank 1 on channel 2 after "),
            "{}",
            e.message()
        );
        // Reported once; the next barrier is enqueued again.
        h.barrier(0, t(20_000), 0).unwrap();
    } else {
        h.barrier(0, t(20_000), 0).unwrap();
    }
    sync();
    h.barrier(1, t(20_000), 0).unwrap();
    sync();
    assert!(pad_is_zero(&h, me.rank));
    println!("rank {} ok", me.rank);
}

fn role_kill9(me: Rank) {
    let (p, h) = cuda_block(&me, 4096);
    h.barrier(0, t(20_000), 0).unwrap();
    sync();
    if me.rank == 2 {
        // SAFETY: sends SIGKILL to this very process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!();
    }
    std::thread::sleep(Duration::from_millis(300)); // rank 2 is gone by now
                                                    // Long enough that the live peer always answers in time, even with the
                                                    // other tests' ranks time-slicing the one GPU: the timeout must name
                                                    // rank 2, and with a short one the thread waiting for rank 1 could
                                                    // claim the record first.
    h.barrier(0, t(3000), 0).unwrap();
    sync();
    let e = h.barrier(0, t(500), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.message().contains("rank 2 on channel 0"), "{}", e.message());
    symm::free(p).unwrap(); // the dead rank's memory stays mapped until here
    println!("rank {} ok: {}", me.rank, e.message());
}

fn role_overlap_refused(me: Rank) {
    group::set_group_info("world", me.rank as i64, me.ws as i64, me.store.clone()).unwrap();
    let p = symm::alloc(DeviceType::Cuda, 0, 4096, Some("world")).unwrap();
    let e = symm::rendezvous(p, None, t(60_000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.message().contains("ranks 0 and 1 both allocated on CUDA device 0"), "{}", e.message());
    assert!(e.message().contains("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"), "{}", e.message());
    symm::free(p).unwrap();
    println!("rank {} ok", me.rank);
}

/// The C API on the CUDA backend: allocation, rendezvous, pointer arrays,
/// multicast queries, barrier on a stream, a device timeout reported by the
/// next call, free.
fn role_c_api(me: Rank) {
    use std::ffi::CStr;
    use std::ptr::{null, null_mut};
    use storage_sharing::ffi::errors::ss_last_error_message;
    use storage_sharing::ffi::ss_status::*;
    use storage_sharing::ffi::symm::*;
    group::set_group_info("world", me.rank as i64, me.ws as i64, me.store.clone()).unwrap();
    let last = || unsafe { CStr::from_ptr(ss_last_error_message()) }.to_string_lossy().into_owned();
    // SAFETY: valid pointers throughout; the handle lives until ss_symm_free.
    unsafe {
        let mut p = null_mut();
        assert_eq!(ss_symm_alloc(SS_DEVICE_CUDA, 0, 4096, c"world".as_ptr(), &mut p), SS_OK, "{}", last());
        let mut h = std::ptr::null();
        assert_eq!(ss_symm_mem_rendezvous(p, null(), 60_000, &mut h), SS_OK, "{}", last());
        make_primary_current();
        let mut arr = null_mut();
        assert_eq!(ss_symm_mem_buffer_ptrs_dev(h, &mut arr), SS_OK);
        let bytes = download(arr.cast(), 8 * me.ws);
        for r in 0..me.ws {
            let mut q = null_mut();
            assert_eq!(ss_symm_mem_buffer_ptr(h, r as i32, &mut q), SS_OK);
            assert_eq!(u64::from_ne_bytes(bytes[8 * r..][..8].try_into().unwrap()), q as u64);
        }
        assert_eq!(ss_symm_mem_signal_pad_ptrs_dev(h, &mut arr), SS_OK);
        assert!(!ss_symm_mem_has_multicast(h));
        assert_eq!(ss_symm_mem_multicast_ptr(h, &mut arr), SS_ERR_UNSUPPORTED);
        assert!(last().contains("ranks share a device"), "{}", last());
        let s = new_stream();
        assert_eq!(ss_symm_mem_barrier(h, 0, 20_000, s as *mut _), SS_OK, "{}", last());
        assert_eq!(ss_symm_mem_barrier(h, 1 << 20, 20_000, s as *mut _), SS_ERR_INVALID_ARGUMENT);
        // Both ranks wait for a signal no one sends: both time out on the device.
        let peer = (1 - me.rank) as i32;
        assert_eq!(ss_symm_mem_wait_signal(h, peer, 3, 200, s as *mut _), SS_OK, "enqueued");
        ok(sys::cuStreamSynchronize(s as sys::CUstream), "sync");
        assert_eq!(ss_symm_mem_barrier(h, 0, 20_000, s as *mut _), SS_ERR_TIMEOUT);
        assert!(last().contains(&format!("failed to receive signal from rank {peer} on channel 3")), "{}", last());
        assert_eq!(ss_symm_mem_barrier(h, 0, 20_000, s as *mut _), SS_OK, "{}", last());
        ok(sys::cuStreamSynchronize(s as sys::CUstream), "sync");
        assert_eq!(ss_symm_mem_barrier(h, 0, 20_000, s as *mut _), SS_OK, "no timeout left: {}", last());
        sync();
        assert_eq!(ss_symm_free(p), SS_OK);
    }
    println!("rank {} ok", me.rank);
}

#[test]
#[ignore = "run as a child by the tests below"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    let me = Rank::from_args(args);
    match role.as_str() {
        "exchange" => role_exchange(me),
        "signals" => role_signals(me),
        "timeout" => role_timeout(me),
        "kill9" => role_kill9(me),
        "overlap_refused" => role_overlap_refused(me),
        "c_api" => role_c_api(me),
        other => panic!("unknown role {other}"),
    }
}

// ------------------------------------------------------------------- tests

#[test]
fn two_ranks_read_each_others_buffers() {
    if gpu("two_ranks_read_each_others_buffers") {
        run_ranks("exchange", 2, &["1048576"]);
    }
}

#[test]
fn four_ranks_read_each_others_buffers() {
    if gpu("four_ranks_read_each_others_buffers") {
        run_ranks("exchange", 4, &["65536"]);
    }
}

#[test]
fn put_and_wait_on_several_channels() {
    if gpu("put_and_wait_on_several_channels") {
        run_ranks("signals", 2, &[]);
    }
}

#[test]
fn timeout_when_a_rank_never_signals() {
    if gpu("timeout_when_a_rank_never_signals") {
        run_ranks("timeout", 2, &[]);
    }
}

#[test]
fn c_api_on_two_ranks() {
    if gpu("c_api_on_two_ranks") {
        run_ranks("c_api", 2, &[]);
    }
}

#[test]
fn killed_rank_makes_the_others_time_out() {
    if !gpu("killed_rank_makes_the_others_time_out") {
        return;
    }
    let dir = test_dir("kill9");
    let shm_before = dev_shm();
    let outs = finish(spawn_ranks("kill9", &dir, 3, true, &[]));
    for (r, o) in &outs {
        if *r == 2 {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(o.status.signal(), Some(libc::SIGKILL), "rank 2: {}", show(o));
        } else {
            assert!(o.status.success(), "rank {r}: {}", show(o));
            print!("{}", String::from_utf8_lossy(&o.stdout));
        }
    }
    assert_eq!(dev_shm(), shm_before, "nothing may appear in /dev/shm");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_on_one_device_are_refused_unless_allowed() {
    if !gpu("ranks_on_one_device_are_refused_unless_allowed") {
        return;
    }
    let dir = test_dir("overlap");
    for (r, o) in finish(spawn_ranks("overlap_refused", &dir, 2, false, &[])) {
        assert!(o.status.success(), "rank {r}: {}", show(&o));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs everywhere: without a driver or device, CUDA symmetric memory
/// fails with the typed status and the reason, through Rust and C.
#[test]
fn cuda_unavailable_is_typed_with_the_reason() {
    use storage_sharing::ffi::ss_status::*;
    use storage_sharing::ffi::symm::*;
    let Err(why) = storage_sharing::cuda::check_available() else {
        // A device is there: a device index past the last one is refused.
        let e = symm::alloc(DeviceType::Cuda, 4096, 64, None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{}", e.message());
        println!("CUDA present: bad device index refused: {}", e.message());
        return;
    };
    let e = symm::alloc(DeviceType::Cuda, 0, 64, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::CudaUnavailable);
    assert_eq!(e.message(), why.message());
    let e = symm::alloc_persistent(DeviceType::Cuda, 0, 64, None, 99).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::CudaUnavailable);
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer; NULL group.
    let st = unsafe { ss_symm_alloc(SS_DEVICE_CUDA, 0, 64, std::ptr::null(), &mut p) };
    assert_eq!(st, SS_ERR_CUDA_UNAVAILABLE);
    assert!(p.is_null());
    // SAFETY: the library's thread-local message.
    let msg = unsafe { std::ffi::CStr::from_ptr(storage_sharing::ffi::errors::ss_last_error_message()) };
    let msg = msg.to_string_lossy();
    assert!(msg.contains("CUDA is not available: "), "{msg}");
    println!("skipped the GPU part: no CUDA device; typed: {msg}");
}

/// The ptxas to check the embedded PTX with: $SS_PTXAS, else `ptxas` on PATH.
fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SS_PTXAS") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join("ptxas")).find(|p| p.is_file())
}

/// Runs everywhere a ptxas is found: the embedded signal kernels assemble
/// for sm_80 and sm_90 (what the driver's JIT will do on those devices).
#[test]
fn signal_ptx_assembles_with_ptxas() {
    let Some(ptxas) = find_ptxas() else {
        println!("skipped: no ptxas (set SS_PTXAS, or put ptxas on PATH)");
        return;
    };
    let dir = test_dir("ptxas");
    let src = dir.join("cuda_signals.ptx");
    let text = storage_sharing::symm::cuda_backend::SIGNAL_PTX.trim_end_matches('\0');
    std::fs::write(&src, text).unwrap();
    let version = std::process::Command::new(&ptxas).arg("--version").output().expect("run ptxas --version");
    let version = String::from_utf8_lossy(&version.stdout);
    let release = version.lines().find(|l| l.contains("release")).unwrap_or("?").trim().to_string();
    for arch in ["sm_80", "sm_90"] {
        let out = std::process::Command::new(&ptxas)
            .args([&format!("-arch={arch}"), "-v", "-o"])
            .arg(dir.join(format!("{arch}.cubin")))
            .arg(&src)
            .output()
            .expect("run ptxas");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ptxas -arch={arch} failed:\n{log}");
        for k in storage_sharing::symm::cuda_backend::KERNELS {
            assert!(log.contains(&format!("entry function '{k}' for '{arch}'")), "{k} not compiled for {arch}:\n{log}");
        }
        let cubin = std::fs::metadata(dir.join(format!("{arch}.cubin"))).unwrap().len();
        println!("ptxas ({release}) -arch={arch}: ok, {cubin}-byte cubin, kernels {:?}", storage_sharing::symm::cuda_backend::KERNELS);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
