//! Round trips, files PyTorch wrote (tests/fixtures/torch_content_store),
//! and hostile input. The fuzz-style tests are in
//! tests/content_store/pytorch_format_fed_hostile_bytes.rs; the live interop test with torch in
//! tests/content_store/pytorch_format_interop.rs.

use super::pickle::{op, Pickler};
use super::unpickle::{unpickle, Allow};
use super::*;
use crate::content_store::dtype::Dtype;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch_content_store/");

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}{name}")).unwrap()
}

fn meta(dtype: Dtype, offset: i64, shape: &[i64], stride: &[i64]) -> TensorMeta {
    TensorMeta {
        dtype,
        storage_hash: "6278d6c01b8699d104ac94d901b57c331fb79e17".to_string(),
        offset,
        shape: shape.to_vec(),
        stride: stride.to_vec(),
    }
}

fn data_pkl(file: &[u8]) -> Vec<u8> {
    let entries = zip::read_entries(file).unwrap();
    let e = entries.iter().find(|e| e.name.ends_with("/data.pkl")).unwrap();
    file[e.data.clone()].to_vec()
}

/// Wraps a pickle in a torch.save-shaped zip, as a hostile file would be.
fn zip_with_pickle(pkl: &[u8]) -> Vec<u8> {
    let mut z = ZipWriter::new(Vec::new());
    z.add("archive/data.pkl", pkl).unwrap();
    z.add("archive/version", b"3\n").unwrap();
    z.finish().unwrap()
}

fn tensor_err(pkl: &[u8]) -> Error {
    parse_tensor_file(&zip_with_pickle(pkl)).unwrap_err()
}

#[test]
fn storage_round_trip_every_size() {
    for len in [0usize, 1, 3, 63, 64, 65, 4096, 100_003] {
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + 7) as u8).collect();
        let file = storage_file(&data);
        let r = storage_data_range(&file).unwrap();
        assert_eq!(&file[r.clone()], &data[..], "len {len}");
        assert_eq!(r.start % 64, 0, "len {len}: data not 64-aligned");
    }
}

#[test]
fn storage_file_is_deterministic() {
    assert_eq!(storage_file(b"abc"), storage_file(b"abc"));
    assert_ne!(storage_file(b"abc"), storage_file(b"abd"));
}

#[test]
fn storage_pickle_is_byte_identical_to_torch() {
    // data.pkl of torch.save(torch.arange(24, dtype=torch.float32).untyped_storage()).
    let torch_pkl = data_pkl(&fixture("storage_arange24_f32"));
    assert_eq!(storage_pickle(96), torch_pkl);
}

#[test]
fn reads_a_storage_file_torch_wrote() {
    let file = fixture("storage_arange24_f32");
    let r = storage_data_range(&file).unwrap();
    let floats: Vec<f32> = file[r].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(floats, (0..24).map(|i| i as f32).collect::<Vec<_>>());
}

#[test]
fn tensor_pickle_is_byte_identical_to_torch() {
    // The entry of arange(24.).reshape(2,3,4).transpose(0,2)[1:] in a store.
    let torch_pkl = data_pkl(&fixture("tensor_f32_transposed_offset1"));
    assert_eq!(tensor_pickle(&meta(Dtype::Float32, 1, &[3, 3, 2], &[1, 4, 12]), ViewBits::default()), torch_pkl);
}

#[test]
fn reads_a_tensor_entry_torch_wrote() {
    let m = parse_tensor_file(&fixture("tensor_f32_transposed_offset1")).unwrap();
    assert_eq!(m, meta(Dtype::Float32, 1, &[3, 3, 2], &[1, 4, 12]));
}

