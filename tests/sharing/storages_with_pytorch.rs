//! Interop with real PyTorch processes, where `import torch` works (Python
//! from SS_TEST_PYTHON, else python3): PyTorch registers with our manager,
//! we register with torch_shm_manager, and fd and filename tuples made by
//! one side are opened by the other.

#[path = "../common/mod.rs"]
mod common;

use common::{pattern, shm_exists, use_built_manager, wait_until};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::Duration;
use storage_sharing::storage::{recv_fds, send_fds, Storage};

const SCRIPT: &str = r#"
import os, sys, socket, signal
import torch
mode = sys.argv[1]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=3)
def send(line): sock.sendall((line + "\n").encode())
def recv():
    out = b""
    while not out.endswith(b"\n"):
        b = sock.recv(1)
        if not b: raise SystemExit("parent closed")
        out += b
    return out.decode().strip()
def pat(n, seed): return bytes(((i * 31 + seed) & 0xff) for i in range(n))

if mode in ("open_ours", "open_ours_then_die"):
    mgr, name, n = recv().split(" ")
    s = torch.UntypedStorage._new_shared_filename_cpu(mgr.encode(), name.encode(), int(n))
    s._shared_decref()
    ok = bytes(s.tolist()[1:]) == pat(int(n), 7)[1:]
    s[0] = 0xEE
    send("ok" if ok else "bad")
    if mode == "open_ours_then_die":
        recv()
        os.kill(os.getpid(), signal.SIGKILL)
    recv()
    del s
    send("closed")
    recv()
elif mode == "share_theirs":
    n = 50000
    s = torch.UntypedStorage(n)
    s.copy_(torch.frombuffer(bytearray(pat(n, 11)), dtype=torch.uint8).untyped_storage())
    mgr, name, size = s._share_filename_cpu_()
    s._shared_incref()
    send("%s %s %d" % (mgr.decode(), name.decode(), size))
    recv()
    send("marker %d" % s[0])
    recv()
    del s
    send("dropped")
    recv()
elif mode == "fd_theirs":
    n = 40000
    s = torch.UntypedStorage(n)
    s.copy_(torch.frombuffer(bytearray(pat(n, 13)), dtype=torch.uint8).untyped_storage())
    fd, size = s._share_fd_cpu_()
    socket.send_fds(sock, [str(size).encode()], [fd])
    recv()
    send("marker %d" % s[0])
    recv()
elif mode == "fd_ours":
    msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
    n = int(msg.decode())
    s = torch.UntypedStorage._new_shared_fd_cpu(fds[0], n)
    os.close(fds[0])
    ok = bytes(s.tolist()[1:]) == pat(n, 17)[1:]
    s[0] = 0xEE
    send("ok" if ok else "bad")
    recv()
"#;

/// The Python with torch for `test`, or None (skip) where there is none.
fn python(test: &str) -> Option<String> {
    common::torch_available(test).then(common::python)
}

struct Py {
    child: Child,
    sock: UnixStream,
}

impl Py {
    fn start(py: &str, mode: &str) -> Py {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(py);
        cmd.args(["-c", SCRIPT, mode]);
        // SAFETY: dup2 is async-signal-safe; fd 3 is the script's socket.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(theirs);
        ours.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        Py { child, sock: ours }
    }

    fn send(&mut self, line: &str) {
        self.sock.write_all(format!("{line}\n").as_bytes()).unwrap();
    }

    /// One line, read a byte at a time so no fd-carrying bytes are eaten.
    fn recv(&mut self) -> String {
        let mut out = Vec::new();
        let mut b = [0u8; 1];
        while !out.ends_with(b"\n") {
            let n = self.sock.read(&mut b).unwrap();
            assert!(n == 1, "python exited early: {:?}", self.child.try_wait());
            out.push(b[0]);
        }
        String::from_utf8(out).unwrap().trim().to_string()
    }

    fn finish(mut self) {
        drop(self.sock);
        let st = self.child.wait().unwrap();
        assert!(st.success(), "python failed: {st}");
    }
}

