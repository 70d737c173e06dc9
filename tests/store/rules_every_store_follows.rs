//! Rules every store follows alike, through the C API: `add` wraps in
//! two's complement at the ends of int64 (as PyTorch's servers do), and a
//! key is any bytes but NUL (as PyTorch's servers and clients store them),
//! for the file store, our TCPStore server and PyTorch's.

#[path = "../common/mod.rs"]
mod common;

use common::{python, torch_available};
use std::ffi::{CStr, CString};
use std::io::{BufRead, BufReader, Write};
use std::os::raw::c_int;
use std::process::{Command, Stdio};
use storage_sharing::ffi::errors::ss_last_error_message;
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ffi::store::*;

const TIMEOUT_MS: i64 = 30_000;

struct Handle(*mut SsStore);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: a handle of this library, freed once.
        unsafe { ss_store_free(self.0) };
    }
}

fn ok(status: ss_status, what: &str) {
    // SAFETY: the library's thread-local message, a valid C string.
    let msg = unsafe { CStr::from_ptr(ss_last_error_message()) }.to_string_lossy().into_owned();
    assert_eq!(status, ss_status::SS_OK, "{what}: {msg}");
}

fn tcp(port: u16, is_master: bool) -> Handle {
    let host = CString::new("127.0.0.1").unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: valid arguments.
    ok(unsafe { ss_store_tcp_open(host.as_ptr(), c_int::from(port), is_master, 0, TIMEOUT_MS, &mut s) }, "tcp open");
    Handle(s)
}

