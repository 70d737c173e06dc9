//! Content store: round trips, dedup, concurrent and reopened writers,
//! writers killed with SIGKILL, verify and gc, and every bad input.

#[path = "../common/mod.rs"]
mod common;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;
use storage_sharing::content_store::{self, Dtype, Format, HashMode, Reader, Writer};
use storage_sharing::ErrorKind;

const ALL_DTYPES: [i32; 18] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 23, 24, 27, 28, 29];

fn temp_store(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ss-cs-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

struct Cleanup(PathBuf);
impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Contiguous strides for a shape.
fn contiguous(shape: &[i64]) -> Vec<i64> {
    let mut stride = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        stride[i] = stride[i + 1] * shape[i + 1].max(1);
    }
    stride
}

/// The views every round trip covers: 0-d to 5-d, contiguous, transposed,
/// expanded (stride 0), sliced with an offset, empty.
fn views() -> Vec<(i64, Vec<i64>, Vec<i64>)> {
    vec![
        (0, vec![], vec![]),
        (3, vec![], vec![]),
        (0, vec![7], vec![1]),
        (2, vec![4], vec![3]),
        (0, vec![3, 4], contiguous(&[3, 4])),
        (1, vec![4, 3], vec![1, 4]),
        (0, vec![2, 3, 4], contiguous(&[2, 3, 4])),
        (5, vec![2, 3, 2], vec![1, 0, 6]),
        (0, vec![2, 1, 3, 2], contiguous(&[2, 1, 3, 2])),
        (0, vec![2, 2, 2, 2, 2], contiguous(&[2, 2, 2, 2, 2])),
        (4, vec![2, 2, 1, 2, 2], vec![16, 4, 99, 1, 2]),
        (9, vec![0, 3], vec![3, 1]),
    ]
}

fn round_trip(format: Format) {
    let root = temp_store(&format!("rt-{}", format.name()));
    let _c = Cleanup(root.clone());
    let w = Writer::open(&root, format).unwrap();
    let mut expected = Vec::new();
    for code in ALL_DTYPES {
        let dtype = Dtype::from_code(code).unwrap();
        for (i, (offset, shape, stride)) in views().into_iter().enumerate() {
            let meta =
                content_store::TensorMeta { dtype, storage_hash: String::new(), offset, shape: shape.clone(), stride: stride.clone() };
            let need = content_store::bounds::required_bytes(&meta, ErrorKind::InvalidArgument).unwrap() as usize;
            let data = common::pattern(need + 3 * dtype.itemsize(), (code as u8).wrapping_add(i as u8));
            let name = format!("{}/v{i}", dtype.torch_name());
            let hash = w.write_tensor(&name, &data, dtype, offset, &shape, &stride).unwrap();
            expected.push((name, dtype, offset, shape, stride, data, hash));
        }
    }
    drop(w);
    let r = Reader::open(&root).unwrap();
    assert_eq!(r.format(), format);
    r.set_verify(true);
    let mut names: Vec<String> = expected.iter().map(|e| e.0.clone()).collect();
    names.sort();
    assert_eq!(r.list_tensors().unwrap(), names);
    for (name, dtype, offset, shape, stride, data, hash) in &expected {
        let t = r.read_tensor(name).unwrap();
        assert_eq!((&t.meta.dtype, &t.meta.offset, &t.meta.shape, &t.meta.stride), (dtype, offset, shape, stride), "{name}");
        assert_eq!(&t.meta.storage_hash, hash);
        assert_eq!(t.storage.bytes(), &data[..], "{name}");
        let expected_hash = content_store::hash_hex(data, format.hash_mode());
        assert_eq!(hash, &expected_hash);
    }
    let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.tensors as usize, expected.len());
}

#[test]
fn round_trip_every_dtype_and_view_native() {
    round_trip(Format::Native);
}

#[test]
fn round_trip_every_dtype_and_view_torch() {
    round_trip(Format::Torch);
}

