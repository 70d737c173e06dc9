//! The shareable CPU arena beside `ss_map_new_copy` and PyTorch, printed
//! as tables:
//!  1. making a 4 KiB, 1 MiB, 256 MiB and 1 GiB tensor shareable;
//!  2. sending 100,000 tensors of 4-64 KiB to another process with
//!     RLIMIT_NOFILE at 256 (peak fds and mappings of both processes);
//!  3. peak RSS + shm while sharing an 8 GiB tensor with a reader.
//!
//! Run: cargo bench --bench arena [-- --count N --torch-count M --big-gib G --no-big --only-big]
//! PyTorch's columns come from benches/arena_torch.py run by
//! $SS_TEST_PYTHON (else python3) and are skipped when torch does not import.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use storage_sharing::arena::transport::{recv_block, send_block};
use storage_sharing::arena::{Arena, ArenaOptions, Strategy};
use storage_sharing::shm::share_memory;
use storage_sharing::storage::{recv_fds, send_fds};

const ROLE: &str = "SS_BENCH_ROLE";
const SOCK: &str = "SS_BENCH_SOCK";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn human(secs: f64) -> String {
    if secs < 1e-6 {
        format!("{:.0} ns", secs * 1e9)
    } else if secs < 1e-3 {
        format!("{:.1} us", secs * 1e6)
    } else if secs < 1.0 {
        format!("{:.2} ms", secs * 1e3)
    } else {
        format!("{secs:.2} s")
    }
}

fn size_name(len: usize) -> String {
    match len {
        l if l >= 1 << 30 => format!("{} GiB", l >> 30),
        l if l >= 1 << 20 => format!("{} MiB", l >> 20),
        l => format!("{} KiB", l >> 10),
    }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn python() -> Option<String> {
    let py = std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py).args(["-c", "import torch"]).output().ok()?.status.success();
    ok.then_some(py)
}

fn torch_script() -> String {
    format!("{}/benches/arena_torch.py", env!("CARGO_MANIFEST_DIR"))
}

fn run_torch(py: &str, args: &[String]) -> Option<String> {
    let out = Command::new(py).arg(torch_script()).args(args).output().ok()?;
    if !out.status.success() {
        eprintln!("PyTorch run {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn count_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0)
}

fn set_nofile(n: u64) {
    // SAFETY: plain data for setrlimit.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: r is valid.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    r.rlim_cur = n.min(r.rlim_max);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
}

fn status_kib(pid: u32, field: &str) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
        * 1024
}

fn meminfo(field: &str) -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
        * 1024
}

