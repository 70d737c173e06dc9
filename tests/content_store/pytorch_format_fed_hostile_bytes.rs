//! The torch.save readers of the content store fed hostile bytes: the zip
//! reader, the restricted unpickler, and the two file readers on top.
//!
//! First the committed corpus (tests/corpus/torch_format/: `*.zip` files
//! and raw `*.pkl` pickles; names starting `ok_` must be accepted, all
//! others refused), then random and mutated inputs. Properties: never a
//! panic; every refusal is a typed error (`Corrupt`, or `Unsupported` for a
//! big-endian file or a conj/neg view); what is accepted re-encodes to the
//! same value; the zip reader's entries are in bounds, disjoint and
//! uniquely named, and every entry's CRC and sizes agree between central
//! directory, local header and data descriptor; the unpickler admits only
//! its own opcodes and globals and never calls anything but torch.Size.
//!
//! More cases: PROPTEST_CASES=100000 cargo test --release --test pytorch_format_fed_hostile_bytes

use proptest::prelude::*;
use std::collections::HashSet;
use std::path::PathBuf;
use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::content_store::meta::TensorMeta;
use storage_sharing::content_store::torch_format::unpickle::{global_name, unpickle, Allow, Value};
use storage_sharing::content_store::torch_format::zip::{read_entries, ZipWriter};
use storage_sharing::content_store::torch_format::{parse_tensor_file, storage_data_range, storage_file, tensor_file};
use storage_sharing::ErrorKind;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/torch_format")
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(corpus_dir()).unwrap().flatten().map(|e| e.path()).collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus");
    files.into_iter().map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap())).collect()
}

fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

fn sample_meta() -> TensorMeta {
    TensorMeta { dtype: Dtype::Float32, storage_hash: "ab12".into(), offset: 3, shape: vec![2, 3], stride: vec![3, 1] }
}

fn seed_files() -> Vec<Vec<u8>> {
    let big = TensorMeta {
        dtype: Dtype::Int64,
        storage_hash: "ff".repeat(20),
        offset: 70000,
        shape: vec![1, 2, 3, 4],
        stride: vec![24, 12, 4, 1],
    };
    vec![tensor_file(&sample_meta()), tensor_file(&big), storage_file(&[7u8; 200]), storage_file(b"")]
}

/// The zip reader's promises for any bytes. Returns whether it accepted.
fn check_zip(file: &[u8]) -> bool {
    match read_entries(file) {
        Ok(entries) => {
            let mut names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), entries.len(), "duplicate names accepted");
            let mut spans: Vec<_> = entries.iter().map(|e| e.data.clone()).collect();
            spans.sort_by_key(|r| r.start);
            for w in spans.windows(2) {
                assert!(w[0].end <= w[1].start, "overlapping data accepted: {:?} {:?}", w[0], w[1]);
            }
            assert!(spans.iter().all(|r| r.start <= r.end && r.end <= file.len()));
            // Re-encode: the same records written again read back the same.
            let mut z = ZipWriter::new(Vec::new());
            for e in &entries {
                z.add(&e.name, &file[e.data.clone()]).unwrap();
            }
            let again = z.finish().unwrap();
            let back = read_entries(&again).unwrap();
            assert_eq!(back.len(), entries.len());
            for (a, b) in entries.iter().zip(&back) {
                assert_eq!(a.name, b.name);
                assert_eq!(&file[a.data.clone()], &again[b.data.clone()]);
                assert!(b.crc_ok(&again));
            }
            true
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
            false
        }
    }
}

/// The file readers' promises for any bytes: typed refusals; an accepted
/// tensor entry re-encodes to an equal one; an accepted storage file's
/// range is in bounds and holds what the file's pickle says.
fn check_file(file: &[u8]) -> (bool, bool) {
    let tensor = match parse_tensor_file(file) {
        Ok(m) => {
            assert_eq!(parse_tensor_file(&tensor_file(&m)).unwrap(), m);
            assert!(m.offset >= 0 && m.shape.len() == m.stride.len());
            let e = read_entries(file).unwrap();
            assert!(e.iter().filter(|e| e.name.ends_with("/data.pkl")).all(|e| e.crc_ok(file)), "data.pkl read despite a wrong CRC");
            true
        }
        Err(e) => {
            assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Unsupported), "{e}");
            false
        }
    };
    let storage = match storage_data_range(file) {
        Ok(r) => {
            assert!(r.start <= r.end && r.end <= file.len());
            let again = storage_file(&file[r.clone()]);
            let r2 = storage_data_range(&again).unwrap();
            assert_eq!(&again[r2], &file[r]);
            true
        }
        Err(e) => {
            assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Unsupported), "{e}");
            false
        }
    };
    check_zip(file);
    (tensor, storage)
}

