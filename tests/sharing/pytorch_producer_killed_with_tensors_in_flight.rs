//! Real PyTorch with our daemon in place of torch_shm_manager (file_system
//! sharing strategy): a producer killed with -9 while its tensors sit in a
//! queue loses none of them, and nothing of its is left afterwards.
//!
//! PyTorch starts `<torch package>/bin/torch_shm_manager`, a path it takes
//! from where the package was imported. The test imports torch from a
//! folder of symbolic links to the real package in which only
//! `bin/torch_shm_manager` points at our binary.

#[path = "../common/mod.rs"]
mod common;

use common::{manager_bin, python, torch_available, wait_until};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const HANG_GUARD: Duration = Duration::from_secs(120);

const SCRIPT: &str = r#"
import os, signal, sys, time
import torch
import torch.multiprocessing as mp

N = 64

def expected(i):
    return torch.arange(1000, dtype=torch.float32) * (i + 1)

def produce(q, ready):
    mp.set_sharing_strategy("file_system")
    kept = [expected(i) for i in range(N)]
    for i, t in enumerate(kept):
        q.put((i, t))
    q.close()
    q.join_thread()  # every message is in the pipe now
    ready.set()
    time.sleep(600)  # keeps its tensors until killed

if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=produce, args=(q, ready))
    p.start()
    if not ready.wait(90):
        p.kill()
        sys.exit("producer never got ready")
    print("producer", p.pid, flush=True)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    time.sleep(4)
    got = {}
    for _ in range(N):
        i, t = q.get(timeout=30)
        got[i] = t
    good = sum(1 for i, t in got.items() if torch.equal(t, expected(i)))
    manager = got[0].untyped_storage()._share_filename_cpu_()[0].decode()
    print("received", len(got), "good", good, flush=True)
    print("manager", manager, flush=True)
    del got, t
"#;

/// The real torch package folder, found by importing it.
fn torch_dir(py: &str) -> PathBuf {
    let out = Command::new(py).args(["-c", "import os, torch; print(os.path.dirname(torch.__file__))"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// `<root>/torch`: links to every entry of the real package, except `bin`,
/// a folder of links to the real one's entries but for torch_shm_manager,
/// which is our binary.
fn torch_with_our_manager(root: &Path, real: &Path) {
    use std::os::unix::fs::symlink;
    let pkg = root.join("torch");
    std::fs::create_dir_all(pkg.join("bin")).unwrap();
    for e in std::fs::read_dir(real).unwrap().flatten() {
        if e.file_name() != "bin" {
            symlink(e.path(), pkg.join(e.file_name())).unwrap();
        }
    }
    for e in std::fs::read_dir(real.join("bin")).unwrap().flatten() {
        if e.file_name() != "torch_shm_manager" {
            symlink(e.path(), pkg.join("bin").join(e.file_name())).unwrap();
        }
    }
    symlink(manager_bin(), pkg.join("bin/torch_shm_manager")).unwrap();
}

fn segments_of(pid: &str) -> Vec<String> {
    let prefix = format!("torch_{pid}_");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn torch_producer_killed_with_64_tensors_queued_loses_none_and_leaks_none() {
    let test = "torch_producer_killed_with_64_tensors_queued_loses_none_and_leaks_none";
    if !torch_available(test) {
        return;
    }
    let py = python();
    let tmp = TempDir::new();
    let root = &tmp.0;
    torch_with_our_manager(&root.join("site"), &torch_dir(&py));
    std::fs::write(root.join("consumer.py"), SCRIPT).unwrap();
    let (out_path, err_path) = (root.join("stdout"), root.join("stderr"));
    let mut child = Command::new(&py)
        .arg(root.join("consumer.py"))
        .current_dir(root)
        .env("PYTHONPATH", root.join("site"))
        // Our daemon logs to the stderr it inherits: proof that it served.
        .env("SS_SHM_MANAGER_LOG", "1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let mut status = None;
    let finished = wait_until(HANG_GUARD, || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    if !finished {
        let _ = child.kill();
        let _ = child.wait();
    }
    let out = std::fs::read_to_string(&out_path).unwrap();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(finished && status.unwrap().success(), "consumer failed ({status:?})\nstdout:\n{out}\nstderr:\n{err}");
    let field = |key: &str| out.lines().find_map(|l| l.strip_prefix(key)).map(str::to_string);
    let pid = field("producer ").expect("producer pid");
    assert_eq!(field("received ").as_deref(), Some("64 good 64"), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("ss_shm_manager["), "our manager did not serve (stderr:\n{err})");
    // Their last references are closed: nothing of the producer is left,
    // and the daemon goes once idle.
    assert!(wait_until(HANG_GUARD, || segments_of(&pid).is_empty()), "left in /dev/shm: {:?}", segments_of(&pid));
    let manager = field("manager ").expect("manager socket");
    assert!(wait_until(HANG_GUARD, || !Path::new(&manager).exists()), "manager {manager} still running");
    assert_eq!(segments_of(&pid).len(), 0);
}

/// The test's folder, removed even when the test fails.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("ss-kill9-torch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