/// A child of this bench in `role`, connected over a Unix socket.
fn spawn(role: &str, arg: &str) -> (std::process::Child, UnixStream) {
    let path = std::env::temp_dir().join(format!("ss-arena-bench-{}-{role}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .env(SOCK, &path)
        .env("SS_BENCH_ARG", arg)
        .stdout(Stdio::inherit())
        .spawn()
        .unwrap();
    let (s, _) = l.accept().unwrap();
    let _ = std::fs::remove_file(&path);
    (child, s)
}

fn child(role: &str) {
    let s = UnixStream::connect(std::env::var(SOCK).unwrap()).unwrap();
    let arg: usize = std::env::var("SS_BENCH_ARG").unwrap().parse().unwrap();
    let mut out = s.try_clone().unwrap();
    match role {
        "stream" => {
            set_nofile(256);
            let (mut got, mut bad, mut pf, mut pm) = (0usize, 0usize, 0, 0);
            for i in 0..arg {
                let v = recv_block(s.as_raw_fd()).unwrap();
                // SAFETY: the view holds at least 16 bytes.
                let head = unsafe { std::slice::from_raw_parts(v.data(), 16) };
                let idx = u64::from_le_bytes(head[..8].try_into().unwrap()) as usize;
                let len = u64::from_le_bytes(head[8..].try_into().unwrap()) as usize;
                // SAFETY: len <= view size (checked below before reading the last byte).
                if idx == i && len <= v.size() && unsafe { *v.data().add(len - 1) } == idx as u8 {
                    got += 1;
                } else {
                    bad += 1;
                }
                drop(v);
                if i % 1000 == 0 {
                    pf = pf.max(count_fds());
                    pm = pm.max(count_maps());
                }
            }
            writeln!(out, "{got} {bad} {pf} {pm}").unwrap();
        }
        "big-arena" => {
            let v = recv_block(s.as_raw_fd()).unwrap();
            // SAFETY: the view's bytes.
            let b = unsafe { std::slice::from_raw_parts(v.data(), arg) };
            let sum: u64 = b.chunks(1 << 20).map(|c| c.iter().map(|x| *x as u64).sum::<u64>()).sum();
            writeln!(out, "{sum}").unwrap();
        }
        "big-fd" => {
            let mut buf = [0u8; 8];
            let (_, fds) = recv_fds(s.as_raw_fd(), &mut buf, 1).unwrap();
            let st = storage_sharing::storage::Storage::new_shared_fd(fds[0].as_raw_fd(), arg).unwrap();
            // SAFETY: the storage maps arg bytes.
            let b = unsafe { std::slice::from_raw_parts(st.data(), arg) };
            let sum: u64 = b.chunks(1 << 20).map(|c| c.iter().map(|x| *x as u64).sum::<u64>()).sum();
            writeln!(out, "{sum}").unwrap();
        }
        other => panic!("unknown role {other}"),
    }
}

fn section_share(torch: Option<&str>) {
    let sizes = [4usize << 10, 1 << 20, 256 << 20, 1 << 30];
    let pt: Vec<Option<f64>> = match torch.and_then(|py| {
        run_torch(
            py,
            &sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().iter().fold(vec!["share".to_string()], |mut v, s| {
                v.push(s.clone());
                v
            }),
        )
    }) {
        Some(text) => {
            let m: std::collections::HashMap<usize, f64> =
                text.lines().filter_map(|l| l.split_once('\t')).filter_map(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?))).collect();
            sizes.iter().map(|s| m.get(s).copied()).collect()
        }
        None => vec![None; sizes.len()],
    };
    println!("\n## Making a CPU tensor shareable (median)\n");
    println!("| size | arena share | arena alloc (birth, pages reserved) | ss_map_new_copy (copy) | PyTorch share_memory_() | share_memory / arena | PyTorch / arena |");
    println!("|---|---|---|---|---|---|---|");
    let arena = Arena::new(ArenaOptions::default()).unwrap();
    for (i, &n) in sizes.iter().enumerate() {
        let reps_alloc = if n <= 1 << 20 { 50 } else { 3 };
        let alloc = median(
            (0..reps_alloc)
                .map(|_| {
                    let t = Instant::now();
                    let p = arena.alloc(n, 64).unwrap();
                    let s = t.elapsed().as_secs_f64();
                    arena.free(p).unwrap();
                    s
                })
                .collect(),
        );
        let p = arena.alloc(n, 64).unwrap();
        // SAFETY: n bytes of a live block.
        unsafe { std::ptr::write_bytes(p, 1, n) };
        let share = median(
            (0..1000)
                .map(|_| {
                    let t = Instant::now();
                    let h = arena.share(p).unwrap();
                    let s = t.elapsed().as_secs_f64();
                    arena.unshare(&h).unwrap();
                    s
                })
                .collect(),
        );
        arena.free(p).unwrap();
        let src = vec![1u8; n];
        let reps = if n <= 1 << 20 { 50 } else { 3 };
        let ssm = median(
            (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    let m = share_memory(&src).unwrap();
                    let s = t.elapsed().as_secs_f64();
                    drop(m);
                    s
                })
                .collect(),
        );
        drop(src);
        let (pt_s, pt_r) = match pt[i] {
            Some(v) => (human(v), format!("{:.0}x", v / share)),
            None => ("skipped".into(), "-".into()),
        };
        println!("| {} | {} | {} | {} | {} | {:.0}x | {} |", size_name(n), human(share), human(alloc), human(ssm), pt_s, ssm / share, pt_r);
    }
    println!("\nThe arena's tensor is born in shared memory: sharing it writes one hold slot (no copy, no syscall), so its time does not grow with the size. Its birth (alloc) reserves the pages (posix_fallocate) as any first touch must; ss_map_new_copy and share_memory_() copy an existing heap tensor into a new segment. PyTorch: torch.set_num_threads(2), same run.");
}