// ---- a pickler for any value the unpickler returns (test-only) ----------

/// Encodes `v` with the unpickler's own opcodes (no memo); `depth` counts
/// the values and marks on the stack, which must stay within the
/// unpickler's bound for the round trip to be fair.
fn enc(v: &Value, out: &mut Vec<u8>, stack: usize, max: &mut usize) {
    *max = (*max).max(stack + 1);
    match v {
        Value::Int(i) if (0..=255).contains(i) => out.extend_from_slice(&[b'K', *i as u8]),
        Value::Int(i) if i32::try_from(*i).is_ok() => {
            out.push(b'J');
            out.extend_from_slice(&(*i as i32).to_le_bytes());
        }
        Value::Int(i) => {
            out.extend_from_slice(&[0x8a, 8]);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
        Value::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Value::Tuple(_) => {
            let items = v.as_tuple().unwrap();
            if items.is_empty() {
                out.push(b')');
            } else {
                out.push(b'(');
                for (i, it) in items.iter().enumerate() {
                    enc(it, out, stack + 1 + i, max);
                }
                out.push(b't');
            }
        }
        Value::Dict(d) => {
            out.push(b'}');
            for (k, val) in &d.pairs {
                enc(k, out, stack + 1, max);
                enc(val, out, stack + 2, max);
                out.push(b's');
            }
        }
        Value::Global(g) => {
            let full = global_name(*g);
            let (m, n) = full.rsplit_once('.').unwrap();
            out.push(b'c');
            out.extend_from_slice(format!("{m}\n{n}\n").as_bytes());
        }
        Value::Size(dims) => {
            out.extend_from_slice(b"ctorch\nSize\n((");
            for (i, d) in dims.iter().enumerate() {
                enc(&Value::Int(*d), out, stack + 3 + i, max);
            }
            out.extend_from_slice(b"ttR");
        }
        Value::Storage(s) => {
            out.extend_from_slice(b"(X\x07\0\0\0storagectorch.storage\nUntypedStorage\n");
            for (i, part) in [s.key.as_str(), s.location.as_str()].iter().enumerate() {
                enc(&Value::Str((*part).into()), out, stack + 3 + i, max);
            }
            enc(&Value::Int(s.nbytes as i64), out, stack + 5, max);
            out.extend_from_slice(b"tQ");
        }
    }
}

/// Whether a storage reference is anywhere inside `v` (each shared tuple
/// visited once).
fn has_storage(v: &Value, seen: &mut HashSet<usize>) -> bool {
    match v {
        Value::Storage(_) => true,
        Value::Tuple(t) => seen.insert(std::rc::Rc::as_ptr(t) as usize) && t.items.iter().any(|i| has_storage(i, seen)),
        Value::Dict(d) => d.pairs.iter().any(|(k, v)| has_storage(k, seen) || has_storage(v, seen)),
        _ => false,
    }
}

/// Counts the tree's nodes against `budget`; false once it runs out.
fn nodes(v: &Value, budget: &mut usize) -> bool {
    if *budget == 0 {
        return false;
    }
    *budget -= 1;
    match v {
        Value::Tuple(_) => v.as_tuple().unwrap().iter().all(|i| nodes(i, budget)),
        Value::Dict(d) => d.pairs.iter().all(|(k, v)| nodes(k, budget) && nodes(v, budget)),
        _ => true,
    }
}

const ALLOWED_OPCODES: &[u8] = &[
    0x80, b'(', b'.', b'c', b'q', b'r', b'h', b'j', b'X', b'J', b'K', b'M', 0x8a, b't', 0x85, 0x86, 0x87, b')', b'}', b's', b'u', 0x88,
    0x89, b'R', b'Q',
];

/// The unpickler's promises for any bytes, in both modes: refusals are
/// `Corrupt` naming the byte; what it accepts, pickled again, reads back
/// equal; a storage reference only in storage-file mode.
fn check_pickle(pkl: &[u8]) -> [bool; 2] {
    let mut ok = [false; 2];
    for (i, allow) in [Allow::TensorEntry, Allow::StorageFile].into_iter().enumerate() {
        match unpickle(pkl, allow) {
            Ok(v) => {
                ok[i] = true;
                let mut out = vec![0x80, 2];
                let mut max = 0;
                // Memo sharing can make a tree far bigger than its pickle:
                // re-encode (without sharing) only trees of modest size.
                let small = nodes(&v, &mut 100_000);
                if small {
                    enc(&v, &mut out, 0, &mut max);
                }
                out.push(b'.');
                if small && max < 1000 {
                    assert_eq!(unpickle(&out, allow).unwrap_or_else(|e| panic!("{v:?} re-pickled is refused: {e}")), v);
                }
                if allow == Allow::TensorEntry {
                    assert!(!has_storage(&v, &mut HashSet::new()), "a storage reference in a tensor entry: {v:?}");
                }
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
                assert!(e.message().starts_with("pickle"), "{}", e.message());
            }
        }
    }
    ok
}

/// A torch.save-shaped zip around `pkl` (and a storage record).
fn zip_around(pkl: &[u8], data: Option<&[u8]>) -> Vec<u8> {
    let mut z = ZipWriter::new(Vec::new());
    z.add("archive/data.pkl", pkl).unwrap();
    z.add("archive/byteorder", b"little").unwrap();
    if let Some(d) = data {
        z.add("archive/data/0", d).unwrap();
    }
    z.add("archive/version", b"3\n").unwrap();
    z.finish().unwrap()
}

#[test]
fn torch_format_corpus() {
    for (name, data) in corpus() {
        let r = std::panic::catch_unwind(|| {
            if name.ends_with(".pkl") {
                let ok = check_pickle(&data);
                // A storage pickle gets a data record of the size it names.
                let n = match unpickle(&data, Allow::StorageFile) {
                    Ok(Value::Storage(s)) if s.nbytes < 1 << 20 => s.nbytes as usize,
                    _ => 16,
                };
                let (t, s) = check_file(&zip_around(&data, Some(&vec![0u8; n])));
                (ok[0] || ok[1], t || s)
            } else {
                let z = check_zip(&data);
                let (t, s) = check_file(&data);
                (z, t || s)
            }
        });
        let (parsed, file_ok) = r.unwrap_or_else(|_| panic!("corpus input {name} broke a reader"));
        if name.starts_with("ok_") {
            assert!(parsed && (file_ok || name.contains("_zip_only")), "corpus input {name} should be accepted");
        } else if name.starts_with("bad_zip_") || name.starts_with("regression_zip_") {
            assert!(!parsed, "corpus input {name} should be refused by the zip reader");
        } else {
            assert!(!file_ok, "corpus input {name} should be refused");
        }
    }
}

/// The classic hostile pickles: each names or reaches something arbitrary
/// and is refused before anything is built from it.
#[test]
fn hostile_pickles_are_refused_by_name() {
    let cases: &[(&[u8], &str)] = &[
        (b"\x80\x02cos\nsystem\nX\x02\0\0\0id\x85R.", "GLOBAL os.system is refused"),
        (b"\x80\x02cbuiltins\neval\nX\x01\0\0\x001\x85R.", "GLOBAL builtins.eval is refused"),
        (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n).", "GLOBAL torch._utils._rebuild_tensor_v2"),
        (b"\x80\x02ctorch\nload\n.", "torch.load is not a dtype"),
        (b"\x80\x02ctorch\nfloat32\n)R.", "only torch.Size may be called"),
        (b"\x80\x02ctorch\nSize\nX\x01\0\0\0a\x85\x85R.", "not an int"),
        (b"\x80\x02\x8c\x02os\x8c\x06system\x93.", "SHORT_BINUNICODE"),
        (b"\x80\x02X\x02\0\0\0osX\x06\0\0\0system\x93.", "STACK_GLOBAL"),
        (b"\x80\x02ctorch\nSize\n)\x81.", "NEWOBJ"),
        (b"\x80\x02}X\x01\0\0\0a}b.", "BUILD"),
        (b"\x80\x02(ios\nsystem\n.", "INST"),
        (b"\x80\x02\x82\x01.", "EXT1"),
        (b"\x80\x02P1\n.", "PERSID"),
        (b"\x80\x02]q\0.", "EMPTY_LIST"),
        (b"\x80\x02X\xff\xff\xff\x7f.", "string of 2147483647 bytes"),
        (b"\x80\x02K\x01\x80\x02.", "PROTO after the start"),
    ];
    for (pkl, why) in cases {
        for allow in [Allow::TensorEntry, Allow::StorageFile] {
            let e = unpickle(pkl, allow).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt);
            assert!(e.message().contains(why), "{why}: {}", e.message());
        }
    }
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn random_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        prop_assert_eq!(check_file(&bytes), (false, false));
    }

    /// Real files with a few bytes changed and the end cut: through the
    /// zip reader (the CRC stops most edits of data.pkl, on purpose).
    #[test]
    fn mutated_files(which in 0usize..4, edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in 0usize..4) {
        let mut f = seed_files()[which].clone();
        for (at, b) in edits {
            let i = at % f.len();
            f[i] = b;
        }
        f.truncate(f.len() - cut.min(f.len()));
        check_file(&f);
    }

    /// Edits aimed at the zip structure: the local headers, data
    /// descriptors, central directory and end records (the last 300
    /// bytes and every 64-byte boundary region).
    #[test]
    fn mutated_zip_structure(which in 0usize..4, edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<bool>()), 1..4)) {
        let mut f = seed_files()[which].clone();
        let n = f.len();
        for (at, b, tail) in edits {
            let i = if tail { n - 1 - at % 300.min(n) } else { (at % (n / 64 + 1)) * 64 + at % 48 } % n;
            f[i] = b;
        }
        check_zip(&f);
        check_file(&f);
    }

    /// The same records with every 16-bit and 32-bit field of the end
    /// records set to edge values (0, the zip64 marks, huge).
    #[test]
    fn zip_end_record_fields(which in 0usize..4, at in 0usize..120, v in prop::sample::select(vec![0u64, 1, 0xFFFF, 0xFFFF_FFFF, 0x7FFF_FFFF, u64::MAX, 1 << 40]), width in prop::sample::select(vec![2usize, 4, 8])) {
        let mut f = seed_files()[which].clone();
        let i = f.len() - 1 - at;
        let end = (i + width).min(f.len());
        let bytes = v.to_le_bytes();
        f[i..end].copy_from_slice(&bytes[..end - i]);
        check_zip(&f);
        check_file(&f);
    }
}

