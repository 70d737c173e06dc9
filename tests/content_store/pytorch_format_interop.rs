//! Interop with PyTorch's content store: stores we write are read by
//! torch.load(weights_only=True) and ContentStoreReader; stores
//! ContentStoreWriter writes are read by parse_tensor_file and
//! storage_data_range. Skips where torch does not import.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;

use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::content_store::meta::TensorMeta;
use storage_sharing::content_store::torch_format::{parse_tensor_file, storage_data_range, storage_file, tensor_file};

fn sha1_hex(py: &str, path: &std::path::Path) -> String {
    let out = common::run_ok({
        let mut c = Command::new(py);
        c.args(["-c", "import hashlib,sys; print(hashlib.sha1(open(sys.argv[1],'rb').read()).hexdigest())"]).arg(path);
        c
    });
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn torch_reads_our_store_and_we_read_torchs() {
    if !common::torch_available("torch_reads_our_store_and_we_read_torchs") {
        return;
    }
    let py = common::python();
    let dir = std::env::temp_dir().join(format!("ss_torch_cs_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("ours/storages")).unwrap();
    std::fs::create_dir_all(dir.join("ours/tensors/sub")).unwrap();

    // Ours: 24 float32 (0..24) in one storage, two views of it.
    let data: Vec<u8> = (0..24).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let raw = dir.join("raw");
    std::fs::write(&raw, &data).unwrap();
    let hash = sha1_hex(&py, &raw);
    std::fs::write(dir.join("ours/storages").join(&hash), storage_file(&data)).unwrap();
    let views = [("a", 0i64, vec![2i64, 3, 4], vec![12i64, 4, 1]), ("sub/b", 1, vec![3, 3, 2], vec![1, 4, 12]), ("c", 5, vec![], vec![])];
    for (name, offset, shape, stride) in &views {
        let m =
            TensorMeta { dtype: Dtype::Float32, storage_hash: hash.clone(), offset: *offset, shape: shape.clone(), stride: stride.clone() };
        std::fs::write(dir.join("ours/tensors").join(name), tensor_file(&m)).unwrap();
    }
    let script = r#"
import sys, torch
from torch.utils._content_store import ContentStoreReader, ContentStoreWriter
d = sys.argv[1]
base = torch.arange(24, dtype=torch.float32)
r = ContentStoreReader(d + "/ours")
assert torch.equal(r.read_tensor("a"), base.reshape(2, 3, 4))
assert torch.equal(r.read_tensor("sub/b"), base.reshape(2, 3, 4).transpose(0, 2)[1:])
assert torch.equal(r.read_tensor("c"), base[5])
import os
for h in os.listdir(d + "/ours/storages"):
    s = torch.load(d + "/ours/storages/" + h, weights_only=True)
    assert s.nbytes() == 96
w = ContentStoreWriter(d + "/theirs", stable_hash=True)
x = torch.arange(60, dtype=torch.int16).reshape(3, 4, 5)
w.write_tensor("i16", x)
w.write_tensor("perm", x.permute(2, 0, 1)[1:, :, 2:])
w.write_tensor("zero_d", torch.tensor(2.5, dtype=torch.bfloat16))
w.write_tensor("f64/col", torch.arange(12, dtype=torch.float64).reshape(3, 4)[:, 1])
w.write_tensor("u8", torch.arange(7, dtype=torch.uint8))
print("ok")
"#;
    let out = common::run_ok({
        let mut c = Command::new(&py);
        c.args(["-c", script]).arg(&dir);
        c
    });
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));

    let theirs = dir.join("theirs");
    let read = |name: &str| {
        let m = parse_tensor_file(&std::fs::read(theirs.join("tensors").join(name)).unwrap()).unwrap();
        let file = std::fs::read(theirs.join("storages").join(&m.storage_hash)).unwrap();
        let r = storage_data_range(&file).unwrap();
        (m, file[r].to_vec())
    };
    let i16s = |b: &[u8]| b.chunks(2).map(|c| i16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>();
    let (m, bytes) = read("i16");
    assert_eq!((m.dtype, m.offset, m.shape.clone(), m.stride.clone()), (Dtype::Int16, 0, vec![3, 4, 5], vec![20, 5, 1]));
    assert_eq!(i16s(&bytes), (0..60).collect::<Vec<i16>>());
    let (m2, _) = read("perm");
    assert_eq!((m2.offset, m2.shape, m2.stride), (1 + 2 * 5, vec![4, 3, 2], vec![1, 20, 5]));
    assert_eq!(m2.storage_hash, m.storage_hash, "a view shares its base's storage");
    let (m, bytes) = read("zero_d");
    assert_eq!((m.dtype, m.shape.len(), bytes.len()), (Dtype::BFloat16, 0, 2));
    assert_eq!(u16::from_le_bytes([bytes[0], bytes[1]]), 0x4020); // 2.5 in bfloat16
    let (m, bytes) = read("f64/col");
    assert_eq!((m.dtype, m.offset, m.shape, m.stride, bytes.len()), (Dtype::Float64, 1, vec![3], vec![4], 96));
    let (m, bytes) = read("u8");
    assert_eq!((m.dtype, bytes), (Dtype::UInt8, (0..7).collect::<Vec<u8>>()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A storage copied out of its file (the way the Python reader reads) is
/// checked against the zip record's CRC-32 in the same pass: a flipped
/// byte is refused as `Corrupt`, where the mapping hands the bytes out
/// unchecked, as PyTorch's reader does.
#[test]
fn a_flipped_byte_is_reported_when_a_storage_is_copied_out() {
    use storage_sharing::content_store::{hash_hex, HashMode, Reader};
    use storage_sharing::ErrorKind;
    let dir = std::env::temp_dir().join(format!("ss_torch_cs_flip_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("storages")).unwrap();
    // Big enough to span several pieces of the copy.
    let data: Vec<u8> = (0..(3 << 20) + 5).map(|i: usize| (i * 13 + i / 4093) as u8).collect();
    let hash = hash_hex(&data, HashMode::Stable);
    let path = dir.join("storages").join(&hash);
    let file = storage_file(&data);
    std::fs::write(&path, &file).unwrap();

    let reader = Reader::open(&dir).unwrap();
    let stored = reader.open_storage_file(&hash).unwrap();
    assert_eq!(stored.len(), data.len());
    let mut out = vec![0u8; data.len()];
    stored.read_into(&mut out).unwrap();
    assert!(out == data, "the bytes copied out are the stored ones");
    let e = stored.read_into(&mut out[1..]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");

    // One bit flipped in the last piece of the data.
    let at = storage_data_range(&file).unwrap().start + data.len() - 7;
    let mut damaged = file.clone();
    damaged[at] ^= 0x10;
    std::fs::write(&path, &damaged).unwrap();
    let e = reader.open_storage_file(&hash).unwrap().read_into(&mut out).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.message().contains(&hash) && e.message().contains("CRC-32"), "{e}");
    let mapped = reader.read_storage(&hash).unwrap();
    assert_eq!(mapped.bytes()[data.len() - 7], data[data.len() - 7] ^ 0x10, "the mapping is not checked");
    let _ = std::fs::remove_dir_all(&dir);
}
