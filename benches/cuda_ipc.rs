//! CUDA IPC latencies on a real device, next to the bare driver calls they
//! are made of (the floor): share, open (first and cached), release, and a
//! collection with 1000 blocks in limbo. Prints a markdown table; prints
//! "skipped" where there is no CUDA device.
//!
//! Run: cargo bench --bench cuda_ipc

use cudarc::driver::sys::{self, CUresult};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use storage_sharing::cuda::{self, IpcHandle};

const ROLE_ENV: &str = "SS_CUDA_BENCH_ROLE";
const ROUNDS: usize = 1000;
const OPENS: usize = 200;

fn ok(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

fn make_current() {
    // SAFETY: driver checked by the caller; out-pointers are ours.
    unsafe {
        let mut dev = 0;
        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        let mut ctx = std::ptr::null_mut();
        ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "retain");
        ok(sys::cuCtxSetCurrent(ctx), "set current");
    }
}

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    (us(v[v.len() / 2]), v.iter().map(|d| us(*d)).sum::<f64>() / v.len() as f64)
}

fn row(what: &str, v: Vec<Duration>, floor: &str) {
    let (median, mean) = stats(v);
    println!("| {what} | {median:.1} | {mean:.1} | {floor} |");
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let out = f();
    (out, t.elapsed())
}

fn main() {
    if std::env::var(ROLE_ENV).as_deref() == Ok("consumer") {
        return consumer();
    }
    if let Err(e) = cuda::check_available() {
        println!("skipped: no usable CUDA device: {e}");
        return;
    }
    make_current();
    let ipc = cuda::global();
    println!("| operation | median µs | mean µs | floor: bare driver calls, median µs |");
    println!("|---|---|---|---|");

    // Share: pointer-to-base, memory handle, event, slot.
    let block = cuda::device_alloc(0, 1 << 20).unwrap();
    let mut times = Vec::new();
    let mut sends = Vec::new();
    for _ in 0..ROUNDS {
        let ((h, s), d) = timed(|| ipc.share(block, 1 << 20, 0, 0, None).unwrap());
        times.push(d);
        sends.push((h, s.unwrap()));
    }
    let floor = raw_share_floor(block);
    row("share (event recorded)", times, &format!("{floor:.1}"));
    let mut times = Vec::new();
    for _ in 0..OPENS {
        let ((h, s), d) = timed(|| ipc.share(block, 1 << 20, 0, 0, None).unwrap());
        assert!(!h.event_sync_required);
        times.push(d);
        sends.push((h, s.unwrap()));
    }
    row("share with 1000 events alive (stream sync instead)", times, "-");
    let mut times = Vec::new();
    for (h, _) in &sends {
        let (_, d) = timed(|| cuda::release_ipc_counter(&h.ref_counter_handle, h.ref_counter_offset).unwrap());
        times.push(d);
    }
    row("release_ipc_counter (open file, atomic −1, close)", times, "-");
    let mut times = Vec::new();
    for (_, s) in sends {
        let (_, d) = timed(|| ipc.sent_free(s));
        times.push(d);
    }
    row("sent_free of a released send", times, "-");
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let (_, d) = timed(|| {
            let (h, s) = ipc.share(block, 1 << 20, 0, 0, None).unwrap();
            cuda::release_ipc_counter(&h.ref_counter_handle, h.ref_counter_offset).unwrap();
            assert!(!ipc.sent_free(s.unwrap()));
        });
        times.push(d);
    }
    row("one send at a time: share + release_ipc_counter + sent_free", times, "-");

    // Open/release in a consumer process.
    let blocks: Vec<u64> = (0..OPENS).map(|_| cuda::device_alloc(0, 1 << 20).unwrap()).collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE_ENV, "consumer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut held = Vec::new();
    for b in &blocks {
        let (h, s) = ipc.share(*b, 1 << 20, 0, 0, None).unwrap();
        writeln!(to_child, "first {}", h.to_text()).unwrap();
        held.push(s.unwrap());
    }
    for _ in 0..OPENS {
        let (h, s) = ipc.share(blocks[0], 1 << 20, 0, 0, None).unwrap();
        writeln!(to_child, "cached {}", h.to_text()).unwrap();
        held.push(s.unwrap());
    }
    drop(to_child);
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        println!("{}", line.unwrap());
    }
    assert!(child.wait().unwrap().success());
    for s in held {
        assert!(!ipc.sent_free(s), "the consumer released everything");
    }
    for b in blocks {
        cuda::device_free(0, b).unwrap();
    }

    // Collection with 1000 blocks in limbo, each its own allocation.
    let mut handles = Vec::new();
    for _ in 0..ROUNDS {
        let p = cuda::device_alloc(0, 64 << 10).unwrap();
        let deleter = Box::new(move |p: u64| cuda::device_free(0, p).unwrap());
        let (h, s) = ipc.share(p, 64 << 10, 0, 0, Some(deleter)).unwrap();
        assert!(ipc.sent_free(s.unwrap()));
        handles.push(h);
    }
    assert_eq!(ipc.limbo_size(), ROUNDS);
    let (freed, scan) = timed(|| ipc.collect());
    assert_eq!(freed, 0);
    println!("| collect, {ROUNDS} blocks in limbo, none released (scan) | {:.1} | - | - |", scan.as_secs_f64() * 1e6);
    for h in &handles {
        cuda::release_ipc_counter(&h.ref_counter_handle, h.ref_counter_offset).unwrap();
    }
    let (freed, all) = timed(|| ipc.collect());
    assert_eq!(freed, ROUNDS);
    let floor = raw_free_floor();
    println!(
        "| collect, {ROUNDS} blocks in limbo, all released (event destroy + cuMemFree each) | {:.1} total, {:.2} per block | - | {floor:.2} per block |",
        all.as_secs_f64() * 1e6,
        all.as_secs_f64() * 1e6 / ROUNDS as f64
    );
}

