//! The content store beside PyTorch: the stable hash equals hashlib.sha1
//! and torch's `hash_storage(stable_hash=True)`; stores written by each
//! side are read by the other (torch format), and PyTorch's reader loads
//! what our writer wrote. Skipped where torch does not import.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use storage_sharing::content_store::{self, Dtype, Format, HashMode, Reader, Writer};
use storage_sharing::ErrorKind;

const HASH_STORAGE_PY: &str = "\
import sys, os, torch
from torch.utils._content_store import hash_storage
d = sys.argv[1]
for i in range(int(sys.argv[2])):
    b = open(os.path.join(d, str(i)), 'rb').read()
    s = torch.UntypedStorage(0) if not b else torch.frombuffer(bytearray(b), dtype=torch.uint8).untyped_storage()
    print(hash_storage(s, stable_hash=True))
";

const TORCH_READER_PY: &str = "\
import sys, os, torch
from torch.utils._content_store import ContentStoreReader, hash_storage
r = ContentStoreReader(sys.argv[1])
for i, n in enumerate(sys.argv[3].split(',')):
    t = r.read_tensor(n)
    s = t.untyped_storage()
    raw = open(os.path.join(sys.argv[2], 'raw%d' % i), 'rb').read()
    assert bytes(s) == raw, n
    print(n, str(t.dtype)[6:], t.storage_offset(), list(t.shape), list(t.stride()), hash_storage(s, stable_hash=True))
";

const TORCH_WRITER_PY: &str = "\
import sys, torch
from torch.utils._content_store import ContentStoreWriter
w = ContentStoreWriter(sys.argv[1], stable_hash=sys.argv[2] == '1')
base = torch.arange(24, dtype=torch.float32)
w.write_tensor('scalar', base[5])
w.write_tensor('mat_t', base.view(4, 6).t())
w.write_tensor('slice', base[3:11:2])
w.write_tensor('nested/i64', torch.arange(10, dtype=torch.int64))
w.write_tensor('nested/bf16', torch.ones(2, 3, dtype=torch.bfloat16))
w.write_tensor('again', base)
";

const TORCH_COMPARE_PY: &str = "\
import sys, torch
from torch.utils._content_store import ContentStoreReader
r = ContentStoreReader(sys.argv[1])
print(torch.equal(r.read_tensor('ours'), r.read_tensor('again')))
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
    let got = python(HASH_STORAGE_PY, &[dir.to_str().unwrap(), &want.len().to_string()]);
    assert_eq!(got.lines().collect::<Vec<_>>(), want);
    let _ = std::fs::remove_dir_all(&dir);
}