fn floor_messages(n: usize) -> f64 {
    let (a, b) = UnixStream::pair().unwrap();
    let t = Instant::now();
    let r = std::thread::spawn(move || {
        let mut b = b;
        let mut buf = [0u8; 113];
        for _ in 0..n {
            b.read_exact(&mut buf).unwrap();
        }
    });
    let mut a = a;
    let msg = [7u8; 113];
    for _ in 0..n {
        a.write_all(&msg).unwrap();
    }
    r.join().unwrap();
    t.elapsed().as_secs_f64()
}

fn section_stream(n: usize, torch: Option<&str>, torch_n: usize) {
    println!("\n## Sending {n} tensors of 4-64 KiB to another process, RLIMIT_NOFILE 256 in both\n");
    println!("| way | tensors | arrived | time | tensors/s | producer peak fds / maps | consumer peak fds / maps |");
    println!("|---|---|---|---|---|---|---|");
    set_nofile(256);
    for strategy in [Strategy::Fd, Strategy::Name] {
        let (mut child, s) = spawn("stream", &n.to_string());
        let arena = Arena::new(ArenaOptions { strategy, ..ArenaOptions::default() }).unwrap();
        let mut rng = 0x9E3779B97F4A7C15u64;
        let (mut pf, mut pm) = (0, 0);
        let t = Instant::now();
        for i in 0..n {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = 4096 + (rng % (60 << 10)) as usize;
            let p = arena.alloc(len, 64).unwrap();
            // SAFETY: len bytes of a live block.
            unsafe {
                std::ptr::copy_nonoverlapping((i as u64).to_le_bytes().as_ptr(), p, 8);
                std::ptr::copy_nonoverlapping((len as u64).to_le_bytes().as_ptr(), p.add(8), 8);
                *p.add(len - 1) = i as u8;
            }
            send_block(&arena, s.as_raw_fd(), p).unwrap();
            arena.free(p).unwrap();
            if i % 1000 == 0 {
                pf = pf.max(count_fds());
                pm = pm.max(count_maps());
            }
        }
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line).unwrap();
        let secs = t.elapsed().as_secs_f64();
        child.wait().unwrap();
        let f: Vec<usize> = line.split_whitespace().map(|x| x.parse().unwrap()).collect();
        let way = if strategy == Strategy::Fd { "arena by fd" } else { "arena by name" };
        println!(
            "| {way} | {n} | {} ({} bad) | {} | {:.0} | {pf} / {pm} | {} / {} |",
            f[0],
            f[1],
            human(secs),
            n as f64 / secs,
            f[2],
            f[3]
        );
        println!("|  (segments used: {}) | | | | | | |", arena.stats().unwrap().segments);
    }
    let floor = floor_messages(n);
    println!(
        "| floor: the same {n} 113-byte messages over a socket pair, no blocks | {n} | {n} | {} | {:.0} | - | - |",
        human(floor),
        n as f64 / floor
    );
    match torch.and_then(|py| run_torch(py, &["stream".into(), torch_n.to_string()])) {
        Some(text) => {
            let f: Vec<&str> = text.trim().splitn(8, '\t').collect();
            let secs: f64 = f[2].parse().unwrap_or(f64::NAN);
            println!(
                "| PyTorch Queue, file_descriptor strategy | {torch_n} | {} ({} receive errors) | {} | {:.0} | {} / {} | {} / {} |",
                f[0],
                f[1],
                human(secs),
                torch_n as f64 / secs,
                f[3],
                f[4],
                f[5],
                f[6]
            );
            if f.len() > 7 && !f[7].is_empty() {
                println!("\nPyTorch's first error: {}", f[7]);
            }
        }
        None => println!("| PyTorch Queue, file_descriptor strategy | skipped (torch not importable) | | | | | |"),
    }
    println!("\nEach arena message is the 113-byte handle; the segment's fd goes with the first message that uses it (by fd). The consumer opens a view (one hold), checks the block's first and last bytes and releases it; the producer frees each block right after sending and reuses it once released.");
}

