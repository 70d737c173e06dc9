//! share_memory and open costs, printed as tables beside the physical
//! floors: memcpy into warm memory, and the plainest create + fault + copy.
//! Run: cargo bench --bench share_memory [-- --max-mib N] [--torch]
//! With --torch (and SS_TEST_PYTHON or python3 importing torch) PyTorch's
//! share_memory_() and open-by-name are measured in the same run.

use std::ffi::CString;
use std::process::Command;
use std::time::Instant;
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, OPEN_SHARED_FD, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, share_memory, MapAllocator, RefcountedMapAllocator};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds of `reps` runs of `f`; what `f` returns is dropped
/// after the clock stops, so tear-down is not counted (as for PyTorch).
fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    drop(f()); // warm-up
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                let kept = f();
                let secs = t.elapsed().as_secs_f64();
                drop(kept);
                secs
            })
            .collect(),
    )
}

/// A mapped segment made by one of the plain ways; unmapped on drop.
struct Plain {
    p: *mut libc::c_void,
    len: usize,
    fd: i32,
}

impl Drop for Plain {
    fn drop(&mut self) {
        // SAFETY: exactly what mmap and shm_open returned.
        unsafe {
            libc::munmap(self.p, self.len);
            libc::close(self.fd);
        }
    }
}

fn reps_for(len: usize) -> usize {
    match len {
        l if l <= 1 << 20 => 200,
        l if l <= 16 << 20 => 20,
        _ => 3,
    }
}

fn human(secs: f64) -> String {
    if secs < 1e-3 {
        format!("{:.1} us", secs * 1e6)
    } else if secs < 1.0 {
        format!("{:.2} ms", secs * 1e3)
    } else {
        format!("{secs:.3} s")
    }
}

fn size_name(len: usize) -> String {
    if len >= 1 << 30 {
        format!("{} GiB", len >> 30)
    } else if len >= 1 << 20 {
        format!("{} MiB", len >> 20)
    } else {
        format!("{} KiB", len >> 10)
    }
}

/// The plainest way: shm_open, ftruncate, mmap, memcpy (first-touch faults),
/// then tear down. `populate` adds MAP_POPULATE, `falloc` a posix_fallocate.
fn plain_share(src: &[u8], populate: bool, falloc: bool) -> Plain {
    let name = CString::new(new_process_wide_shm_handle()).unwrap();
    // SAFETY: plain syscalls on a fresh object of our own.
    unsafe {
        let fd = libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
        assert!(fd >= 0);
        libc::shm_unlink(name.as_ptr());
        assert_eq!(libc::ftruncate(fd, src.len() as libc::off_t), 0);
        if falloc {
            assert_eq!(libc::posix_fallocate(fd, 0, src.len() as libc::off_t), 0);
        }
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        let p = libc::mmap(std::ptr::null_mut(), src.len(), libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0);
        assert_ne!(p, libc::MAP_FAILED);
        std::ptr::copy_nonoverlapping(src.as_ptr(), p.cast(), src.len());
        Plain { p, len: src.len(), fd }
    }
}

/// Copy with pwrite(2) into the empty object, then map: tmpfs allocates
/// each page and fills it from the source in one pass, with no zeroing and
/// no page faults.
fn pwrite_share(src: &[u8]) -> Plain {
    let name = CString::new(new_process_wide_shm_handle()).unwrap();
    // SAFETY: plain syscalls on a fresh object of our own.
    unsafe {
        let fd = libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
        assert!(fd >= 0);
        libc::shm_unlink(name.as_ptr());
        let mut done = 0;
        while done < src.len() {
            let n = libc::pwrite(fd, src.as_ptr().add(done).cast(), src.len() - done, done as libc::off_t);
            assert!(n > 0);
            done += n as usize;
        }
        let p = libc::mmap(std::ptr::null_mut(), src.len(), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        assert_ne!(p, libc::MAP_FAILED);
        Plain { p, len: src.len(), fd }
    }
}

fn torch_python() -> Option<String> {
    let py = std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py).args(["-c", "import torch"]).output().ok()?.status.success();
    ok.then_some(py)
}

