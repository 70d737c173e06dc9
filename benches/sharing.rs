//! Per-message latency of sending an already-shared storage to a child
//! process and getting its ack (by fd over SCM_RIGHTS, and by name through
//! the manager), next to a 1-byte pipe round trip measured in the same run
//! (the floor for any message-and-ack between two processes); and the cost
//! of opening a storage by name, manager registration included.
//!
//! Run: `cargo bench --bench sharing` (needs `cargo build --release --bins`
//! first for the manager). SS_BENCH_QUICK=1 runs fewer messages.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::Instant;
use storage_sharing::storage::{recv_fds, send_fds, Storage};

const ROLE: &str = "SS_BENCH_ROLE";

fn main() {
    if std::env::var(ROLE).is_ok() {
        return child();
    }
    if std::env::var_os("SS_SHM_MANAGER").is_none() {
        let exe = std::env::current_exe().unwrap();
        // target/release/deps/sharing-xxx -> target/release/ss_shm_manager
        let guess = exe.parent().and_then(|d| d.parent()).map(|d| d.join("ss_shm_manager"));
        if let Some(g) = guess.filter(|g| g.exists()) {
            std::env::set_var("SS_SHM_MANAGER", g);
        }
    }
    let quick = std::env::var_os("SS_BENCH_QUICK").is_some();
    let (small_n, big_n) = if quick { (300, 60) } else { (3000, 400) };

    // Every kind of message is interleaved one by one (pipe, 4 KiB by fd,
    // 4 KiB by name, now and then the 16 MiB ones), so each row sees the
    // same load and the same CPU idle states: the pipe row is the floor
    // for a message-and-ack under exactly these conditions.
    let mut kid = Kid::start();
    let small = Storage::new(4096).unwrap();
    let big = Storage::new(16 << 20).unwrap();
    for s in [&small, &big] {
        s.write_at(0, &[1]).unwrap();
        s.write_at(s.nbytes() - 1, &[2]).unwrap();
    }
    let small_named = Storage::from_bytes(&small.to_vec()).unwrap();
    small_named.share_filename().unwrap();
    let big_named = Storage::from_bytes(&big.to_vec()).unwrap();
    big_named.share_filename().unwrap();
    small.share_fd().unwrap();
    big.share_fd().unwrap();
    let names = [
        "1-byte pipe round trip",
        "4 KiB by fd (SCM_RIGHTS, map, ack)",
        "4 KiB by name (manager, map, ack)",
        "16 MiB by fd (SCM_RIGHTS, map, ack)",
        "16 MiB by name (manager, map, ack)",
    ];
    let mut kinds: Vec<(String, Vec<f64>)> = names.iter().map(|n| (n.to_string(), Vec::new())).collect();
    let every = (small_n / big_n).max(1);
    for i in 0..small_n + 20 {
        let keep = i >= 20; // warm-up
        let mut sample = |k: usize, f: &mut dyn FnMut(&mut Kid)| {
            let t = Instant::now();
            f(&mut kid);
            if keep {
                kinds[k].1.push(t.elapsed().as_secs_f64() * 1e6);
            }
        };
        sample(0, &mut |k| k.pipe_rtt());
        sample(1, &mut |k| k.by_fd(&small));
        sample(2, &mut |k| k.by_name(&small_named));
        if i % every == 0 {
            sample(3, &mut |k| k.by_fd(&big));
            sample(4, &mut |k| k.by_name(&big_named));
        }
    }
    kid.stop();
    let rows: Vec<(String, Stats)> = kinds.into_iter().map(|(n, v)| (n, stats(v))).collect();
    let pipe = rows[0].1.clone();
    let opens = stats(open_by_name(if quick { 300 } else { 3000 }));

    let torch_rows = torch_queue(if quick { 100 } else { 1000 }, if quick { 30 } else { 200 });

    let floor = pipe.median;
    println!(
        "\nstorage sharing latency ({} CPUs; median / p90 per message, µs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| {:<44} | {:>9} | {:>9} | {:>12} |", "what", "median", "p90", "x pipe RTT");
    println!("|{:-<46}|{:->11}|{:->11}|{:->14}|", "", "", "", "");
    for (what, st) in rows.iter().chain([("open by name + register + close, in-process".to_string(), opens)].iter()) {
        println!("| {:<44} | {:>9.1} | {:>9.1} | {:>12.2} |", what, st.median, st.p90, st.median / floor);
    }
    if let Some(rows) = torch_rows {
        let py_pipe = rows[0].1.median;
        println!("\nPyTorch in the same run (x = over the Python pipe round trip)");
        println!("| {:<44} | {:>9} | {:>9} | {:>12} |", "what", "median", "p90", "x py pipe");
        println!("|{:-<46}|{:->11}|{:->11}|{:->14}|", "", "", "", "");
        for (what, st) in &rows {
            println!("| {:<44} | {:>9.1} | {:>9.1} | {:>12.2} |", what, st.median, st.p90, st.median / py_pipe);
        }
    }
}

/// Runs benches/torch_queue.py with SS_TEST_PYTHON (else python3) when
/// torch imports there; None otherwise.
fn torch_queue(n_small: usize, n_big: usize) -> Option<Vec<(String, Stats)>> {
    let py = std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_queue.py");
    let out = Command::new(&py).args([script, &n_small.to_string(), &n_big.to_string()]).output().ok()?;
    if !out.status.success() {
        println!("(PyTorch rows skipped: {py} could not run {script}; torch not installed?)");
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let rows = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            Some((f.first()?.to_string(), Stats { median: f.get(1)?.parse().ok()?, p90: f.get(2)?.parse().ok()? }))
        })
        .collect::<Vec<_>>();
    (!rows.is_empty()).then_some(rows)
}