#[test]
fn dedup_counts_reopen_and_second_writer() {
    let root = temp_store("dedup");
    let _c = Cleanup(root.clone());
    let a = common::pattern(100_000, 1);
    let b = common::pattern(100_000, 2);
    let w = Writer::open(&root, Format::Native).unwrap();
    let ha = w.write_storage(&a).unwrap();
    assert_eq!(w.write_storage(&a).unwrap(), ha);
    w.write_tensor("x", &a, Dtype::UInt8, 0, &[100_000], &[1]).unwrap();
    w.write_tensor("y", &b, Dtype::Int32, 0, &[25_000], &[1]).unwrap();
    let s = w.stats();
    assert_eq!((s.storages_written, s.storages_deduplicated, s.tensors_written, s.bytes_written), (2, 2, 2, 200_000));
    // A second writer at the same time, then a reopened one, add to it.
    let w2 = Writer::open(&root, Format::Native).unwrap();
    w2.write_tensor("z", &b, Dtype::Int32, 5, &[10], &[2]).unwrap();
    assert_eq!(w2.stats().storages_deduplicated, 1);
    drop((w, w2));
    let w3 = Writer::open(&root, Format::Native).unwrap();
    let c = common::pattern(10, 3);
    w3.write_tensor("nested/deeper/c", &c, Dtype::Int8, 0, &[10], &[1]).unwrap();
    assert_eq!(w3.stats().storages_written, 1);
    drop(w3);
    let r = Reader::open(&root).unwrap();
    assert_eq!(r.list_tensors().unwrap(), ["nested/deeper/c", "x", "y", "z"]);
    assert_eq!(r.list_storages().unwrap().len(), 3);
    assert!(root.join("tensors/nested/deeper/c").is_file());
    // The same storage read twice while in use is one mapping.
    let (x1, x2) = (r.read_tensor("y").unwrap(), r.read_tensor("z").unwrap());
    assert!(std::sync::Arc::ptr_eq(&x1.storage, &x2.storage));
    assert_eq!(x1.storage.bytes().as_ptr(), r.read_storage(&x1.meta.storage_hash).unwrap().bytes().as_ptr());
    // A format clash is refused.
    let e = Writer::open(&root, Format::Torch).err().unwrap();
    assert!(e.message().contains("holds a native store"), "{}", e.message());
}

#[test]
fn writers_in_threads_share_a_store() {
    let root = temp_store("threads");
    let _c = Cleanup(root.clone());
    let w = Writer::open(&root, Format::Native).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let w = &w;
            s.spawn(move || {
                for i in 0..20u8 {
                    let data = common::pattern(4096, i % 5);
                    w.write_tensor(&format!("t{t}/n{i}"), &data, Dtype::Float32, 0, &[1024], &[1]).unwrap();
                }
            });
        }
    });
    let s = w.stats();
    assert_eq!(s.tensors_written, 80);
    assert_eq!(s.storages_written + s.storages_deduplicated, 80);
    drop(w);
    let r = Reader::open(&root).unwrap();
    assert_eq!(r.list_storages().unwrap().len(), 5);
    assert!(content_store::verify(&r, &mut |_, _| {}).unwrap().problems.is_empty());
}

/// Native writers opening one fresh store at once all get it (the soak saw
/// one refused as a torch store: it found the folders another writer had
/// just made, and not yet that writer's marker). Many rounds, as it is a race.
#[test]
fn native_writers_opening_a_fresh_store_at_once_all_get_it() {
    for round in 0..200 {
        let root = temp_store("fresh-race");
        let _c = Cleanup(root.clone());
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let root = &root;
                s.spawn(move || {
                    let w = Writer::open(root, Format::Native).unwrap_or_else(|e| panic!("round {round}, writer {t}: {e}"));
                    w.write_storage(&common::pattern(64, t)).unwrap();
                });
            }
        });
    }
}

