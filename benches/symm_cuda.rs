//! Symmetric memory on the CUDA backend, two ranks on device 0 (separate
//! processes: this bench binary run again, with
//! TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 as a one-GPU machine needs):
//!  - device barrier latency (one barrier + stream synchronise, and a run
//!    of barriers enqueued back to back), put/wait round trip, rendezvous;
//!  - as the floor, in the same run, the bare driver calls each is made
//!    of: a launch of an empty kernel + stream synchronise, and the
//!    cuMemCreate / reserve / map / set-access / undo of one block.
//!
//! Where there is no driver or device it prints `skipped: no CUDA device`.
//! Run: `cargo bench --bench symm_cuda` (SS_BENCH_QUICK=1 for fewer rounds).

#[path = "../tests/common/cuda_ctx.rs"]
mod cuda_ctx;

use cuda_ctx::{make_primary_current, ok};
use cudarc::driver::sys;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::{self, group, DeviceType};

const ROLE_ENV: &str = "SS_SYMM_CUDA_BENCH_RANK";
const NOP_PTX: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry ss_nop()\n{\n\tret;\n}\n\0";

fn rounds() -> usize {
    if std::env::var_os("SS_BENCH_QUICK").is_some() {
        200
    } else {
        2000
    }
}

fn stream_sync(s: usize) {
    // SAFETY: our stream, context current.
    ok(unsafe { sys::cuStreamSynchronize(s as sys::CUstream) }, "cuStreamSynchronize");
}

fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