#[derive(Clone)]
struct Stats {
    median: f64,
    p90: f64,
}

fn stats(mut us: Vec<f64>) -> Stats {
    us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stats { median: us[us.len() / 2], p90: us[us.len() * 9 / 10] }
}

fn time_each(n: usize, mut f: impl FnMut()) -> Vec<f64> {
    for _ in 0..n / 10 + 1 {
        f(); // warm-up
    }
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f();
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    us
}

/// The child: socket on fd 3, pipe read end on fd 4, pipe write end on fd 5.
struct Kid {
    child: Child,
    sock: UnixStream,
    to_kid: std::fs::File,
    from_kid: std::fs::File,
}

impl Kid {
    fn start() -> Kid {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut p1 = [0; 2];
        let mut p2 = [0; 2];
        // SAFETY: pipe() fills the arrays.
        unsafe {
            assert_eq!(libc::pipe(p1.as_mut_ptr()), 0);
            assert_eq!(libc::pipe(p2.as_mut_ptr()), 0);
        }
        let (t, r_kid, w_kid) = (theirs.as_raw_fd(), p1[0], p2[1]);
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env(ROLE, "child");
        // SAFETY: only dup2 between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for (from, to) in [(t, 3), (r_kid, 4), (w_kid, 5)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        // SAFETY: we own these pipe ends; the child's copies are its own.
        unsafe {
            libc::close(p1[0]);
            libc::close(p2[1]);
            Kid { child, sock: ours, to_kid: std::fs::File::from_raw_fd(p1[1]), from_kid: std::fs::File::from_raw_fd(p2[0]) }
        }
    }

    fn ack(&mut self) {
        let mut b = [0u8; 1];
        self.sock.read_exact(&mut b).unwrap();
        assert_eq!(b[0], b'k');
    }

    fn pipe_rtt(&mut self) {
        self.to_kid.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        self.from_kid.read_exact(&mut b).unwrap();
    }

    fn by_fd(&mut self, s: &Storage) {
        let (fd, nbytes) = s.share_fd().unwrap();
        send_fds(self.sock.as_raw_fd(), format!("F{nbytes:<20}").as_bytes(), &[fd]).unwrap();
        self.ack();
    }

    fn by_name(&mut self, s: &Storage) {
        let h = s.share_filename().unwrap();
        s.shared_incref().unwrap();
        let msg = format!("N{:<255}", format!("{} {} {}", h.manager_handle, h.filename, h.nbytes));
        self.sock.write_all(msg.as_bytes()).unwrap();
        self.ack();
    }

    fn stop(mut self) {
        self.sock.write_all(b"Q").unwrap();
        self.child.wait().unwrap();
    }
}

fn touch(s: &Storage) -> u8 {
    let p = s.data();
    // SAFETY: the storage maps nbytes >= 1 bytes.
    unsafe { p.read_volatile() ^ p.add(s.nbytes() - 1).read_volatile() }
}

fn child() {
    // SAFETY: fds 3, 4, 5 were set up for us by the parent.
    let mut sock = unsafe { UnixStream::from_raw_fd(3) };
    let mut from_parent = unsafe { std::fs::File::from_raw_fd(4) };
    let mut to_parent = unsafe { std::fs::File::from_raw_fd(5) };
    let mut sink = 0u8;
    loop {
        let mut fds = [
            libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: from_parent.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            continue;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut b = [0u8; 1];
            from_parent.read_exact(&mut b).unwrap();
            to_parent.write_all(&b).unwrap();
            continue;
        }
        let mut buf = [0u8; 256];
        let (n, fds) = recv_fds(sock.as_raw_fd(), &mut buf[..1], 1).unwrap();
        if n == 0 {
            return;
        }
        match buf[0] {
            b'F' => {
                let mut len = [0u8; 20];
                sock.read_exact(&mut len).unwrap();
                let nbytes: usize = std::str::from_utf8(&len).unwrap().trim().parse().unwrap();
                let s = Storage::new_shared_fd(fds[0].as_raw_fd(), nbytes).unwrap();
                drop(fds);
                sink ^= touch(&s);
                drop(s);
                sock.write_all(b"k").unwrap();
            }
            b'N' => {
                let mut line = [0u8; 255];
                sock.read_exact(&mut line).unwrap();
                let text = String::from_utf8(line.to_vec()).unwrap();
                let p: Vec<&str> = text.trim().split(' ').collect();
                let s = Storage::new_shared_filename(p[0], p[1], p[2].parse().unwrap()).unwrap();
                s.shared_decref().unwrap();
                sink ^= touch(&s);
                drop(s);
                sock.write_all(b"k").unwrap();
            }
            _ => {
                std::hint::black_box(sink);
                return;
            }
        }
    }
}

/// Open by name (register with the manager, shm_open, mmap) and close
/// (count −1, munmap, free message), in this process.
fn open_by_name(n: usize) -> Vec<f64> {
    let s = Storage::new(4096).unwrap();
    let h = s.share_filename().unwrap();
    let open = time_each(n, || {
        let r = Storage::new_shared_filename(&h.manager_handle, &h.filename, h.nbytes).unwrap();
        std::hint::black_box(touch(&r));
    });
    drop(s);
    open
}