/// (name, dtype, offset, shape, stride) of a view.
type View = (&'static str, Dtype, i64, Vec<i64>, Vec<i64>);

/// The views our writer hands to PyTorch's reader.
fn exchange_views() -> Vec<View> {
    vec![
        ("scalar", Dtype::Float32, 2, vec![], vec![]),
        ("vec", Dtype::Int64, 0, vec![5], vec![1]),
        ("mat_t", Dtype::Float64, 1, vec![3, 4], vec![1, 3]),
        ("nested/bf16", Dtype::BFloat16, 0, vec![2, 3, 4], vec![12, 4, 1]),
        ("nested/deeper/u8", Dtype::UInt8, 3, vec![2, 2, 2, 2, 2], vec![16, 8, 4, 2, 1]),
        ("flag", Dtype::Bool, 0, vec![4], vec![1]),
        ("half_expanded", Dtype::Float16, 0, vec![3, 4], vec![0, 1]),
    ]
}

#[test]
fn torch_reads_what_we_write() {
    if !common::torch_available("torch_reads_what_we_write") {
        return;
    }
    let dir = temp_dir("ours");
    let root = dir.join("store");
    let w = Writer::open(&root, Format::Torch).unwrap();
    let mut expected = Vec::new();
    for (i, (name, dtype, offset, shape, stride)) in exchange_views().into_iter().enumerate() {
        let meta = content_store::TensorMeta { dtype, storage_hash: String::new(), offset, shape: shape.clone(), stride: stride.clone() };
        let need = content_store::bounds::required_bytes(&meta, ErrorKind::InvalidArgument).unwrap() as usize;
        // Bool bytes must be 0 or 1 for torch.
        let data: Vec<u8> = if dtype == Dtype::Bool { (0..need).map(|j| (j % 2) as u8).collect() } else { common::pattern(need, i as u8) };
        let hash = w.write_tensor(name, &data, dtype, offset, &shape, &stride).unwrap();
        std::fs::write(dir.join(format!("raw{i}")), &data).unwrap();
        expected.push(format!("{name} {} {offset} {shape:?} {stride:?} {hash}", dtype.torch_name()));
    }
    drop(w);
    let got = python(
        TORCH_READER_PY,
        &[root.to_str().unwrap(), dir.to_str().unwrap(), &exchange_views().iter().map(|v| v.0).collect::<Vec<_>>().join(",")],
    );
    assert_eq!(got.lines().collect::<Vec<_>>(), expected);
    let _ = std::fs::remove_dir_all(&dir);
}

fn write_with_torch(root: &Path, stable: bool) {
    python(TORCH_WRITER_PY, &[root.to_str().unwrap(), if stable { "1" } else { "0" }]);
}

#[test]
fn we_read_what_torch_writes() {
    if !common::torch_available("we_read_what_torch_writes") {
        return;
    }
    let dir = temp_dir("theirs");
    let root = dir.join("store");
    write_with_torch(&root, true);
    let r = Reader::open(&root).unwrap();
    assert_eq!(r.format(), Format::Torch);
    r.set_verify(true);
    assert_eq!(r.list_tensors().unwrap(), ["again", "mat_t", "nested/bf16", "nested/i64", "scalar", "slice"]);
    let base: Vec<u8> = (0..24).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let t = r.read_tensor("mat_t").unwrap();
    assert_eq!((t.meta.dtype, t.meta.offset, &t.meta.shape[..], &t.meta.stride[..]), (Dtype::Float32, 0, &[6, 4][..], &[1, 6][..]));
    assert_eq!(t.storage.bytes(), &base[..]);
    let s = r.read_tensor("slice").unwrap();
    assert_eq!((s.meta.offset, &s.meta.shape[..], &s.meta.stride[..]), (3, &[4][..], &[2][..]));
    // Views of one storage share one mapping.
    assert!(std::sync::Arc::ptr_eq(&t.storage, &s.storage));
    let sc = r.read_tensor("scalar").unwrap();
    assert!(sc.meta.shape.is_empty() && sc.meta.offset == 5);
    assert_eq!(r.read_tensor("nested/bf16").unwrap().meta.dtype, Dtype::BFloat16);
    assert_eq!(r.list_storages().unwrap().len(), 3);
    let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    // We add to PyTorch's store in its format; PyTorch reads both.
    let w = Writer::open(&root, Format::Torch).unwrap();
    w.write_tensor("ours", &base, Dtype::Float32, 0, &[24], &[1]).unwrap();
    assert_eq!(w.stats().storages_deduplicated, 1);
    drop(w);
    let out = python(TORCH_COMPARE_PY, &[root.to_str().unwrap()]);
    assert_eq!(out.trim(), "True");

    // PyTorch's default hash: readable, and verified (computed natively).
    let root2 = dir.join("store2");
    write_with_torch(&root2, false);
    let r2 = Reader::open(&root2).unwrap();
    assert_eq!(r2.read_tensor("slice").unwrap().storage.bytes(), &base[..]);
    let report = content_store::verify(&r2, &mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty() && report.storages == 3, "{:?}", report.problems);
    let _ = std::fs::remove_dir_all(&dir);
}

const EVIL_PY: &str = "\
import sys, os, torch
class Evil:
    def __reduce__(self):
        return (os.system, ('touch ' + sys.argv[2],))
torch.save(Evil(), os.path.join(sys.argv[1], 'tensors', 'evil'))
torch.save((torch.float32, 'ab' * 20, 0, torch.Size([1]), (1,), {}, Evil()), os.path.join(sys.argv[1], 'tensors', 'evil2'))
";

#[test]
fn pickles_asking_for_other_globals_are_refused() {
    if !common::torch_available("pickles_asking_for_other_globals_are_refused") {
        return;
    }
    let dir = temp_dir("evil");
    let root = dir.join("store");
    let w = Writer::open(&root, Format::Torch).unwrap();
    w.write_tensor("good", &[0u8; 8], Dtype::Float32, 0, &[2], &[1]).unwrap();
    drop(w);
    let marker = dir.join("pwned");
    python(EVIL_PY, &[root.to_str().unwrap(), marker.to_str().unwrap()]);
    assert!(!marker.exists(), "writing the pickle ran it");
    let r = Reader::open(&root).unwrap();
    for name in ["evil", "evil2"] {
        let e = r.read_tensor(name).err().unwrap();
        assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::InvalidArgument), "{name}: {:?} {}", e.kind(), e.message());
        assert!(e.message().contains("system") || e.message().contains("global"), "{name}: {}", e.message());
    }
    assert!(!marker.exists(), "reading the pickle ran it");
    r.read_tensor("good").unwrap();
    let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
    let objects: Vec<&str> = report.problems.iter().map(|p| p.object.as_str()).collect();
    assert_eq!(objects, ["tensors/evil", "tensors/evil2"]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn ssctl(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// Puts storage `from`'s file in the place of storage `to` (same
/// bytes as another storage's file, so its zip CRC-32 still matches).
fn swap_in(root: &Path, from: &str, to: &str) {
    let storages = root.join("storages");
    std::fs::copy(storages.join(from), storages.join(to)).unwrap();
}

#[test]
fn default_hash_store_verifies_and_a_swapped_file_is_corrupt() {
    if !common::torch_available("default_hash_store_verifies_and_a_swapped_file_is_corrupt") {
        return;
    }
    for stable in [false, true] {
        let dir = temp_dir(if stable { "swap-stable" } else { "swap-default" });
        let root = dir.join("store");
        write_with_torch(&root, stable);
        let p = root.to_str().unwrap();
        let r = Reader::open(&root).unwrap();
        let storages = r.list_storages().unwrap();
        // Both hashes give 40 hex digits: the name alone cannot tell them apart.
        assert!(storages.len() == 3 && storages.iter().all(|(h, _)| h.len() == 40), "{storages:?}");
        let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "valid PyTorch store (stable {stable}) called corrupt: {:?}", report.problems);
        let (code, out) = ssctl(&["store", "verify", p]);
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("ok: no corrupt object"), "{out}");

        // Another storage's file under this name: its CRC-32 matches, the name does not.
        let (from, to) = (&storages[0].0, &storages[1].0);
        swap_in(&root, from, to);
        let report = content_store::verify(&Reader::open(&root).unwrap(), &mut |_, _| {}).unwrap();
        // (Entries over it may no longer fit it either: those are named too.)
        let swapped = format!("storages/{to}");
        let storage_problems: Vec<_> = report.problems.iter().filter(|p| p.object.starts_with("storages/")).collect();
        assert!(storage_problems.len() == 1 && storage_problems[0].object == swapped, "stable {stable}: {:?}", report.problems);
        let why = &storage_problems[0].why;
        assert!(why.contains("neither the SHA-1") && why.contains("another storage"), "{why}");
        let (code, out) = ssctl(&["store", "verify", p]);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains(&format!("storages/{to}")) && out.contains("corrupt object(s)"), "{out}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    // Damaged data in such a store is found too, and named as damage.
    let dir = temp_dir("default-hash-damaged");
    let root = dir.join("store");
    write_with_torch(&root, false);
    let (hash, _) = Reader::open(&root).unwrap().list_storages().unwrap()[0].clone();
    let path = root.join("storages").join(&hash);
    let mut file = std::fs::read(&path).unwrap();
    let at = content_store::torch_format::storage_data_range(&file).unwrap().start;
    file[at] ^= 0x10;
    std::fs::write(&path, &file).unwrap();
    let report = content_store::verify(&Reader::open(&root).unwrap(), &mut |_, _| {}).unwrap();
    let objects: Vec<&str> = report.problems.iter().map(|p| p.object.as_str()).collect();
    assert_eq!(objects, [format!("storages/{hash}")], "{:?}", report.problems);
    assert!(report.problems[0].why.contains("damaged"), "{}", report.problems[0].why);
    let (code, out) = ssctl(&["store", "verify", root.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

const TORCH_CONJ_PY: &str = "\
import sys, torch
from torch.utils._content_store import ContentStoreWriter
w = ContentStoreWriter(sys.argv[1], stable_hash=True)
x = torch.tensor([1+2j, 3-4j, -5+6j], dtype=torch.complex64)
w.write_tensor('conj', x.conj())
w.write_tensor('neg', x.conj()._neg_view())
w.write_tensor('plain', x)
";

#[test]
fn conj_and_neg_views_are_read_as_pytorch_reads_them() {
    if !common::torch_available("conj_and_neg_views_are_read_as_pytorch_reads_them") {
        return;
    }
    let dir = temp_dir("conj");
    let root = dir.join("store");
    python(TORCH_CONJ_PY, &[root.to_str().unwrap()]);
    let r = Reader::open(&root).unwrap();
    let want: Vec<u8> = [1f32, 2., 3., -4., -5., 6.].iter().flat_map(|f| f.to_le_bytes()).collect();
    for (name, conj, neg) in [("conj", true, false), ("neg", true, true), ("plain", false, false)] {
        let t = r.read_tensor(name).unwrap_or_else(|e| panic!("{name}: {}", e.message()));
        assert_eq!((t.bits.conj, t.bits.neg), (conj, neg), "{name}");
        assert_eq!((t.meta.dtype, &t.meta.shape[..]), (Dtype::ComplexFloat, &[3][..]), "{name}");
        // The storage holds the bytes before the lazy conjugation/negation.
        assert_eq!(t.storage.bytes(), &want[..], "{name}");
    }
    let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let gc = content_store::gc(&root, true).unwrap();
    assert_eq!((gc.storages.len(), gc.kept_storages), (0, 1));
    let (code, out) = ssctl(&["store", "verify", root.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = ssctl(&["store", "show", root.to_str().unwrap(), "neg"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("conj") && out.contains("neg"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