/// cuMemGetAddressRange + cuIpcGetMemHandle + cuEventCreate/Record +
/// cuIpcGetEventHandle, then cuEventDestroy outside the timing.
fn raw_share_floor(ptr: u64) -> f64 {
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let mut ev = std::ptr::null_mut();
        let t = Instant::now();
        // SAFETY: plain driver calls on our allocation and event.
        unsafe {
            let (mut base, mut size) = (0, 0);
            ok(sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr), "range");
            let mut mh = sys::CUipcMemHandle { reserved: [0; 64] };
            ok(sys::cuIpcGetMemHandle(&mut mh, base), "mem handle");
            ok(sys::cuEventCreate(&mut ev, 1 | 2 | 4), "event");
            ok(sys::cuEventRecord(ev, std::ptr::null_mut()), "record");
            let mut eh = sys::CUipcEventHandle { reserved: [0; 64] };
            ok(sys::cuIpcGetEventHandle(&mut eh, ev), "event handle");
        }
        times.push(t.elapsed());
        // SAFETY: the event made above.
        unsafe { sys::cuEventDestroy_v2(ev) };
    }
    stats(times).0
}

/// 1000 events and 1000 separate 64 KiB allocations made first; then
/// cuEventDestroy + cuMemFree of each timed: the driver work of a collection.
fn raw_free_floor() -> f64 {
    let mut objects = Vec::new();
    for _ in 0..ROUNDS {
        let mut ev = std::ptr::null_mut();
        let mut p = 0;
        // SAFETY: plain driver calls on our own objects.
        unsafe {
            ok(sys::cuEventCreate(&mut ev, 1 | 2 | 4), "event");
            ok(sys::cuMemAlloc_v2(&mut p, 64 << 10), "alloc");
        }
        objects.push((ev, p));
    }
    let t = Instant::now();
    for (ev, p) in objects {
        // SAFETY: as above, each destroyed once.
        unsafe {
            ok(sys::cuEventDestroy_v2(ev), "destroy");
            ok(sys::cuMemFree_v2(p), "free");
        }
    }
    t.elapsed().as_secs_f64() * 1e6 / ROUNDS as f64
}

/// Opens every tuple on stdin, then releases them; prints table rows.
fn consumer() {
    cuda::check_available().unwrap();
    make_current();
    let ipc = cuda::global();
    let mut first = Vec::new();
    let mut cached = Vec::new();
    let mut held = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let (kind, text) = line.split_once(' ').unwrap();
        let h = IpcHandle::from_text(text).unwrap();
        let (r, d) = timed(|| ipc.open(&h, 0).unwrap());
        if kind == "first" {
            first.push(d)
        } else {
            cached.push(d)
        }
        held.push((kind == "first", r, h));
    }
    // Floor for a first open: the bare cuIpcOpenMemHandle + event wait.
    let mut raw = Vec::new();
    let mut frees = Vec::new();
    let mut raw_handles = Vec::new();
    for (is_first, r, h) in held {
        let (_, d) = timed(|| ipc.received_free(r).unwrap());
        frees.push(d);
        if is_first {
            raw_handles.push(h);
        }
    }
    for h in &raw_handles {
        let mut mh = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in mh.reserved.iter_mut().zip(&h.mem_handle[2..]) {
            *d = *s as libc::c_char;
        }
        let mut eh = sys::CUipcEventHandle { reserved: [0; 64] };
        for (d, s) in eh.reserved.iter_mut().zip(&h.event_handle) {
            *d = *s as libc::c_char;
        }
        let mut p = 0;
        let mut ev = std::ptr::null_mut();
        let t = Instant::now();
        // SAFETY: plain driver calls on handles of live allocations.
        unsafe {
            ok(sys::cuIpcOpenMemHandle_v2(&mut p, mh, 1), "open");
            ok(sys::cuIpcOpenEventHandle(&mut ev, eh), "open event");
            ok(sys::cuStreamWaitEvent(std::ptr::null_mut(), ev, 0), "wait");
        }
        raw.push(t.elapsed());
        // SAFETY: closing what was opened above.
        unsafe {
            sys::cuEventDestroy_v2(ev);
            sys::cuIpcCloseMemHandle(p);
        }
    }
    let floor = stats(raw).0;
    row("open, first of an allocation (cuIpcOpenMemHandle + event wait)", first, &format!("{floor:.1}"));
    row("open, allocation already mapped here (cache hit + event wait)", cached, "-");
    row("received_free (stream sync, unmap if last, atomic −1)", frees, "-");
}