#[test]
fn bad_names_and_views_are_refused_by_the_writer() {
    let root = temp_store("badw");
    let _c = Cleanup(root.clone());
    let w = Writer::open(&root, Format::Native).unwrap();
    let data = vec![0u8; 64];
    for name in ["", "/abs", "a/../b", "..", "a//b", "a/", "nul\0x", "./x"] {
        let e = w.write_tensor(name, &data, Dtype::UInt8, 0, &[1], &[1]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{name:?}: {}", e.message());
    }
    for (offset, shape, stride, why) in [
        (0i64, vec![17i64], vec![1i64], "needs 68 bytes but storage"),
        (1, vec![16], vec![1], "needs 68 bytes"),
        (0, vec![4, 4], vec![5, 1], "needs 76 bytes"),
        (-1, vec![1], vec![1], "negative storage offset"),
        (0, vec![2], vec![-1], "negative stride"),
        (0, vec![-1], vec![1], "negative size"),
        (0, vec![2, 2], vec![1], "dimensions but stride"),
        (i64::MAX, vec![2], vec![i64::MAX], "overflows"),
    ] {
        let e = w.write_tensor("v", &data, Dtype::Float32, offset, &shape, &stride).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains(why), "{why}: {}", e.message());
    }
    // A name under an existing tensor, and a tensor over a folder.
    w.write_tensor("file", &data, Dtype::UInt8, 0, &[1], &[1]).unwrap();
    assert_eq!(w.write_tensor("file/x", &data, Dtype::UInt8, 0, &[1], &[1]).unwrap_err().kind(), ErrorKind::AlreadyExists);
    w.write_tensor("dir/x", &data, Dtype::UInt8, 0, &[1], &[1]).unwrap();
    assert_eq!(w.write_tensor("dir", &data, Dtype::UInt8, 0, &[1], &[1]).unwrap_err().kind(), ErrorKind::AlreadyExists);
    // Nothing was stored for the refused views.
    assert_eq!(w.stats().tensors_written, 2);
}

/// A store with one good tensor `t` (float32 [4,4]) for the readers below.
fn store_with_one_tensor(tag: &str) -> (PathBuf, String, Cleanup) {
    let root = temp_store(tag);
    let w = Writer::open(&root, Format::Native).unwrap();
    let hash = w.write_tensor("t", &common::pattern(64, 9), Dtype::Float32, 0, &[4, 4], &[4, 1]).unwrap();
    (root.clone(), hash, Cleanup(root))
}

#[test]
fn damaged_and_hostile_stores_are_refused_by_the_reader() {
    let (root, hash, _c) = store_with_one_tensor("hostile");
    let entry = root.join("tensors/t");
    let good = std::fs::read(&entry).unwrap();
    let r = Reader::open(&root).unwrap();
    let read_err = |name: &str| r.read_tensor(name).err().expect("must fail");

    // Truncated, altered, oversized records.
    std::fs::write(&entry, &good[..good.len() - 3]).unwrap();
    assert_eq!(read_err("t").kind(), ErrorKind::Corrupt);
    let mut flipped = good.clone();
    flipped[20] ^= 0x40;
    std::fs::write(&entry, &flipped).unwrap();
    assert!(read_err("t").message().contains("checksum"));
    std::fs::write(&entry, vec![b'S'; 10 << 20]).unwrap();
    let e = read_err("t");
    assert!(e.message().contains("more than the"), "{}", e.message());
    std::fs::write(&entry, &good).unwrap();
    r.read_tensor("t").unwrap();

    // Names that would leave the store, and storage names that are not hashes.
    for name in ["../ss-content-store", "/etc/passwd", "a//b", "x\0y"] {
        assert_eq!(read_err(name).kind(), ErrorKind::InvalidArgument, "{name:?}");
    }
    for h in ["../tensors/t", "", &hash.to_uppercase(), "0123"] {
        assert_eq!(r.read_storage(h).err().unwrap().kind(), ErrorKind::InvalidArgument, "{h:?}");
    }
    assert_eq!(read_err("missing").kind(), ErrorKind::NotFound);

    // Links are not followed, below the root, for entries, folders and storages.
    let outside = root.with_extension("outside");
    std::fs::write(&outside, &good).unwrap();
    symlink(&outside, root.join("tensors/link")).unwrap();
    assert_eq!(read_err("link").kind(), ErrorKind::Permission);
    std::fs::create_dir_all(root.with_extension("outdir")).unwrap();
    std::fs::write(root.with_extension("outdir").join("t"), &good).unwrap();
    symlink(root.with_extension("outdir"), root.join("tensors/linkdir")).unwrap();
    assert_eq!(read_err("linkdir/t").kind(), ErrorKind::Permission);
    assert!(!r.list_tensors().unwrap().iter().any(|n| n.starts_with("link")));
    let storage = root.join("storages").join(&hash);
    let bytes = std::fs::read(&storage).unwrap();
    std::fs::remove_file(&storage).unwrap();
    std::fs::write(&outside, &bytes).unwrap();
    symlink(&outside, &storage).unwrap();
    assert_eq!(read_err("t").kind(), ErrorKind::Permission);
    std::fs::remove_file(&storage).unwrap();

    // A FIFO does not block the reader.
    nix::unistd::mkfifo(&root.join("tensors/fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    assert_eq!(read_err("fifo").kind(), ErrorKind::Corrupt);

    // A storage smaller than its tensor's extent.
    std::fs::write(&storage, &bytes[..60]).unwrap();
    let e = read_err("t");
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.message().contains("needs 64 bytes but storage"), "{}", e.message());
    // A storage whose bytes do not match its name: found with verify on.
    let mut altered = bytes.clone();
    altered[0] ^= 1;
    std::fs::write(&storage, &altered).unwrap();
    drop(r);
    let r = Reader::open(&root).unwrap();
    r.read_tensor("t").unwrap();
    let r = Reader::open(&root).unwrap();
    r.set_verify(true);
    let e = r.read_tensor("t").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.message().contains("hash is"), "{}", e.message());
    let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
    let objects: Vec<&str> = report.problems.iter().map(|p| p.object.as_str()).collect();
    assert!(objects.contains(&format!("storages/{hash}").as_str()), "{objects:?}");
    for p in [outside, root.with_extension("outdir")] {
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir_all(&p);
    }
}