/// Peak of (producer anon RSS + child anon RSS + /dev/shm growth) while
/// `run` shares and the child reads.
fn peak_while(child_pid: impl Fn() -> u32 + Send + 'static, run: impl FnOnce()) -> usize {
    let base = meminfo("Shmem:");
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let me = std::process::id();
    let th = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let v = status_kib(me, "RssAnon:") + status_kib(child_pid(), "RssAnon:") + meminfo("Shmem:").saturating_sub(base);
                peak.fetch_max(v, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        })
    };
    run();
    stop.store(true, Ordering::Relaxed);
    th.join().unwrap();
    peak.load(Ordering::Relaxed)
}

fn section_big(want_gib: usize, torch: Option<&str>) {
    let avail = meminfo("MemAvailable:");
    // The copying ways need twice the tensor; leave 10 % spare.
    let mut gib = want_gib;
    while gib > 1 && (gib << 30) * 22 / 10 > avail {
        gib -= 1;
    }
    let n = gib << 30;
    println!("\n## Peak memory while sharing a {gib} GiB tensor with a reader process\n");
    if gib != want_gib {
        println!("({want_gib} GiB does not fit twice in the {} GiB available now: measured at {gib} GiB)\n", avail >> 30);
    }
    println!("| way | peak anon RSS (both) + shm growth | / tensor size |");
    println!("|---|---|---|");
    let gb = |b: usize| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    {
        let (mut child, s) = spawn("big-arena", &n.to_string());
        let pid = child.id();
        let arena = Arena::new(ArenaOptions::default()).unwrap();
        let peak = peak_while(
            move || pid,
            || {
                let p = arena.alloc(n, 4096).unwrap();
                // SAFETY: n bytes of a live block.
                unsafe { std::ptr::write_bytes(p, 1, n) };
                send_block(&arena, s.as_raw_fd(), p).unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                assert_eq!(line.trim().parse::<usize>().unwrap(), n);
                child.wait().unwrap();
                arena.free(p).unwrap();
            },
        );
        println!("| arena (born shared, shared by handle) | {} | {:.3} |", gb(peak), peak as f64 / n as f64);
    }
    {
        let (mut child, s) = spawn("big-fd", &n.to_string());
        let pid = child.id();
        let peak = peak_while(
            move || pid,
            || {
                let src = vec![1u8; n];
                let m = share_memory(&src).unwrap();
                drop(src);
                send_fds(s.as_raw_fd(), b"f", &[m.fd()]).unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                assert_eq!(line.trim().parse::<usize>().unwrap(), n);
                child.wait().unwrap();
            },
        );
        println!("| heap tensor + ss_map_new_copy (copy) | {} | {:.3} |", gb(peak), peak as f64 / n as f64);
    }
    match torch.and_then(|py| run_torch(py, &["big".into(), gib.to_string()])) {
        Some(text) => {
            let peak: usize = text.trim().parse().unwrap_or(0);
            println!("| PyTorch share_memory_() + Queue to a reader | {} | {:.3} |", gb(peak), peak as f64 / n as f64);
        }
        None if torch.is_some() => println!("| PyTorch share_memory_() | failed (see stderr) | - |"),
        None => println!("| PyTorch share_memory_() | skipped (torch not importable) | - |"),
    }
    println!("\nSampled every 5 ms: anonymous RSS of the producer and the reader plus the growth of Shmem in /proc/meminfo (shared pages counted once).");
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        child(&role);
        return;
    }
    let torch = python();
    if torch.is_none() {
        println!("PyTorch columns skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)");
    }
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--only-big") {
        section_share(torch.as_deref());
        section_stream(arg("--count", 100_000), torch.as_deref(), arg("--torch-count", 10_000));
    }
    if !args.iter().any(|a| a == "--no-big") {
        section_big(arg("--big-gib", 8), torch.as_deref());
    }
}
