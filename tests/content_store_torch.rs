//! The content store beside PyTorch: the stable hash equals hashlib.sha1
//! and torch's `hash_storage(stable_hash=True)`. (Stores exchanged with
//! PyTorch need the torch format: branch content-core-torch.) Skipped
//! where torch does not import.

mod common;

use std::path::PathBuf;
use std::process::Command;
use storage_sharing::content_store::{self, HashMode};

const HASH_STORAGE_PY: &str = "\
import sys, os, torch
from torch.utils._content_store import hash_storage
d = sys.argv[1]
for i in range(int(sys.argv[2])):
    b = open(os.path.join(d, str(i)), 'rb').read()
    s = torch.UntypedStorage(0) if not b else torch.frombuffer(bytearray(b), dtype=torch.uint8).untyped_storage()
    print(hash_storage(s, stable_hash=True))
";

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ss-cs-torch-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn python(code: &str, args: &[&str]) -> String {
    let out = Command::new(common::python()).arg("-c").arg(code).args(args).output().expect("run python");
    assert!(
        out.status.success(),
        "python failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn python_runs() -> bool {
    Command::new(common::python()).arg("-c").arg("import hashlib").output().is_ok_and(|o| o.status.success())
}

/// Buffers of awkward sizes (empty, odd, past the fast hash's chunk).
fn samples() -> Vec<Vec<u8>> {
    vec![vec![], vec![7], common::pattern(1000, 3), common::pattern((1 << 20) + 3, 5), common::pattern(5 << 20, 9)]
}

#[test]
fn stable_hash_equals_hashlib_sha1() {
    if !python_runs() {
        println!("stable_hash_equals_hashlib_sha1: skipped: no python");
        return;
    }
    let dir = temp_dir("hashlib");
    let mut want = Vec::new();
    for (i, s) in samples().iter().enumerate() {
        std::fs::write(dir.join(i.to_string()), s).unwrap();
        want.push(content_store::hash_hex(s, HashMode::Stable));
    }
    let got = python(
        "import hashlib,sys,os\nd=sys.argv[1]\nfor i in range(int(sys.argv[2])): print(hashlib.sha1(open(os.path.join(d,str(i)),'rb').read()).hexdigest())",
        &[dir.to_str().unwrap(), &want.len().to_string()],
    );
    assert_eq!(got.lines().collect::<Vec<_>>(), want);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stable_hash_equals_torch_hash_storage() {
    if !common::torch_available("stable_hash_equals_torch_hash_storage") {
        return;
    }
    let dir = temp_dir("hash_storage");
    let mut want = Vec::new();
    for (i, s) in samples().iter().enumerate() {
        std::fs::write(dir.join(i.to_string()), s).unwrap();
        want.push(content_store::hash_hex(s, HashMode::Stable));
    }
    let got = python(
        HASH_STORAGE_PY,
        &[dir.to_str().unwrap(), &want.len().to_string()],
    );
    assert_eq!(got.lines().collect::<Vec<_>>(), want);
    let _ = std::fs::remove_dir_all(&dir);
}