#[test]
fn torch_registers_with_our_manager() {
    let Some(py) = python("torch_registers_with_our_manager") else { return };
    use_built_manager();
    let s = Storage::from_bytes(&pattern(30_000, 7)).unwrap();
    let h = s.share_filename().unwrap();
    s.shared_incref().unwrap();
    let mut p = Py::start(&py, "open_ours");
    p.send(&format!("{} {} {}", h.manager_handle, h.filename, h.nbytes));
    assert_eq!(p.recv(), "ok");
    assert_eq!(s.to_vec()[0], 0xEE);
    assert_eq!(s.shared_refcount().unwrap(), 2);
    p.send("close");
    assert_eq!(p.recv(), "closed");
    assert_eq!(s.shared_refcount().unwrap(), 1);
    p.send("bye");
    p.finish();
    drop(s);
    assert!(!shm_exists(&h.filename));
}

#[test]
fn torch_killed_holding_our_segment_is_cleaned_by_our_manager() {
    let Some(py) = python("torch_killed_holding_our_segment_is_cleaned_by_our_manager") else { return };
    use_built_manager();
    let s = Storage::from_bytes(&pattern(30_000, 7)).unwrap();
    let h = s.share_filename().unwrap();
    s.shared_incref().unwrap();
    let mut p = Py::start(&py, "open_ours_then_die");
    p.send(&format!("{} {} {}", h.manager_handle, h.filename, h.nbytes));
    assert_eq!(p.recv(), "ok");
    p.send("die");
    let st = p.child.wait().unwrap();
    assert!(!st.success());
    // Its reference stays in the header forever; ours is the only mapping.
    assert_eq!(s.shared_refcount().unwrap(), 2);
    drop(s);
    assert!(wait_until(Duration::from_secs(15), || !shm_exists(&h.filename)), "{} left", h.filename);
}

#[test]
fn we_register_with_torch_shm_manager() {
    let Some(py) = python("we_register_with_torch_shm_manager") else { return };
    let mut p = Py::start(&py, "share_theirs");
    let line = p.recv();
    let parts: Vec<&str> = line.split(' ').collect();
    assert!(parts[0].contains("torch-shm-dir-"), "torch's manager socket: {}", parts[0]);
    let s = Storage::new_shared_filename(parts[0], parts[1], parts[2].parse().unwrap()).unwrap();
    s.shared_decref().unwrap();
    assert_eq!(s.shared_refcount().unwrap(), 2);
    assert_eq!(s.to_vec()[1..], pattern(50_000, 11)[1..]);
    s.write_at(0, &[0xAB]).unwrap();
    p.send("check");
    assert_eq!(p.recv(), format!("marker {}", 0xAB));
    p.send("drop");
    assert_eq!(p.recv(), "dropped");
    assert_eq!(s.shared_refcount().unwrap(), 1);
    let name = parts[1].to_string();
    drop(s);
    assert!(!shm_exists(&name));
    p.send("bye");
    p.finish();
}

#[test]
fn torch_fd_tuple_opened_here() {
    let Some(py) = python("torch_fd_tuple_opened_here") else { return };
    let mut p = Py::start(&py, "fd_theirs");
    let mut buf = [0u8; 32];
    let (n, fds) = recv_fds(p.sock.as_raw_fd(), &mut buf, 1).unwrap();
    let size: usize = std::str::from_utf8(&buf[..n]).unwrap().parse().unwrap();
    let s = Storage::new_shared_fd(fds[0].as_raw_fd(), size).unwrap();
    drop(fds);
    assert_eq!(s.to_vec()[1..], pattern(40_000, 13)[1..]);
    s.write_at(0, &[0x5A]).unwrap();
    p.send("check");
    assert_eq!(p.recv(), format!("marker {}", 0x5A));
    p.send("bye");
    p.finish();
}

#[test]
fn our_fd_tuple_opened_by_torch() {
    let Some(py) = python("our_fd_tuple_opened_by_torch") else { return };
    let s = Storage::from_bytes(&pattern(20_000, 17)).unwrap();
    let (fd, n) = s.share_fd().unwrap();
    let mut p = Py::start(&py, "fd_ours");
    send_fds(p.sock.as_raw_fd(), n.to_string().as_bytes(), &[fd]).unwrap();
    assert_eq!(p.recv(), "ok");
    assert_eq!(s.to_vec()[0], 0xEE);
    p.send("bye");
    p.finish();
}