#[test]
fn conjugate_views_are_read_with_their_bits() {
    let file = fixture("tensor_c64_conj");
    let (m, bits) = parse_tensor_entry(&file).unwrap();
    assert_eq!(bits, ViewBits { conj: true, neg: false });
    assert_eq!(m.dtype, Dtype::ComplexFloat);
    // Written back, the pickle is the one PyTorch wrote.
    assert_eq!(tensor_pickle(&m, bits), data_pkl(&file));
    for bits in [ViewBits { conj: true, neg: true }, ViewBits { conj: false, neg: true }, ViewBits::default()] {
        assert_eq!(parse_tensor_entry(&tensor_file_with_bits(&m, bits)).unwrap(), (m.clone(), bits));
    }
}

#[test]
fn conjugate_views_are_refused_not_misread() {
    let e = parse_tensor_file(&fixture("tensor_c64_conj")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.message().contains("conj bit"), "{}", e.message());
}

#[test]
fn tensor_round_trip_dtypes_ranks_and_big_numbers() {
    let cases = [
        meta(Dtype::Float32, 0, &[], &[]),
        meta(Dtype::BFloat16, 5, &[7], &[1]),
        meta(Dtype::Int64, 300, &[2, 0, 3], &[0, 3, 1]),
        meta(Dtype::Bool, 70_000, &[1, 2, 3, 4], &[24, 12, 4, 1]),
        meta(Dtype::ComplexDouble, 1 << 40, &[1 << 33, 2, 1, 1, 1], &[2, 1, 1, 1, 1]),
        meta(Dtype::UInt64, i64::MAX, &[3; 12], &[1; 12]),
    ];
    for m in cases {
        let file = tensor_file(&m);
        assert_eq!(parse_tensor_file(&file).unwrap(), m);
    }
    let mut m = meta(Dtype::UInt8, 0, &[1], &[1]);
    m.storage_hash = "0123456789abcdef".repeat(4); // a 64-digit hash
    assert_eq!(parse_tensor_file(&tensor_file(&m)).unwrap(), m);
}

#[test]
fn unpickler_round_trips_the_writer() {
    let mut p = Pickler::new();
    p.tuple(4, |p| {
        p.int(-5);
        p.int(1 << 45);
        p.str("héllo");
        p.str_bool_dict(&[("conj", false), ("neg", false)]);
    });
    let v = unpickle(&p.finish(), Allow::TensorEntry).unwrap();
    let items = v.as_tuple().unwrap();
    assert_eq!(items[0], Value::Int(-5));
    assert_eq!(items[1], Value::Int(1 << 45));
    assert_eq!(items[2], Value::Str("héllo".into()));
    match &items[3] {
        Value::Dict(d) => assert_eq!(d.pairs.len(), 2),
        other => panic!("{other:?}"),
    }
}

#[test]
fn refuses_foreign_globals_and_calls() {
    // The classic: c os\nsystem\n (S'echo pwned'\n tR.
    let e = tensor_err(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.");
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.message().contains("GLOBAL os.system is refused"), "{}", e.message());

    let e = tensor_err(b"\x80\x02cbuiltins\neval\n.");
    assert!(e.message().contains("builtins.eval"), "{}", e.message());

    let e = tensor_err(b"\x80\x02ctorch\nqint8\n.");
    assert!(e.message().contains("torch.qint8"), "{}", e.message());

    // REDUCE of an allowed global that is not torch.Size.
    let e = tensor_err(b"\x80\x02ctorch\nfloat32\n)R.");
    assert!(e.message().contains("REDUCE calls torch.float32"), "{}", e.message());

    // torch.Size on something that is not a tuple of ints.
    let e = tensor_err(b"\x80\x02ctorch\nSize\nX\x01\x00\x00\x00a\x85R.");
    assert!(e.message().contains("torch.Size called on the string"), "{}", e.message());

    // UntypedStorage only inside a storage file's persistent id.
    let e = tensor_err(b"\x80\x02ctorch.storage\nUntypedStorage\n.");
    assert!(e.message().contains("refused"), "{}", e.message());
    let e = tensor_err(b"\x80\x02K\x01Q.");
    assert!(e.message().contains("BINPERSID"), "{}", e.message());
}