/// One opcode of a generated pickle: mostly the unpickler's own, with
/// plausible arguments, sometimes any byte.
fn pickle_op() -> impl Strategy<Value = Vec<u8>> {
    let global = prop_oneof![
        Just("torch\nSize\n".to_string()),
        Just("torch\nfloat32\n".to_string()),
        Just("torch\nbfloat16\n".to_string()),
        Just("torch.storage\nUntypedStorage\n".to_string()),
        Just("os\nsystem\n".to_string()),
        Just("torch\nTensor\n".to_string()),
        "[a-z._]{0,12}\n[A-Za-z0-9_]{0,12}\n",
    ];
    prop_oneof![
        4 => prop::sample::select(vec![b'(', b't', 0x85, 0x86, 0x87, b')', b'}', b's', b'u', 0x88, 0x89, b'R', b'Q']).prop_map(|o| vec![o]),
        2 => any::<u8>().prop_map(|v| vec![b'K', v]),
        1 => any::<i32>().prop_map(|v| [&[b'J'][..], &v.to_le_bytes()].concat()),
        1 => any::<u16>().prop_map(|v| [&[b'M'][..], &v.to_le_bytes()].concat()),
        1 => (0u8..10, any::<u64>()).prop_map(|(n, v)| [&[0x8a, n][..], &v.to_le_bytes()[..(n as usize).min(8)]].concat()),
        2 => "[0-9a-f]{0,6}|storage|cpu|0|conj|neg".prop_map(|s| [&[b'X'][..], &(s.len() as u32).to_le_bytes(), s.as_bytes()].concat()),
        2 => global.prop_map(|g| [&[b'c'][..], g.as_bytes()].concat()),
        1 => (0u8..4).prop_map(|i| vec![b'q', i]),
        1 => (0u8..4).prop_map(|i| vec![b'h', i]),
        1 => any::<u8>().prop_map(|o| vec![o]),
    ]
}

