//! Interop with real PyTorch processes (skipped where torch is not
//! importable): segments made by one side open in the other, by name
//! (file_system strategy) and by descriptor (file_descriptor strategy),
//! with bytes and reference counts checked on both sides.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::RawFd;
use std::process::{Child, Command, Stdio};
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, OPEN_SHARED_FD, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, share_memory, MapAllocator, RefcountedMapAllocator};

const LEN: usize = 10_000;

/// Python prelude: the same byte pattern as `common::pattern`.
const PRELUDE: &str = r#"
import os, sys, subprocess, torch
def pattern(n, seed):
    return bytes((i * 31 + seed) & 255 for i in range(n))
def storage_bytes(s):
    return bytes(s.tolist()) if hasattr(s, "tolist") else bytes(s[i] for i in range(s.nbytes()))
def from_bytes(b):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone().untyped_storage()
def say(*a):
    print(*a, flush=True)
"#;

fn spawn_python(body: &str, envs: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(python());
    cmd.arg("-c").arg(format!("{PRELUDE}\n{body}")).stdin(Stdio::piped()).stdout(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn python")
}

struct Py {
    child: Child,
    lines: BufReader<std::process::ChildStdout>,
}

impl Py {
    fn new(body: &str, envs: &[(&str, String)]) -> Py {
        let mut child = spawn_python(body, envs);
        let lines = BufReader::new(child.stdout.take().unwrap());
        Py { child, lines }
    }
    fn line(&mut self) -> String {
        let mut s = String::new();
        self.lines.read_line(&mut s).unwrap();
        assert!(!s.is_empty(), "python ended early: {:?}", self.child.try_wait());
        s.trim().to_string()
    }
    fn send(&mut self, s: &str) {
        writeln!(self.child.stdin.as_mut().unwrap(), "{s}").unwrap();
    }
    fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "python failed: {status}");
    }
}

#[test]
#[ignore = "entry point of the child that PyTorch starts with a descriptor"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    assert_eq!(role, "fd-from-torch");
    let fd: RawFd = args[0].parse().unwrap();
    let len: usize = args[1].parse().unwrap();
    // SAFETY: a descriptor PyTorch passed down; we map a duplicate.
    let dup = unsafe { libc::dup(fd) };
    let m = MapAllocator::open_fd("", dup, OPEN_SHARED_FD, len).unwrap();
    // SAFETY: len bytes mapped.
    let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), len) };
    assert_eq!(bytes, &pattern(len, 11)[..]);
    bytes[..4].copy_from_slice(b"rust");
}

#[test]
fn torch_creates_by_name_we_open() {
    if !torch_available("torch_creates_by_name_we_open") {
        return;
    }
    let mut py = Py::new(
        &format!(
            r#"
torch.multiprocessing.set_sharing_strategy("file_system")
s = from_bytes(pattern({LEN}, 9))
manager, name, size = s._share_filename_cpu_()
say(name.decode(), size)
sys.stdin.readline()
assert storage_bytes(s)[:4] == b"rust", storage_bytes(s)[:8]
say("ok")
sys.stdin.readline()
"#
        ),
        &[],
    );
    let first = py.line();
    let (name, size) = first.split_once(' ').unwrap();
    assert_eq!(size.parse::<usize>().unwrap(), LEN);
    assert!(name.starts_with("/torch_"), "{name}");
    let mut m = RefcountedMapAllocator::open(name, SHAREDMEM | NOCREATE, LEN).unwrap();
    assert_eq!(m.refcount().unwrap(), 2, "PyTorch's holder plus ours");
    // SAFETY: LEN bytes of data mapped.
    let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
    assert_eq!(bytes, &pattern(LEN, 9)[..]);
    bytes[..4].copy_from_slice(b"rust");
    py.send("written");
    assert_eq!(py.line(), "ok");
    m.close().unwrap();
    assert!(shm_exists(name), "PyTorch still holds it");
    py.finish();
    // PyTorch's last close brings the count to 0 and removes the name.
    let name = name.to_string();
    assert!(wait_gone(&name), "{name} left in /dev/shm after both sides closed");
}

#[test]
fn we_create_by_name_torch_opens() {
    if !torch_available("we_create_by_name_torch_opens") {
        return;
    }
    let name = new_process_wide_shm_handle();
    let mut m = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, LEN).unwrap();
    // SAFETY: LEN bytes of data mapped.
    let bytes = unsafe { std::slice::from_raw_parts_mut(m.data(), LEN) };
    bytes.copy_from_slice(&pattern(LEN, 10));
    let mut py = Py::new(
        &format!(
            r#"
s = torch.UntypedStorage._new_shared_filename_cpu(b"", os.environ["SS_NAME"].encode(), {LEN})
assert storage_bytes(s) == pattern({LEN}, 10)
s[0] = ord("p"); s[1] = ord("y")
say("ok")
sys.stdin.readline()
"#
        ),
        &[("SS_NAME", name.clone())],
    );
    assert_eq!(py.line(), "ok");
    assert_eq!(&bytes[..2], b"py");
    assert_eq!(m.refcount().unwrap(), 2, "ours plus PyTorch's open");
    py.finish();
    assert_eq!(m.refcount().unwrap(), 1, "PyTorch's close gave its reference back");
    m.close().unwrap();
    assert!(!shm_exists(&name));
}

#[test]
fn torch_shares_fd_we_map() {
    if !torch_available("torch_shares_fd_we_map") {
        return;
    }
    let me = std::env::current_exe().unwrap();
    let mut py = Py::new(
        &format!(
            r#"
s = from_bytes(pattern({LEN}, 11))
fd, size = s._share_fd_cpu_()
env = dict(os.environ, {ROLE_VAR}="fd-from-torch", SS_TEST_CHILD_ARGS=f"{{fd}}\x1f{{size}}")
subprocess.run([os.environ["SS_ME"], "--ignored", "--exact", "child_role", "--nocapture"],
               env=env, pass_fds=[fd], check=True, stdout=subprocess.DEVNULL)
assert storage_bytes(s)[:4] == b"rust"
say("ok")
"#
        ),
        &[("SS_ME", me.to_string_lossy().into_owned())],
    );
    assert_eq!(py.line(), "ok");
    py.finish();
}

#[test]
fn we_share_fd_torch_maps() {
    if !torch_available("we_share_fd_torch_maps") {
        return;
    }
    let m = share_memory(&pattern(LEN, 12)).unwrap();
    // SAFETY: an inheritable duplicate of our kept descriptor.
    let fd = unsafe { libc::dup(m.fd()) };
    let mut py = Py::new(
        &format!(
            r#"
s = torch.UntypedStorage._new_shared_fd_cpu(int(os.environ["SS_FD"]), {LEN})
assert storage_bytes(s) == pattern({LEN}, 12)
s[0] = ord("p"); s[1] = ord("t")
say("ok")
"#
        ),
        &[("SS_FD", fd.to_string())],
    );
    assert_eq!(py.line(), "ok");
    py.finish();
    // SAFETY: our duplicate.
    unsafe { libc::close(fd) };
    // SAFETY: LEN bytes mapped.
    assert_eq!(unsafe { std::slice::from_raw_parts(m.data(), 2) }, b"pt");
}

fn wait_gone(name: &str) -> bool {
    for _ in 0..100 {
        if !shm_exists(name) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    false
}