#[test]
fn refuses_opcodes_it_does_not_need_by_name() {
    for (pkl, name) in [
        (&b"\x80\x02N."[..], "NONE"),
        (b"\x80\x02]\x2e", "EMPTY_LIST"),
        (b"\x80\x02\x93.", "STACK_GLOBAL"),
        (b"\x80\x02\x81.", "NEWOBJ"),
        (b"\x80\x02b.", "BUILD"),
        (b"\x80\x02i__main__\nx\n.", "INST"),
        (b"\x80\x02G\x00\x00\x00\x00\x00\x00\x00\x00.", "BINFLOAT"),
        (b"\x80\x02\xff.", "(unknown)"),
    ] {
        let e = tensor_err(pkl);
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.message().contains(&format!("opcode {name}")), "{name}: {}", e.message());
    }
}

#[test]
fn refuses_deep_nesting_and_big_stacks() {
    // K 1, then TUPLE1 ten times: nesting 10 deep.
    let mut pkl = b"\x80\x02K\x01".to_vec();
    pkl.extend([op::TUPLE1; 10]);
    pkl.push(op::STOP);
    assert!(tensor_err(&pkl).message().contains("nested deeper"));

    // Many MARKs.
    let mut pkl = b"\x80\x02".to_vec();
    pkl.extend([op::MARK; 100]);
    assert!(tensor_err(&pkl).message().contains("open MARKs"));

    // A long run of ints.
    let mut pkl = b"\x80\x02".to_vec();
    for _ in 0..5000 {
        pkl.extend([op::BININT1, 1]);
    }
    assert!(tensor_err(&pkl).message().contains("stack deeper"));

    // BINGET of a big tuple over and over: the depth check stays O(1),
    // and nesting still ends it.
    let mut pkl = b"\x80\x02(".to_vec();
    for _ in 0..500 {
        pkl.extend([op::BININT1, 1]);
    }
    pkl.extend([op::TUPLE, op::BINPUT, 0]);
    for _ in 0..6 {
        pkl.push(op::MARK);
        for _ in 0..500 {
            pkl.extend([op::BINGET, 0]);
        }
        pkl.extend([op::TUPLE, op::BINPUT, 0]);
    }
    pkl.push(op::STOP);
    assert!(tensor_err(&pkl).message().contains("nested deeper"));
}

