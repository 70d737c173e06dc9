//! Helpers shared by the multi-process integration tests. Two ways to run
//! this test binary again as a child: `child_command` (an ignored
//! `child_role` test reads its job from the environment, output captured)
//! and `Peer::spawn` (a role that talks to the parent over a Unix socket).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::Output;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ROLE_VAR: &str = "SS_TEST_CHILD_ROLE";

/// A command that runs this test binary's `child_role` entry with `role`.
pub fn child_command(role: &str, args: &[&str]) -> Command {
    child_command_of(&std::env::current_exe().unwrap(), role, args)
}

/// [`child_command`] through `exe`, a copy of this test binary.
pub fn child_command_of(exe: &std::path::Path, role: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["--ignored", "--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env(ROLE_VAR, role)
        .env("SS_TEST_CHILD_ARGS", args.join("\u{1f}"));
    cmd
}

/// The role and arguments of this process, if it is a child.
pub fn my_role() -> Option<(String, Vec<String>)> {
    let role = std::env::var(ROLE_VAR).ok()?;
    let args = std::env::var("SS_TEST_CHILD_ARGS").unwrap_or_default();
    let args = if args.is_empty() { Vec::new() } else { args.split('\u{1f}').map(str::to_string).collect() };
    Some((role, args))
}

/// Runs a child and panics with its output unless it succeeded.
pub fn run_ok(mut cmd: Command) -> Output {
    let out = cmd.output().expect("spawn child");
    assert!(
        out.status.success(),
        "child failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn shm_exists(name: &str) -> bool {
    std::fs::symlink_metadata(format!("/dev/shm{name}")).is_ok()
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The Python that interop tests use: $SS_TEST_PYTHON, else python3.
pub fn python() -> String {
    std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Whether that Python can import torch. Where it cannot, a test prints
/// its skip line and returns, except under CI (`CI` set), where PyTorch is
/// part of the test command and its absence fails the test. Each test that
/// goes on is recorded in `$SS_TORCH_TESTS_LOG`, so the test command can
/// say how many interop tests really ran.
pub fn torch_available(test: &str) -> bool {
    let ok = Command::new(python()).args(["-c", "import torch"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !ok {
        assert!(!running_in_ci(), "{test}: PyTorch is required under CI but `{} -c 'import torch'` failed (set SS_TEST_PYTHON)", python());
        println!("{test}: skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)");
        return false;
    }
    record_torch_test(test);
    true
}

/// Whether the `CI` variable asks for the strict mode (set, not "0"/"false").
pub fn running_in_ci() -> bool {
    std::env::var("CI").map(|v| !v.is_empty() && v != "0" && v != "false").unwrap_or(false)
}

/// Appends `test` to `$SS_TORCH_TESTS_LOG` (one line each; O_APPEND keeps
/// lines from parallel test threads and binaries whole).
fn record_torch_test(test: &str) {
    let Ok(log) = std::env::var("SS_TORCH_TESTS_LOG") else { return };
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&log).expect("open SS_TORCH_TESTS_LOG");
    file.write_all(format!("{test}\n").as_bytes()).expect("write SS_TORCH_TESTS_LOG");
}

pub const ROLE_ENV: &str = "SS_TEST_ROLE";
pub const SOCK_ENV: &str = "SS_TEST_SOCK";
pub const ARG_ENV: &str = "SS_TEST_ARG";

/// Points the library at the daemon cargo built for these tests.
pub fn use_built_manager() {
    std::env::set_var("SS_SHM_MANAGER", env!("CARGO_BIN_EXE_ss_shm_manager"));
}

pub fn manager_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ss_shm_manager"))
}

/// The descriptors of this process that are inotify instances.
pub fn inotify_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:inotify"))
        .count()
}

/// `count` threads, each waiting in `get` for the key `{prefix}/{i}`, all
/// started (with a little slack to reach their wait) when this returns.
pub fn start_store_waiters<S: storage_sharing::store::Store + 'static>(
    store: &std::sync::Arc<S>,
    prefix: &str,
    count: usize,
    timeout: Duration,
) -> Vec<std::thread::JoinHandle<storage_sharing::Result<Vec<u8>>>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let entered = std::sync::Arc::new(AtomicUsize::new(0));
    let threads = (0..count)
        .map(|i| {
            let (store, entered, key) = (store.clone(), entered.clone(), format!("{prefix}/{i}"));
            std::thread::spawn(move || {
                entered.fetch_add(1, Ordering::SeqCst);
                store.get(key.as_bytes(), Some(timeout))
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(30), || entered.load(Ordering::SeqCst) == count));
    // Slack for the last threads to reach their wait (not a timing assertion).
    std::thread::sleep(Duration::from_millis(300));
    threads
}

/// Polls `cond` every 20 ms for up to `limit`; true once it held.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process of this test binary in `role`, connected back to us.
pub struct Peer {
    pub child: Child,
    pub stream: UnixStream,
    reader: BufReader<UnixStream>,
    dir: PathBuf,
}

fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ss-test-{}-{tag}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl Peer {
    /// Starts `role` in a child (the test fn `entry` of this binary must
    /// call [`child_main`]) with `arg`, and accepts its connection.
    pub fn spawn(entry: &str, role: &str, arg: &str) -> Peer {
        let dir = temp_dir(role);
        let sock = dir.join("s");
        let listener = UnixListener::bind(&sock).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", entry, "--nocapture", "--test-threads=1", "-q"])
            .env(ROLE_ENV, role)
            .env(SOCK_ENV, &sock)
            .env(ARG_ENV, arg)
            .env("SS_SHM_MANAGER", env!("CARGO_BIN_EXE_ss_shm_manager"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        listener.set_nonblocking(true).unwrap();
        let end = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < end => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("child {role} never connected: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        Peer { child, stream, reader, dir }
    }

    pub fn send(&mut self, line: &str) {
        self.stream.write_all(format!("{line}\n").as_bytes()).unwrap();
    }

    pub fn recv(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        assert!(line.ends_with('\n'), "child closed the connection early (got {line:?})");
        line.trim_end().to_string()
    }

    /// Kills the child with SIGKILL and reaps it.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for the child to exit and asserts success.
    pub fn finish(mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child failed: {status}");
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The child's side: its connection to the parent and its argument.
pub struct Parent {
    pub stream: UnixStream,
    reader: BufReader<UnixStream>,
    pub arg: String,
}

impl Parent {
    pub fn send(&mut self, line: &str) {
        self.stream.write_all(format!("{line}\n").as_bytes()).unwrap();
    }

    pub fn recv(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        line.trim_end().to_string()
    }

    /// Blocks until the parent closes the connection (or kills us).
    pub fn wait_for_close(&mut self) {
        let mut sink = Vec::new();
        let _ = self.reader.read_to_end(&mut sink);
    }
}

/// If this process is a child started by [`Peer::spawn`], runs its role
/// with `run` and exits; otherwise returns at once.
pub fn child_main(run: impl FnOnce(&str, Parent)) {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    let sock = std::env::var(SOCK_ENV).unwrap();
    let stream = UnixStream::connect(sock).unwrap();
    let reader = BufReader::new(stream.try_clone().unwrap());
    let arg = std::env::var(ARG_ENV).unwrap_or_default();
    run(&role, Parent { stream, reader, arg });
    std::process::exit(0);
}
