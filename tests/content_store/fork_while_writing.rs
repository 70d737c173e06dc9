//! fork() while other threads write a content store: every child can
//! still hash and write (no pool thread or lock it waits for is missing).

#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::content_store::{hash_hex, Dtype, Format, HashMode, Writer};

const FORKS: usize = 40;
/// Hang guard per child; a healthy one exits in well under a second.
const CHILD_LIMIT: Duration = Duration::from_secs(30);

/// Child work: hashes a buffer big enough for the parallel path, writes
/// through the parent's writer and through a new one, then `_exit`s.
fn child(shared: &Writer, root: &std::path::Path, i: usize) -> ! {
    let data = common::pattern(9 << 20, (i % 4) as u8);
    let ok = (|| {
        let h = hash_hex(&data, HashMode::Fast);
        let w = Writer::open(root, Format::Native).ok()?;
        w.set_durable(false);
        let h2 = w.write_tensor(&format!("child/{i}"), &data, Dtype::UInt8, 0, &[data.len() as i64], &[1]).ok()?;
        let h3 = shared.write_storage(&data).ok()?;
        (h == h2 && h2 == h3).then_some(())
    })();
    // SAFETY: _exit runs nothing of the parent's (no atexit, no unwinding).
    unsafe { libc::_exit(if ok.is_some() { 0 } else { 3 }) }
}

struct Cleanup(PathBuf);
impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits for `pid` up to `limit`; kills it if it is still running.
fn wait_or_kill(pid: libc::pid_t, limit: Duration) -> Result<i32, String> {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return if libc::WIFEXITED(status) {
                Ok(libc::WEXITSTATUS(status))
            } else {
                Err(format!("child {pid} died: status {status:#x}"))
            };
        }
        if start.elapsed() > limit {
            // SAFETY: signals and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Err(format!("child {pid} hung for {limit:?} and was killed"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn children_forked_while_threads_write_a_store_all_finish() {
    let root: PathBuf = std::env::temp_dir().join(format!("ss-cs-fork-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let _cleanup = Cleanup(root.clone());
    let writer = Arc::new(Writer::open(&root, Format::Native).unwrap());
    writer.set_durable(false);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..3u8)
        .map(|t| {
            let (w, stop) = (writer.clone(), stop.clone());
            std::thread::spawn(move || {
                // A few contents, written over and over: after the first
                // round only hashing and entries (the disk stays small).
                // Big buffers hash on the pool; small ones keep the locks busy.
                let contents: Vec<Vec<u8>> =
                    (0..4u8).map(|k| common::pattern(if k % 2 == 0 { 5 << 20 } else { 100 }, t * 16 + k)).collect();
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let data = &contents[n % contents.len()];
                    w.write_tensor(&format!("t{t}/{}", n % 16), data, Dtype::UInt8, 0, &[data.len() as i64], &[1]).unwrap();
                    n += 1;
                }
            })
        })
        .collect();
    // Let the writers get going, so the pool is running when we fork.
    std::thread::sleep(Duration::from_millis(200));
    let mut failures = Vec::new();
    for i in 0..FORKS {
        // SAFETY: the child only hashes, writes files and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            child(&writer, &root, i);
        }
        match wait_or_kill(pid, CHILD_LIMIT) {
            Ok(0) => {}
            Ok(code) => failures.push(format!("child {i} exited {code}")),
            Err(e) => {
                // One hang fails the test; waiting out the others adds nothing.
                failures.push(format!("child {i}: {e}"));
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(failures.is_empty(), "{} of {FORKS} children failed: {failures:?}", failures.len());
}

fn pipe() -> (i32, i32) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-int array we pass.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    (fds[0], fds[1])
}

fn send_byte(fd: i32, b: u8) {
    // SAFETY: writes one byte from a local to a pipe we own.
    assert_eq!(unsafe { libc::write(fd, (&b as *const u8).cast(), 1) }, 1);
}

/// The next byte from `fd`; 255 when the writer end closed.
fn take_byte(fd: i32) -> u8 {
    let mut b = 255u8;
    // SAFETY: reads one byte into a local from a pipe we own.
    unsafe { libc::read(fd, (&mut b as *mut u8).cast(), 1) };
    b
}

/// A child forked while a writer is open shares the lock file's open file
/// until it exits (as any thread's `Command::spawn` does until its exec):
/// dropping the writer in the parent must still let gc run at once. A
/// child that then writes through the writer it inherited holds a lock of
/// its own, so gc waits for it.
#[test]
fn a_forked_child_neither_keeps_nor_loses_the_store_lock() {
    let root: PathBuf = std::env::temp_dir().join(format!("ss-cs-fork-lock-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let _cleanup = Cleanup(root.clone());
    let writer = Writer::open(&root, Format::Native).unwrap();
    let (from_parent, to_child) = pipe();
    let (from_child, to_parent) = pipe();
    let data = common::pattern(300, 5);
    // SAFETY: the child only reads and writes pipes, writes through the
    // store (fork-safe by design) and leaves by _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // Only the parent may hold the ends the child reads from: a
        // parent that fails then closes them, and the child goes on.
        close_fds(&[to_child, from_child]);
        take_byte(from_parent);
        let ok = writer.write_tensor("child", &data, Dtype::UInt8, 0, &[300], &[1]).is_ok();
        send_byte(to_parent, ok as u8);
        take_byte(from_parent);
        // SAFETY: _exit runs nothing of the parent's.
        unsafe { libc::_exit(0) }
    }
    close_fds(&[from_parent, to_parent]);
    drop(writer);
    let gc = storage_sharing::content_store::gc(&root, true);
    assert!(gc.is_ok(), "the parent closed its writer, but gc found the store locked: {:?}", gc.err().map(|e| e.message().to_string()));
    send_byte(to_child, 1);
    assert_eq!(take_byte(from_child), 1, "the child could not write through the writer it inherited");
    let e = storage_sharing::content_store::gc(&root, true).expect_err("gc ran while the child's writer was writing");
    assert_eq!(e.kind(), storage_sharing::ErrorKind::Busy, "{}", e.message());
    send_byte(to_child, 2);
    assert_eq!(wait_or_kill(pid, CHILD_LIMIT), Ok(0));
    let report = storage_sharing::content_store::gc(&root, false).unwrap();
    assert!(report.storages.is_empty(), "gc removed the child's storage: {:?}", report.storages);
    assert!(storage_sharing::content_store::Reader::open(&root).unwrap().read_tensor("child").is_ok());
    close_fds(&[to_child, from_child]);
}

fn close_fds(fds: &[i32]) {
    for &fd in fds {
        // SAFETY: closes pipe ends this test opened.
        unsafe { libc::close(fd) };
    }
}