#[test]
fn refuses_huge_lengths_without_allocating() {
    let e = tensor_err(b"\x80\x02X\xff\xff\xff\xff");
    assert!(e.message().contains("string of 4294967295 bytes"), "{}", e.message());
    let e = tensor_err(b"\x80\x02X\x00\x10\x00\x00abc");
    assert!(e.message().contains("runs past the end"), "{}", e.message());
    let e = tensor_err(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.");
    assert!(e.message().contains("LONG1 of 9 bytes"), "{}", e.message());
    let e = tensor_err(b"\x80\x02K\x01r\xff\xff\xff\x7f.");
    assert!(e.message().contains("memo index"), "{}", e.message());
    let e = tensor_err(b"\x80\x02h\x05.");
    assert!(e.message().contains("never PUT"), "{}", e.message());
    let big = vec![op::NEWTRUE; unpickle::MAX_PICKLE_LEN + 1];
    assert!(tensor_err(&big).message().contains("longer than"));
}

#[test]
fn refuses_malformed_entries() {
    let good = meta(Dtype::Float32, 0, &[2], &[1]);
    let with = |f: &dyn Fn(&mut TensorMeta)| {
        let mut m = good.clone();
        f(&mut m);
        parse_tensor_file(&tensor_file(&m)).unwrap_err().message().to_string()
    };
    assert!(with(&|m| m.storage_hash = "../etc/passwd".into()).contains("lowercase hex"));
    assert!(with(&|m| m.storage_hash = String::new()).contains("lowercase hex"));
    assert!(with(&|m| m.storage_hash = "ABC".into()).contains("lowercase hex"));
    assert!(with(&|m| m.offset = -1).contains("offset"));
    assert!(with(&|m| m.shape = vec![-2]).contains("negative size"));
    assert!(with(&|m| m.stride = vec![-1]).contains("negative step"));

    // Wrong arity, stride length and metadata.
    let e = tensor_err(b"\x80\x02K\x01\x85.");
    assert!(e.message().contains("not (dtype, hash"), "{}", e.message());
    let mut p = Pickler::new();
    p.tuple(6, |p| {
        p.global("torch", "float32");
        p.str("ab");
        p.int(0);
        p.int_tuple(&[2, 2]);
        p.int_tuple(&[1]);
        p.str_bool_dict(&[]);
    });
    assert!(tensor_err(&p.finish()).message().contains("shape has 2 dims but stride has 1"));
    let mut p = Pickler::new();
    p.tuple(6, |p| {
        p.global("torch", "float32");
        p.str("ab");
        p.int(0);
        p.int_tuple(&[]);
        p.int_tuple(&[]);
        p.str_bool_dict(&[("requires_grad", true)]);
    });
    assert!(tensor_err(&p.finish()).message().contains("not a conj or neg bit"));

    // Trailing bytes, and a stack left with two values.
    assert!(tensor_err(b"\x80\x02K\x01.X").message().contains("after STOP"));
    assert!(tensor_err(b"\x80\x02K\x01K\x01.").message().contains("STOP with 2 items"));
}

#[test]
fn storage_files_are_checked() {
    let file = storage_file(&[1, 2, 3, 4]);
    // A tensor entry is not a storage file and vice versa.
    let e = storage_data_range(&tensor_file(&meta(Dtype::UInt8, 0, &[], &[]))).unwrap_err();
    assert!(e.message().contains("not a torch.storage.UntypedStorage"), "{}", e.message());
    let e = parse_tensor_file(&file).unwrap_err();
    assert!(e.message().contains("UntypedStorage is refused"), "{}", e.message());

    // A pickle that claims another size than data/0 holds.
    let mut z = ZipWriter::new(Vec::new());
    z.add("x/data.pkl", &storage_pickle(5)).unwrap();
    z.add("x/data/0", &[1, 2, 3, 4]).unwrap();
    let e = storage_data_range(&z.finish().unwrap()).unwrap_err();
    assert!(e.message().contains("says 5 bytes but x/data/0 holds 4"), "{}", e.message());

    // No data record.
    let mut z = ZipWriter::new(Vec::new());
    z.add("x/data.pkl", &storage_pickle(4)).unwrap();
    let e = storage_data_range(&z.finish().unwrap()).unwrap_err();
    assert!(e.message().contains("no x/data/0"), "{}", e.message());

    // Records outside the archive folder, and a big-endian file.
    let mut z = ZipWriter::new(Vec::new());
    z.add("x/data.pkl", &storage_pickle(0)).unwrap();
    z.add("y/data/0", &[]).unwrap();
    let e = storage_data_range(&z.finish().unwrap()).unwrap_err();
    assert!(e.message().contains("outside the folder x/"), "{}", e.message());
    let mut z = ZipWriter::new(Vec::new());
    z.add("x/data.pkl", &storage_pickle(0)).unwrap();
    z.add("x/byteorder", b"big").unwrap();
    z.add("x/data/0", &[]).unwrap();
    let e = storage_data_range(&z.finish().unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);

    // A flipped bit in data.pkl fails its CRC.
    let mut bad = file.clone();
    let pkl = zip::read_entries(&file).unwrap()[0].data.clone();
    bad[pkl.start + 3] ^= 0x20;
    assert!(storage_data_range(&bad).unwrap_err().message().contains("CRC-32"));
}