fn main() {
    if let Ok(rank) = std::env::var(ROLE_ENV) {
        return run_rank(rank.parse().unwrap());
    }
    if let Err(e) = storage_sharing::cuda::check_available() {
        println!("skipped: no CUDA device ({})", e.message());
        return;
    }
    let mut mode = 0;
    // SAFETY: the driver is loaded and initialised; out-pointers ours.
    unsafe {
        let mut dev = 0;
        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        ok(sys::cuDeviceGetAttribute(&mut mode, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev), "compute mode");
    }
    if mode != 0 {
        // Both ranks are processes on device 0: only the default compute
        // mode lets the second one make a context there.
        println!("skipped: device 0 is in compute mode {mode}, not the default one that lets two processes share it");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ss-symm-cuda-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .env(ROLE_ENV, r.to_string())
                .env("SS_BENCH_DIR", &dir)
                .env("TMPDIR", &dir)
                .env("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    println!("| operation (2 ranks, one device) | median µs | floor: bare driver calls, median µs |");
    println!("|---|---|---|");
    for c in children {
        let out = c.wait_with_output().unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
        assert!(out.status.success(), "a rank failed: {}", out.status);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn run_rank(rank: usize) {
    let dir = PathBuf::from(std::env::var("SS_BENCH_DIR").unwrap());
    let store: StoreRef = Arc::new(FileStore::open(dir.join("store")).unwrap());
    group::set_group_info("bench", rank as i64, 2, store).unwrap();
    let size = 1 << 20;
    let t = Some(Duration::from_secs(60));

    // The first alloc of the process also initialises the driver and
    // retains the primary context; a second one shows the alloc itself.
    let started = Instant::now();
    let first = symm::alloc(DeviceType::Cuda, 0, size, Some("bench")).unwrap();
    let first_alloc_time = started.elapsed();
    symm::free(first).unwrap();
    let started = Instant::now();
    let p = symm::alloc(DeviceType::Cuda, 0, size, Some("bench")).unwrap();
    let alloc_time = started.elapsed();
    let h = symm::rendezvous(p, None, t).unwrap();
    let rendezvous_time = started.elapsed() - alloc_time;
    make_primary_current();
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: context current; out-pointer ours.
    ok(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate");
    let s = s as usize;
    let n = rounds();

    // Warm up (JIT, first launches).
    for _ in 0..50 {
        h.barrier(0, t, s).unwrap();
    }
    stream_sync(s);

    let mut one = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        h.barrier(0, t, s).unwrap();
        stream_sync(s);
        one.push(t0.elapsed());
    }
    let t0 = Instant::now();
    for _ in 0..n {
        h.barrier(1, t, s).unwrap();
    }
    stream_sync(s);
    let pipelined = t0.elapsed().as_secs_f64() * 1e6 / n as f64;

    let mut rtt = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        if rank == 0 {
            h.put_signal(1, 2, t, s).unwrap();
            h.wait_signal(1, 2, t, s).unwrap();
        } else {
            h.wait_signal(0, 2, t, s).unwrap();
            h.put_signal(0, 2, t, s).unwrap();
        }
        stream_sync(s);
        rtt.push(t0.elapsed());
    }
    h.barrier(0, t, s).unwrap();
    stream_sync(s);

    let launch_floor = launch_floor(s, n);
    let block_floor = block_floor(size, 50);
    if rank == 0 {
        let (lf, bf) = (median_us(launch_floor), median_us(block_floor));
        println!("| barrier + cuStreamSynchronize | {:.1} | {lf:.1} (empty kernel launch + sync) |", median_us(one));
        println!("| barrier, {n} enqueued back to back, per barrier | {pipelined:.1} | |");
        println!(
            "| put_signal + wait_signal round trip (+ sync) | {:.1} | {:.1} (two launches + sync: 2 × floor) |",
            median_us(rtt),
            2.0 * lf
        );
        println!(
            "| first alloc of 1 MiB in the process (rank 0: driver init + primary context) | {:.0} | |",
            first_alloc_time.as_secs_f64() * 1e6
        );
        println!(
            "| alloc of 1 MiB (rank 0, context made) | {:.0} | {bf:.0} (cuMemCreate+reserve+map+access, undone) |",
            alloc_time.as_secs_f64() * 1e6
        );
        println!("| rendezvous of 1 MiB (rank 0, file store) | {:.0} | |", rendezvous_time.as_secs_f64() * 1e6);
    }
    symm::free(p).unwrap();
}

/// An empty kernel launched and waited for, `n` times.
fn launch_floor(s: usize, n: usize) -> Vec<Duration> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: NUL-terminated PTX; out-pointers ours.
    ok(unsafe { sys::cuModuleLoadData(&mut module, NOP_PTX.as_ptr().cast()) }, "cuModuleLoadData");
    let mut f: sys::CUfunction = std::ptr::null_mut();
    ok(unsafe { sys::cuModuleGetFunction(&mut f, module, c"ss_nop".as_ptr()) }, "cuModuleGetFunction");
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        // SAFETY: a kernel without parameters.
        ok(
            unsafe { sys::cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s as sys::CUstream, std::ptr::null_mut(), std::ptr::null_mut()) },
            "cuLaunchKernel",
        );
        stream_sync(s);
        v.push(t0.elapsed());
    }
    ok(unsafe { sys::cuModuleUnload(module) }, "cuModuleUnload");
    v
}

/// cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess of a
/// block of the layout's size, and their undoing, `n` times.
fn block_floor(size: usize, n: usize) -> Vec<Duration> {
    use sys::*;
    // SAFETY: plain C structs, every field that matters set.
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = CUmemAllocationType_enum::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    let mut g = 0usize;
    ok(
        unsafe {
            cuMemGetAllocationGranularity(&mut g, &prop, CUmemAllocationGranularity_flags_enum::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        },
        "granularity",
    );
    let bytes = (size + 12288).next_multiple_of(g);
    let mut access: CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CUmemAccess_flags_enum::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let (mut h, mut va) = (0u64, 0u64);
        // SAFETY: the usual VMM sequence on our own objects.
        unsafe {
            ok(cuMemCreate(&mut h, bytes, &prop, 0), "cuMemCreate");
            ok(cuMemAddressReserve(&mut va, bytes, g, 0, 0), "cuMemAddressReserve");
            ok(cuMemMap(va, bytes, 0, h, 0), "cuMemMap");
            ok(cuMemSetAccess(va, bytes, &access, 1), "cuMemSetAccess");
            ok(cuMemUnmap(va, bytes), "cuMemUnmap");
            ok(cuMemAddressFree(va, bytes), "cuMemAddressFree");
            ok(cuMemRelease(h), "cuMemRelease");
        }
        v.push(t0.elapsed());
    }
    v
}