#[test]
fn damaged_torch_format_files_are_refused() {
    let root = temp_store("torch-damaged");
    let _c = Cleanup(root.clone());
    let w = Writer::open(&root, Format::Torch).unwrap();
    let data = common::pattern(4000, 5);
    let hash = w.write_tensor("t", &data, Dtype::Float32, 0, &[1000], &[1]).unwrap();
    assert_eq!(hash.len(), 40);
    w.write_tensor("small", &data[..400], Dtype::Float32, 0, &[100], &[1]).unwrap();
    drop(w);
    let r = Reader::open(&root).unwrap();
    assert_eq!(r.format(), Format::Torch);
    assert_eq!(r.read_tensor("t").unwrap().storage.bytes(), &data[..]);
    let entry = std::fs::read(root.join("tensors/t")).unwrap();
    let storage_path = root.join("storages").join(&hash);
    let storage = std::fs::read(&storage_path).unwrap();

    // Truncated entry and storage files, and junk in their place.
    for cut in [1, entry.len() / 2, entry.len() - 1] {
        std::fs::write(root.join("tensors/t"), &entry[..cut]).unwrap();
        let e = r.read_tensor("t").err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "cut {cut}: {}", e.message());
    }
    std::fs::write(root.join("tensors/t"), &entry).unwrap();
    for cut in [10, storage.len() / 2, storage.len() - 30] {
        std::fs::write(&storage_path, &storage[..cut]).unwrap();
        drop(r.read_storage(&hash).err());
        let fresh = Reader::open(&root).unwrap();
        let e = fresh.read_tensor("t").err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "cut {cut}: {}", e.message());
    }
    // An entry naming a storage smaller than its view.
    std::fs::write(&storage_path, &storage).unwrap();
    let small_hash = Reader::open(&root).unwrap().read_meta("small").unwrap().storage_hash;
    let big_view =
        content_store::TensorMeta { dtype: Dtype::Float32, storage_hash: small_hash, offset: 0, shape: vec![1000], stride: vec![1] };
    let crafted = storage_sharing::content_store::torch_format::tensor_file(&big_view);
    std::fs::write(root.join("tensors/crafted"), crafted).unwrap();
    let e = Reader::open(&root).unwrap().read_tensor("crafted").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.message().contains("needs 4000 bytes but storage"), "{}", e.message());
    // verify lists exactly the crafted entry.
    let report = content_store::verify(&Reader::open(&root).unwrap(), &mut |_, _| {}).unwrap();
    let objects: Vec<&str> = report.problems.iter().map(|p| p.object.as_str()).collect();
    assert_eq!(objects, ["tensors/crafted"]);
}