/// PyTorch's share_memory_() median seconds per size, and open-by-name.
fn torch_figures(py: &str, sizes: &[usize]) -> Option<(Vec<f64>, f64)> {
    let script = format!(
        r#"
import time, torch, statistics
torch.set_num_threads(2)
def med(f, reps):
    f(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
sizes = {sizes:?}
for n in sizes:
    reps = 200 if n <= 1 << 20 else (20 if n <= 16 << 20 else 3)
    ts = []
    for r in range(reps + 1):
        t0 = torch.ones(n, dtype=torch.uint8)
        t = time.perf_counter(); t0.share_memory_(); d = time.perf_counter() - t
        del t0
        if r: ts.append(d)
    print(statistics.median(ts))
torch.multiprocessing.set_sharing_strategy("file_system")
s = torch.UntypedStorage(4096)
mgr, name, size = s._share_filename_cpu_()
print(med(lambda: torch.UntypedStorage._new_shared_filename_cpu(mgr, name, size), 500))
"#
    );
    let out = Command::new(py).args(["-c", &script]).output().ok()?;
    if !out.status.success() {
        eprintln!("torch figures failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    let vals: Vec<f64> = String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect();
    let (open, shares) = vals.split_last()?;
    Some((shares.to_vec(), *open))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let max_mib: usize = args.iter().position(|a| a == "--max-mib").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(1024);
    let sizes: Vec<usize> =
        [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30].into_iter().filter(|s| *s <= max_mib << 20 || *s < 1 << 20).collect();
    let torch = if args.iter().any(|a| a == "--torch") { torch_python().and_then(|py| torch_figures(&py, &sizes)) } else { None };

    println!("## share_memory (median; {} cores)\n", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    println!("| size | ss_map_new_copy | memcpy (warm) | floor: shm_open+ftruncate+mmap+copy | MAP_POPULATE+copy | fallocate+copy | pwrite+mmap | ours / floor | PyTorch share_memory_() | PyTorch / ours |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (i, &len) in sizes.iter().enumerate() {
        let src = vec![1u8; len];
        let mut dst = vec![0u8; len];
        let reps = reps_for(len);
        let memcpy = time(reps, || dst.copy_from_slice(&src));
        drop(dst);
        let ours = time(reps, || share_memory(&src).unwrap());
        let floor = time(reps, || plain_share(&src, false, false));
        let mpop = time(reps, || plain_share(&src, true, false));
        let falloc = time(reps, || plain_share(&src, false, true));
        let pwrite = time(reps, || pwrite_share(&src));
        let (pt, ratio) = match &torch {
            Some((t, _)) => (human(t[i]), format!("{:.2}x", t[i] / ours)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {pt} | {ratio} |",
            size_name(len),
            human(ours),
            human(memcpy),
            human(floor),
            human(mpop),
            human(falloc),
            human(pwrite),
            ours / floor
        );
    }
    println!("\nTimes exclude tear-down (unmap, free). memcpy (warm) copies into memory already faulted in: the bandwidth limit. The floor is the plainest create + first-touch copy. PyTorch's figure is `share_memory_()` of a fresh CPU tensor, torch.set_num_threads(2), same run.\n");

    println!("## opening an existing segment (median of 2000)\n");
    println!("| open | ours | bare syscalls | ours / bare | PyTorch |");
    println!("|---|---|---|---|---|");
    let name = new_process_wide_shm_handle();
    let creator = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    let c_name = CString::new(name.clone()).unwrap();
    let bare_by_name = time(2000, || unsafe {
        // SAFETY: plain syscalls on an existing object.
        let fd = libc::shm_open(c_name.as_ptr(), libc::O_RDWR, 0);
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st);
        let p = libc::mmap(std::ptr::null_mut(), st.st_size as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        libc::close(fd);
        libc::munmap(p, st.st_size as usize);
    });
    let bare_touch = time(2000, || unsafe {
        // SAFETY: as above, plus the atomic +1/-1 on the header a refcounted
        // open must do (its first touch of the page is a minor fault).
        let fd = libc::shm_open(c_name.as_ptr(), libc::O_RDWR, 0);
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st);
        let p = libc::mmap(std::ptr::null_mut(), st.st_size as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        libc::close(fd);
        let count = &*(p as *const std::sync::atomic::AtomicI32);
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        libc::munmap(p, st.st_size as usize);
    });
    let by_name = time(2000, || drop(RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 4096).unwrap()));
    let pt_open = torch.as_ref().map_or("-".to_string(), |(_, o)| human(*o));
    println!(
        "| by name (refcounted, count +1/-1) | {} | {} | {:.2} | {pt_open} (with manager registration) |",
        human(by_name),
        human(bare_by_name),
        by_name / bare_by_name
    );
    println!(
        "| by name, vs bare + the header's atomic +1/-1 | {} | {} | {:.2} | - |",
        human(by_name),
        human(bare_touch),
        by_name / bare_touch
    );
    drop(creator);
    let shared = share_memory(&[1u8; 4096]).unwrap();
    let fd = shared.fd();
    let bare_fd = time(2000, || unsafe {
        // SAFETY: plain syscalls on our own descriptor.
        let d = libc::dup(fd);
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(d, &mut st);
        let p = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, d, 0);
        libc::munmap(p, 4096);
        libc::close(d);
    });
    let by_fd = time(2000, || {
        // SAFETY: dup of our own descriptor, owned by the map on success.
        let d = unsafe { libc::dup(fd) };
        drop(MapAllocator::open_fd("", d, OPEN_SHARED_FD, 4096).unwrap());
    });
    println!("| by fd (dup, flags 58) | {} | {} | {:.2} | - |", human(by_fd), human(bare_fd), by_fd / bare_fd);
}