proptest! {
    #![proptest_config(config(4000))]

    /// Generated pickles: refused with a typed error or read, and what is
    /// read pickles again to an equal value.
    #[test]
    fn generated_pickles(ops in proptest::collection::vec(pickle_op(), 0..24), stop in any::<bool>()) {
        let mut pkl = vec![0x80, 2];
        for o in &ops {
            pkl.extend_from_slice(o);
        }
        if stop {
            pkl.push(b'.');
        }
        check_pickle(&pkl);
    }

    /// Real pickles of both kinds, mutated (no CRC in the way).
    #[test]
    fn mutated_pickles(which in 0usize..4, edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in 0usize..16) {
        let file = &seed_files()[which];
        let e = read_entries(file).unwrap();
        let mut pkl = file[e[0].data.clone()].to_vec();
        for (at, b) in edits {
            let i = at % pkl.len();
            pkl[i] = b;
        }
        pkl.truncate(pkl.len().saturating_sub(cut));
        check_pickle(&pkl);
        check_file(&zip_around(&pkl, Some(&[1u8; 24])));
    }

    /// Any opcode outside the unpickler's own is refused by name, at once,
    /// whatever follows it.
    #[test]
    fn foreign_opcodes_are_refused(code in prop::sample::select((0..=255u8).filter(|c| !ALLOWED_OPCODES.contains(c)).collect::<Vec<u8>>()),
                                   tail in proptest::collection::vec(any::<u8>(), 0..16)) {
        let pkl = [&[0x80, 2, code][..], &tail].concat();
        for allow in [Allow::TensorEntry, Allow::StorageFile] {
            let e = unpickle(&pkl, allow).unwrap_err();
            prop_assert!(e.message().starts_with("pickle byte 2: opcode") && e.message().contains("not allowed"), "{}", e.message());
        }
    }

    /// A GLOBAL is admitted only for torch.Size, a torch dtype, and
    /// torch.storage.UntypedStorage in a storage file.
    #[test]
    fn only_known_globals(module in prop_oneof![Just("torch".to_string()), Just("torch.storage".to_string()), Just("builtins".to_string()), "[a-z_.]{1,12}"],
                          name in prop_oneof![Just("Size".to_string()), Just("float32".to_string()), Just("UntypedStorage".to_string()), Just("eval".to_string()), "[A-Za-z0-9_]{1,12}"]) {
        let pkl = [b"\x80\x02c".as_slice(), format!("{module}\n{name}\n").as_bytes(), b"."].concat();
        for allow in [Allow::TensorEntry, Allow::StorageFile] {
            let want = match (module.as_str(), name.as_str()) {
                ("torch", "Size") => true,
                ("torch", n) => Dtype::from_torch_name(n).is_ok(),
                ("torch.storage", "UntypedStorage") => allow == Allow::StorageFile,
                _ => false,
            };
            prop_assert_eq!(unpickle(&pkl, allow).is_ok(), want, "{}.{}", module, name);
        }
    }
}