#[test]
fn unknown_dtype_and_marker_problems() {
    let (root, _hash, _c) = store_with_one_tensor("dtype");
    let entry = root.join("tensors/t");
    let mut rec = std::fs::read(&entry).unwrap();
    rec[12..16].copy_from_slice(&13i32.to_le_bytes());
    let n = rec.len() - 8;
    let sum = xxhash_rust::xxh3::xxh3_64(&rec[..n]);
    rec[n..].copy_from_slice(&sum.to_le_bytes());
    std::fs::write(&entry, &rec).unwrap();
    let e = Reader::open(&root).unwrap().read_tensor("t").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("unknown or unsupported dtype code 13"), "{}", e.message());
    std::fs::write(root.join("ss-content-store"), "storage-sharing content store\nversion 9\nhash sha1\n").unwrap();
    assert_eq!(Reader::open(&root).err().unwrap().kind(), ErrorKind::Unsupported);
    std::fs::write(root.join("ss-content-store"), vec![b'x'; 1 << 20]).unwrap();
    assert_eq!(Reader::open(&root).err().unwrap().kind(), ErrorKind::Corrupt);
    let empty = temp_store("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert_eq!(Reader::open(&empty).err().unwrap().kind(), ErrorKind::NotFound);
    let _ = std::fs::remove_dir_all(&empty);
    assert_eq!(Reader::open(Path::new("/nonexistent/ss-store")).err().unwrap().kind(), ErrorKind::NotFound);
}

