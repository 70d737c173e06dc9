//! `ssctl store ls|show|verify|gc` on a real store.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use storage_sharing::content_store::{Dtype, Format, Writer};

fn ssctl(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn store_commands() {
    let root = std::env::temp_dir().join(format!("ss-cs-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let w = Writer::open(&root, Format::Native).unwrap();
    let big = common::pattern(3 << 20, 1);
    let hash = w.write_tensor("layer0/weight", &big, Dtype::Float32, 0, &[768, 1024], &[1024, 1]).unwrap();
    w.write_tensor("layer0/weight_t", &big, Dtype::Float32, 0, &[1024, 768], &[1, 1024]).unwrap();
    w.write_tensor("bias", &common::pattern(400, 2), Dtype::Float16, 0, &[200], &[1]).unwrap();
    let orphan = w.write_storage(&common::pattern(5000, 3)).unwrap();
    drop(w);
    let p = root.to_str().unwrap();

    let (code, out, _) = ssctl(&["store", "ls", p]);
    assert_eq!(code, 0);
    assert!(out.contains("layer0/weight_t") && out.contains("[1024, 768]") && out.contains("3.00 MiB"), "{out}");
    assert!(out.contains("3 tensor(s), 3 storage(s)"), "{out}");
    let (code, out, _) = ssctl(&["store", "show", p]);
    assert_eq!(code, 0);
    assert!(out.contains("format:    native") && out.contains("tensors:   3"), "{out}");
    let (code, out, _) = ssctl(&["store", "show", p, "layer0/weight_t"]);
    assert_eq!(code, 0);
    assert!(out.contains("stride:    [1, 1024]") && out.contains(&hash), "{out}");
    let (code, out, _) = ssctl(&["store", "verify", p]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("ok: no corrupt object"), "{out}");

    let (code, out, _) = ssctl(&["store", "gc", p, "--dry-run"]);
    assert_eq!(code, 0);
    assert!(out.contains(&format!("would remove storages/{orphan}")), "{out}");
    let (code, out, _) = ssctl(&["store", "gc", p]);
    assert_eq!(code, 0);
    assert!(out.contains("removed 1 unreferenced storage(s)"), "{out}");
    assert!(!root.join("storages").join(&orphan).exists());

    // Damage a storage and an entry: verify lists both and fails.
    let storage = root.join("storages").join(&hash);
    let mut bytes = std::fs::read(&storage).unwrap();
    bytes[12345] ^= 0xff;
    std::fs::write(&storage, &bytes).unwrap();
    std::fs::write(root.join("tensors/bias"), b"not a record").unwrap();
    let (code, out, _) = ssctl(&["store", "verify", p]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("2 corrupt object(s)"), "{out}");
    assert!(out.contains(&format!("storages/{hash}")) && out.contains("tensors/bias"), "{out}");

    let (code, _, err) = ssctl(&["store", "ls", "/nonexistent/store"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/store"), "{err}");
    assert_eq!(ssctl(&["store", "frobnicate", p]).0, 2);
    assert_eq!(ssctl(&["store", "verify"]).0, 2);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn gc_takes_its_flag_before_or_after_the_path() {
    let root = std::env::temp_dir().join(format!("ss-cs-cli-gc-order-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let w = Writer::open(&root, Format::Native).unwrap();
    let orphan = w.write_storage(&common::pattern(300, 4)).unwrap();
    drop(w);
    let p = root.to_str().unwrap();
    for args in [["store", "gc", "--dry-run", p], ["store", "gc", p, "--dry-run"]] {
        let (code, out, err) = ssctl(&args);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        assert!(out.contains(&format!("would remove storages/{orphan}")), "{args:?}: {out}");
        assert!(root.join("storages").join(&orphan).exists(), "{args:?}: a dry run removed the storage");
    }
    let (code, _, err) = ssctl(&["store", "gc", "--dry-run", "--frobnicate", p]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--frobnicate"), "{err}");
    assert_eq!(ssctl(&["store", "gc", p, p]).0, 2);
    assert_eq!(ssctl(&["store", "gc", "--dry-run"]).0, 2);
    let (code, out, _) = ssctl(&["store", "gc", p]);
    assert_eq!(code, 0);
    assert!(out.contains("removed 1 unreferenced storage(s)"), "{out}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ls_shows_storage_bytes_not_file_size_in_torch_format() {
    let root = std::env::temp_dir().join(format!("ss-cs-cli-ls-torch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let w = Writer::open(&root, Format::Torch).unwrap();
    w.write_tensor("twelve", &common::pattern(48, 1), Dtype::Float32, 0, &[12], &[1]).unwrap();
    drop(w);
    let (code, out, err) = ssctl(&["store", "ls", root.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let row = out.lines().find(|l| l.starts_with("twelve")).unwrap_or_else(|| panic!("{out}"));
    assert!(row.trim_end().ends_with("48 B"), "a 48-byte storage: {row}");
    assert!(out.contains("1 tensor(s), 1 storage(s), 48 B"), "{out}");
    let _ = std::fs::remove_dir_all(&root);
}