/// Writes the seed inputs of tests/corpus/torch_format (the ok_* files
/// and the structural regressions):
/// `cargo test --release --test pytorch_format_fed_hostile_bytes -- --ignored write_seed_corpus`.
#[test]
#[ignore = "writes the committed seed corpus"]
fn write_seed_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let put = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).unwrap();
    let tensor = tensor_file(&sample_meta());
    let storage = storage_file(&[7u8; 200]);
    put("ok_tensor_entry.zip", &tensor);
    put("ok_storage_file.zip", &storage);
    put("ok_storage_empty.zip", &storage_file(b""));
    let pkl = |f: &[u8]| f[read_entries(f).unwrap()[0].data.clone()].to_vec();
    put("ok_tensor_entry.pkl", &pkl(&tensor));
    put("ok_storage_file.pkl", &pkl(&storage));

    // Local header flags of the first record (offset 6): encrypted, while
    // the central directory says it is not. Refused since the fix.
    let mut f = tensor.clone();
    f[6] |= 1;
    put("regression_zip_local_encrypted_flag.zip", &f);
    // The data descriptor's CRC (after data.pkl) disagrees with the
    // central directory's. Refused since the fix.
    let e = read_entries(&tensor).unwrap();
    let mut f = tensor.clone();
    let d = e[0].data.end;
    assert_eq!(&f[d..d + 4], b"PK\x07\x08");
    f[d + 4] ^= 0xff;
    put("regression_zip_descriptor_crc_mismatch.zip", &f);
    let mut f = tensor.clone();
    f[d + 8] ^= 1;
    put("regression_zip_descriptor_size_mismatch.zip", &f);
    // No descriptor where the flag says one follows: the next record's
    // header starts right after the data.
    let mut f = tensor.clone();
    f[d..d + 16].copy_from_slice(&[0; 16]);
    put("regression_zip_descriptor_missing.zip", &f);
    // A CRC in the local header that is not the central directory's.
    let mut f = tensor.clone();
    f[14..18].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    put("regression_zip_local_crc_mismatch.zip", &f);

    // Central directory edits (entry 0 starts at the directory offset).
    let eocd = tensor.len() - 22;
    let cd = u32::from_le_bytes(tensor[eocd + 16..eocd + 20].try_into().unwrap()) as usize;
    let central = |at: usize, v: &[u8]| {
        let mut f = tensor.clone();
        f[cd + at..cd + at + v.len()].copy_from_slice(v);
        f
    };
    put("bad_zip_central_encrypted.zip", &central(8, &[1, 0]));
    put("regression_zip_central_strong_encryption.zip", &central(8, &[0x40, 0x08]));
    put("bad_zip_compressed.zip", &central(10, &[8, 0]));
    put("bad_zip_size_past_directory.zip", &central(20, &0x7fff_ffffu32.to_le_bytes()));
    put("bad_zip_header_offset_past_records.zip", &central(42, &(cd as u32).to_le_bytes()));
    let mut huge = central(20, &[0xff; 8]);
    huge[cd + 30..cd + 32].copy_from_slice(&[0, 0]);
    put("bad_zip_zip64_sizes_without_field.zip", &huge);
    put("bad_zip_header_offset_into_data.zip", &central(42, &((e[0].data.start) as u32).to_le_bytes()));
    // End records.
    // 0xFFFF in the classic record means "see the zip64 record": valid.
    let mut f = tensor.clone();
    f[eocd + 10..eocd + 12].copy_from_slice(&[0xff, 0xff]);
    put("ok_zip64_count_mark.zip", &f);
    let z64 = eocd - 20 - 56;
    f[z64 + 32..z64 + 40].copy_from_slice(&(1u64 << 60).to_le_bytes());
    put("bad_zip_entry_count_huge.zip", &f);
    let mut f = tensor.clone();
    let loc = eocd - 20;
    f[loc + 8..loc + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    put("bad_zip_zip64_locator_out_of_range.zip", &f);
    let mut two = ZipWriter::new(Vec::new());
    two.add("archive/data.pkl", b"x").unwrap();
    two.add("archive/data.pkl", b"y").unwrap();
    put("bad_zip_duplicate_names.zip", &two.finish().unwrap());
    put("bad_zip_end_record_only.zip", &tensor[eocd..]);
    put("bad_zip_empty.zip", b"");

    // Valid zips whose pickles are hostile (the zip CRCs are right).
    let wrap = |p: &[u8]| zip_around(p, None);
    put("bad_pickle_os_system.zip", &wrap(b"\x80\x02cos\nsystem\nX\x02\0\0\0id\x85R."));
    put("bad_pickle_rebuild_tensor.zip", &wrap(b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n)R."));
    put("bad_pickle_storage_in_tensor_entry.zip", &wrap(&pkl(&storage)));
    put("bad_big_endian.zip", &{
        let mut z = ZipWriter::new(Vec::new());
        z.add("archive/data.pkl", &pkl(&tensor)).unwrap();
        z.add("archive/byteorder", b"big").unwrap();
        z.finish().unwrap()
    });
    put("bad_pickle_stack_global.pkl", b"\x80\x02\x8c\x02os\x8c\x06system\x93.");
    put("bad_pickle_build.pkl", b"\x80\x02}X\x01\0\0\0a}b.");
    put("bad_pickle_reduce_dtype.pkl", b"\x80\x02ctorch\nfloat32\n)R.");
    put("bad_pickle_huge_string.pkl", b"\x80\x02X\xff\xff\xff\x7f.");
    put("bad_pickle_huge_memo.pkl", b"\x80\x02K\x01r\xff\xff\xff\xff.");
    put("bad_pickle_deep_tuples.pkl", b"\x80\x02K\x01\x85\x85\x85\x85\x85\x85.");
    put("bad_pickle_get_dict.pkl", b"\x80\x02}q\x00h\x00\x86.");
    put("regression_pickle_proto_mid_stream.pkl", b"\x80\x02K\x01\x80\x02.");
}