#[test]
fn gc_drops_unreferenced_storages_and_waits_for_writers() {
    let root = temp_store("gc");
    let _c = Cleanup(root.clone());
    let w = Writer::open(&root, Format::Native).unwrap();
    let keep = w.write_tensor("keep", &common::pattern(1000, 1), Dtype::UInt8, 0, &[1000], &[1]).unwrap();
    let orphan = w.write_storage(&common::pattern(2000, 2)).unwrap();
    let e = content_store::gc(&root, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{}", e.message());
    drop(w);
    std::fs::write(root.join("storages/.ss-tmp-999999-0"), b"partial").unwrap();
    let dry = content_store::gc(&root, true).unwrap();
    assert_eq!(dry.storages, vec![(orphan.clone(), 2000)]);
    assert!(root.join("storages").join(&orphan).exists());
    let report = content_store::gc(&root, false).unwrap();
    assert_eq!(report.storages.len(), 1);
    assert_eq!(report.temp_files.len(), 1);
    assert_eq!(report.kept_storages, 1);
    assert!(!root.join("storages").join(&orphan).exists());
    assert!(root.join("storages").join(&keep).exists());
    // An unreadable entry stops gc: its storage might be needed.
    std::fs::write(root.join("tensors/bad"), b"junk").unwrap();
    let e = content_store::gc(&root, false).unwrap_err();
    assert!(e.message().contains("gc refused"), "{}", e.message());
    assert!(root.join("storages").join(&keep).exists());
}

#[test]
fn fast_hash_is_parallel_safe_and_stable_hash_is_sha1() {
    let data = common::pattern(9 << 20, 4);
    let h = content_store::hash_hex(&data, HashMode::Fast);
    assert_eq!(h.len(), 32);
    for _ in 0..3 {
        assert_eq!(content_store::hash_hex(&data, HashMode::Fast), h);
    }
    assert_eq!(
        content_store::hash_hex(b"The quick brown fox jumps over the lazy dog", HashMode::Stable),
        "2fd4e1c67a2d28fced849ee1bb76e7391b93eb12"
    );
}

/// Child: writes tensors into the store in a loop until killed.
fn writer_loop(root: &str, seed: u64) {
    let w = Writer::open(Path::new(root), Format::Native).unwrap();
    let mut x = seed | 1;
    println!("ready");
    for i in 0.. {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % (3 << 20)) as usize + 1;
        let data = common::pattern(len, (x >> 40) as u8);
        let name = format!("w{seed}/{}/t{i}", i % 7);
        w.write_tensor(&name, &data, Dtype::UInt8, 0, &[len as i64], &[1]).unwrap();
    }
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = common::my_role() else { return };
    match role.as_str() {
        "writer_loop" => writer_loop(&args[0], args[1].parse().unwrap()),
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn writers_killed_with_sigkill_leave_no_corrupt_object() {
    let root = temp_store("kill9");
    let _c = Cleanup(root.clone());
    Writer::open(&root, Format::Native).unwrap();
    let mut rng = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    for round in 0..4u64 {
        let mut children: Vec<std::process::Child> = (0..3u64)
            .map(|k| {
                common::child_command("writer_loop", &[root.to_str().unwrap(), &(round * 10 + k + 1).to_string()])
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(150 + rng % 400));
        for c in &mut children {
            c.kill().unwrap();
        }
        for c in &mut children {
            c.wait().unwrap();
        }
        let r = Reader::open(&root).unwrap();
        let report = content_store::verify(&r, &mut |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "round {round}: {:?}", report.problems);
        for name in r.list_tensors().unwrap() {
            r.read_tensor(&name).unwrap();
        }
    }
    let r = Reader::open(&root).unwrap();
    assert!(!r.list_tensors().unwrap().is_empty(), "the writers wrote nothing before being killed");
    let tensors = r.list_tensors().unwrap().len();
    let gc = content_store::gc(&root, false).unwrap();
    println!(
        "killed 12 writers: {tensors} tensors survive, gc removed {} temporary files and {} storages",
        gc.temp_files.len(),
        gc.storages.len()
    );
    let report = content_store::verify(&Reader::open(&root).unwrap(), &mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let mut temp = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if e.file_name().to_string_lossy().starts_with(".ss-tmp-") {
                temp.push(e.path());
            }
        }
    }
    assert!(temp.is_empty(), "gc left temporary files: {temp:?}");
}

/// Replaces a store object with something `verify` and `gc` cannot read
/// as a regular record, then puts it back.
#[derive(Clone, Copy, Debug)]
enum Odd {
    LinkToEntry,
    Fifo,
    LinkedFolder,
}

fn odd_entries_block_gc_and_fail_verify(format: Format) {
    let root = temp_store(&format!("odd-{}", format.name()));
    let _c = Cleanup(root.clone());
    let outside = root.with_extension("outside");
    let _o = Cleanup(outside.clone());
    let w = Writer::open(&root, format).unwrap();
    w.write_tensor("keep", &common::pattern(64, 1), Dtype::Float32, 0, &[16], &[1]).unwrap();
    let moved = w.write_tensor("moved", &common::pattern(64, 2), Dtype::Float32, 0, &[16], &[1]).unwrap();
    let deep = w.write_tensor("deep/x", &common::pattern(64, 3), Dtype::Float32, 0, &[16], &[1]).unwrap();
    drop(w);
    for odd in [Odd::LinkToEntry, Odd::Fifo, Odd::LinkedFolder] {
        std::fs::create_dir_all(&outside).unwrap();
        let (object, hash) = match odd {
            Odd::LinkToEntry | Odd::Fifo => ("tensors/moved", &moved),
            Odd::LinkedFolder => ("tensors/deep", &deep),
        };
        let real = root.join(object);
        let away = outside.join("away");
        std::fs::rename(&real, &away).unwrap();
        match odd {
            Odd::LinkToEntry | Odd::LinkedFolder => symlink(&away, &real).unwrap(),
            Odd::Fifo => nix::unistd::mkfifo(&real, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap(),
        }

        let report = content_store::verify(&Reader::open(&root).unwrap(), &mut |_, _| {}).unwrap();
        let objects: Vec<&str> = report.problems.iter().map(|p| p.object.as_str()).collect();
        assert!(objects.contains(&object), "{format:?} {odd:?}: verify must report {object}: {:?}", report.problems);
        for dry_run in [true, false] {
            let e = content_store::gc(&root, dry_run).err().unwrap_or_else(|| panic!("{format:?} {odd:?}: gc ran on a partial view"));
            assert!(e.message().contains("gc refused") && e.message().contains(object), "{format:?} {odd:?}: {}", e.message());
        }
        assert!(root.join("storages").join(hash).exists(), "{format:?} {odd:?}: gc removed a referenced storage");

        // Put back: every entry reads again.
        std::fs::remove_file(&real).unwrap();
        std::fs::rename(&away, &real).unwrap();
        let r = Reader::open(&root).unwrap();
        for name in ["keep", "moved", "deep/x"] {
            r.read_tensor(name).unwrap_or_else(|e| panic!("{format:?} {odd:?}: {name}: {}", e.message()));
        }
        assert!(content_store::verify(&r, &mut |_, _| {}).unwrap().problems.is_empty());
        let _ = std::fs::remove_dir_all(&outside);
    }
    assert_eq!(content_store::gc(&root, false).unwrap().kept_storages, 3);
}

#[test]
fn links_fifos_and_linked_folders_block_gc_and_fail_verify_native() {
    odd_entries_block_gc_and_fail_verify(Format::Native);
}

#[test]
fn links_fifos_and_linked_folders_block_gc_and_fail_verify_torch() {
    odd_entries_block_gc_and_fail_verify(Format::Torch);
}