fn file_store(tag: &str) -> (Handle, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("ss-store-rules-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: valid arguments.
    ok(unsafe { ss_store_file_open(path.as_ptr(), &mut s) }, "file open");
    (Handle(s), dir)
}

fn add(s: &Handle, key: &[u8], delta: i64) -> i64 {
    let k = CString::new(key).unwrap();
    let mut v = 0;
    // SAFETY: a live handle, a C string, an out-pointer.
    ok(unsafe { ss_store_add(s.0, k.as_ptr(), delta, &mut v) }, "add");
    v
}

fn set(s: &Handle, key: &[u8], value: &[u8]) {
    let k = CString::new(key).unwrap();
    // SAFETY: a live handle, a C string, readable bytes.
    ok(unsafe { ss_store_set(s.0, k.as_ptr(), value.as_ptr().cast(), value.len()) }, "set");
}

fn get(s: &Handle, key: &[u8]) -> Vec<u8> {
    let k = CString::new(key).unwrap();
    let mut buf = vec![0u8; 256];
    let mut len = 0;
    // SAFETY: a live handle, a C string, a writable buffer.
    ok(unsafe { ss_store_get(s.0, k.as_ptr(), TIMEOUT_MS, buf.as_mut_ptr().cast(), buf.len(), &mut len) }, "get");
    buf.truncate(len);
    buf
}

fn check(s: &Handle, keys: &[&[u8]]) -> bool {
    let owned: Vec<CString> = keys.iter().map(|k| CString::new(*k).unwrap()).collect();
    let ptrs: Vec<_> = owned.iter().map(|k| k.as_ptr()).collect();
    let mut all = false;
    // SAFETY: a live handle, C strings, an out-pointer.
    ok(unsafe { ss_store_check(s.0, ptrs.as_ptr(), ptrs.len(), &mut all) }, "check");
    all
}

fn wait(s: &Handle, keys: &[&[u8]]) {
    let owned: Vec<CString> = keys.iter().map(|k| CString::new(*k).unwrap()).collect();
    let ptrs: Vec<_> = owned.iter().map(|k| k.as_ptr()).collect();
    // SAFETY: a live handle and C strings.
    ok(unsafe { ss_store_wait(s.0, ptrs.as_ptr(), ptrs.len(), TIMEOUT_MS) }, "wait");
}

fn delete(s: &Handle, key: &[u8]) -> bool {
    let k = CString::new(key).unwrap();
    let mut existed = false;
    // SAFETY: a live handle, a C string, an out-pointer.
    ok(unsafe { ss_store_delete_key(s.0, k.as_ptr(), &mut existed) }, "delete_key");
    existed
}

/// `add` past either end of int64 wraps, and the stored text is the
/// wrapped number.
fn add_wraps(s: &Handle) {
    assert_eq!(add(s, b"max", i64::MAX), i64::MAX);
    assert_eq!(add(s, b"max", 1), i64::MIN);
    assert_eq!(get(s, b"max"), i64::MIN.to_string().as_bytes());
    assert_eq!(add(s, b"max", -1), i64::MAX);
    assert_eq!(add(s, b"min", i64::MIN), i64::MIN);
    assert_eq!(add(s, b"min", i64::MIN), 0);
}

#[test]
fn add_wraps_at_the_ends_of_int64_in_every_store() {
    let server = tcp(0, true);
    add_wraps(&server);
    let (file, dir) = file_store("wrap");
    add_wraps(&file);
    drop(file);
    // PyTorch's FileStore file, through the same C API.
    let path = CString::new(dir.join("torch-file").to_str().unwrap()).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: a NUL-terminated path and a writable out pointer.
    ok(unsafe { ss_store_torch_file_open(path.as_ptr(), -1, 10_000, &mut s) }, "torch file open");
    add_wraps(&Handle(s));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Keys that are not UTF-8 (and ones that differ only in such bytes)
/// are stored, found and told apart.
fn byte_keys(s: &Handle, writer: &Handle) {
    let (a, b): (&[u8], &[u8]) = (b"rank/\xff\xfe/0", b"rank/\xff\xfd/0");
    set(writer, a, b"first");
    set(writer, b, b"second");
    assert_eq!(get(s, a), b"first");
    assert_eq!(get(s, b), b"second");
    wait(s, &[a, b]);
    assert!(check(s, &[a, b]));
    assert!(!check(s, &[b"rank/\xff/missing"]));
    assert_eq!(add(s, b"count\x80", 2), 2);
    assert_eq!(add(writer, b"count\x80", 3), 5);
    assert!(delete(s, a));
    assert!(!check(s, &[a]));
}

#[test]
fn keys_that_are_not_utf8_work_in_the_file_store_and_our_tcpstore() {
    let server = tcp(0, true);
    let client = tcp(server.port_of(), false);
    byte_keys(&client, &server);
    let (file, dir) = file_store("bytes");
    byte_keys(&file, &file);
    drop(file);
    std::fs::remove_dir_all(dir).unwrap();
}

impl Handle {
    fn port_of(&self) -> u16 {
        let mut port = 0;
        // SAFETY: a live handle and an out-pointer.
        ok(unsafe { ss_store_tcp_port(self.0, &mut port) }, "port");
        port as u16
    }
}

/// PyTorch's server (libuv and classic) in a child Python: prints its
/// port, serves until its stdin closes.
const TORCH_SERVER: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False, use_libuv=sys.argv[1] == "1")
print("PORT", s.port, flush=True)
sys.stdin.read()
print("KEYS", s.num_keys(), flush=True)
"#;

#[test]
fn keys_that_are_not_utf8_work_against_pytorch_servers() {
    if !torch_available("keys_that_are_not_utf8_work_against_pytorch_servers") {
        return;
    }
    for libuv in ["1", "0"] {
        let mut child =
            Command::new(python()).args(["-c", TORCH_SERVER, libuv]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        let port: u16 = line.trim().strip_prefix("PORT ").unwrap_or_else(|| panic!("python said {line:?}")).parse().unwrap();
        let (reader, writer) = (tcp(port, false), tcp(port, false));
        byte_keys(&reader, &writer);
        // PyTorch's server wraps too.
        add_wraps(&reader);
        drop((reader, writer));
        child.stdin.take().unwrap().write_all(b"").unwrap();
        line.clear();
        lines.read_line(&mut line).unwrap();
        assert!(child.wait().unwrap().success(), "python server failed");
        // rank/\xfd/0, count\x80, max, min (the init key is not there: no rank joined).
        assert_eq!(line.trim(), "KEYS 4", "libuv={libuv}");
    }
}
