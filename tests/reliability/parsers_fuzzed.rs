//! Property-based fuzzing of the parsers that read bytes from another
//! process: the manager protocol record, the CUDA IPC handle text form and
//! memory-handle bytes, segment-name validation, TCPStore requests (parser
//! and the server's scanner) and ADD counters, the content store's
//! native tensor record, the shareable arena's handle and the
//! symmetric-memory rendezvous request. (The TCPStore client and server over real
//! sockets: tests/store/tcpstore_fed_hostile_bytes.rs; the torch.save readers:
//! tests/content_store/pytorch_format_fed_hostile_bytes.rs.) Each target first
//! replays its committed corpus (tests/corpus/<target>/, regression inputs
//! included), then runs random and mutated inputs. Properties: never a
//! panic; whatever parses re-encodes to the same value; the name validator
//! agrees with a model and with the kernel.
//!
//! More cases: PROPTEST_CASES=100000 cargo test --release --test parsers_fuzzed

use proptest::prelude::*;
use std::path::PathBuf;
use storage_sharing::cuda::handle::{decode_mem_handle, encode_mem_handle, IpcHandle, IPC_HANDLE_SIZE};
use storage_sharing::manager::protocol::{AllocInfo, ALLOC_INFO_SIZE, FILENAME_FIELD};
use storage_sharing::shm::names::{validate_shm_name, MAX_SHM_NAME_LEN};
use storage_sharing::ErrorKind;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).unwrap())).collect()
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(3000);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- manager protocol ---------------------------------------------------

/// Decodes any 68 bytes; what decodes must satisfy the format's rules and
/// re-encode to a record that decodes the same.
fn check_record(bytes: &[u8; ALLOC_INFO_SIZE]) {
    if let Ok(m) = AllocInfo::decode(bytes) {
        assert!(!m.filename.is_empty() && m.filename.len() < FILENAME_FIELD && !m.filename.contains('\0'));
        assert_eq!(m.pid, i32::from_ne_bytes(bytes[0..4].try_into().unwrap()));
        assert_eq!(AllocInfo::decode(&m.encode()).unwrap(), m);
    } else {
        let e = AllocInfo::decode(bytes).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    }
}

#[test]
fn manager_protocol_corpus() {
    for (path, data) in corpus("manager_protocol") {
        // Short files are padded with zeros, long ones cut: a record is 68 bytes.
        let mut rec = [0u8; ALLOC_INFO_SIZE];
        let n = data.len().min(ALLOC_INFO_SIZE);
        rec[..n].copy_from_slice(&data[..n]);
        let r = std::panic::catch_unwind(|| check_record(&rec));
        assert!(r.is_ok(), "corpus input {} broke the decoder", path.display());
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn manager_protocol_any_bytes(bytes in proptest::collection::vec(any::<u8>(), ALLOC_INFO_SIZE)) {
        check_record(&bytes.try_into().unwrap());
    }

    /// Records near the valid ones: a valid record with a few bytes changed.
    #[test]
    fn manager_protocol_mutated(pid in any::<i32>(), free in any::<bool>(), name in "/[a-z0-9_]{0,58}",
                                edits in proptest::collection::vec((0..ALLOC_INFO_SIZE, any::<u8>()), 0..4)) {
        match AllocInfo::new(pid, free, &name) {
            Ok(m) => {
                let mut b = m.encode();
                prop_assert_eq!(AllocInfo::decode(&b).unwrap(), m);
                for (at, v) in edits {
                    b[at] = v;
                }
                check_record(&b);
            }
            Err(e) => prop_assert_eq!(e.kind(), ErrorKind::NameTooLong),
        }
    }

    #[test]
    fn manager_filename_check_any_text(name in ".{0,80}") {
        let ok = AllocInfo::new(1, false, &name).is_ok();
        prop_assert_eq!(ok, !name.is_empty() && name.len() < FILENAME_FIELD && !name.contains('\0'));
    }
}

// ---- CUDA IPC handle ----------------------------------------------------

fn check_handle_text(text: &str) {
    match IpcHandle::from_text(text) {
        Ok(h) => {
            let again = IpcHandle::from_text(&h.to_text()).unwrap_or_else(|e| panic!("{text:?} parsed but its re-encoding did not: {e}"));
            assert_eq!(again, h, "{text:?}");
            // The byte strings are hex: a re-encoded field is the input's
            // field lower-cased (no sign, no other spelling accepted).
            let fields: Vec<&str> = text.split_whitespace().collect();
            let out = h.to_text();
            let outs: Vec<&str> = out.split(' ').collect();
            for i in [1, 6] {
                assert_eq!(fields[i].to_ascii_lowercase(), outs[i], "byte-string field {i} of {text:?}");
            }
        }
        Err(e) => assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}"),
    }
}

fn check_mem_handle(bytes: &[u8]) {
    match decode_mem_handle(bytes) {
        Ok(raw) => {
            assert!(bytes.len() == IPC_HANDLE_SIZE || (bytes.len() == IPC_HANDLE_SIZE + 2 && bytes[1] == b'c'));
            assert_eq!(decode_mem_handle(&encode_mem_handle(&raw)).unwrap(), raw);
        }
        Err(e) => assert!(matches!(e.kind(), ErrorKind::InvalidArgument | ErrorKind::Unsupported), "{e}"),
    }
}

#[test]
fn cuda_handle_corpus() {
    for (path, data) in corpus("cuda_handle") {
        let text = String::from_utf8_lossy(&data);
        for line in text.lines() {
            let r = std::panic::catch_unwind(|| check_handle_text(line));
            assert!(r.is_ok(), "corpus input {} line {line:?} broke the parser", path.display());
        }
        let r = std::panic::catch_unwind(|| check_mem_handle(&data));
        assert!(r.is_ok(), "corpus input {} broke decode_mem_handle", path.display());
    }
}

fn any_handle() -> impl Strategy<Value = IpcHandle> {
    (
        any::<i32>(),
        prop_oneof![Just(Vec::new()), proptest::collection::vec(any::<u8>(), 1..80)],
        any::<u64>(),
        any::<u64>(),
        prop_oneof![Just(String::new()), "/torch_[0-9]{1,7}_[0-9]{1,10}_[0-9]{1,3}"],
        any::<u64>(),
        proptest::collection::vec(any::<u8>(), IPC_HANDLE_SIZE),
        any::<bool>(),
    )
        .prop_map(|(device, mem_handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, ev, event_sync_required)| {
            IpcHandle {
                device,
                mem_handle,
                size_bytes,
                offset_bytes,
                ref_counter_handle,
                ref_counter_offset,
                event_handle: ev.try_into().unwrap(),
                event_sync_required,
            }
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn cuda_handle_round_trips(h in any_handle()) {
        prop_assert_eq!(IpcHandle::from_text(&h.to_text()).unwrap(), h);
    }

    #[test]
    fn cuda_handle_any_text(text in "[ -~]{0,200}") {
        check_handle_text(&text);
    }

    /// Valid texts with one field replaced by a short random token.
    #[test]
    fn cuda_handle_mutated(h in any_handle(), field in 0usize..8, token in "[-+0-9a-fA-FxX_/ ]{0,6}") {
        let text = h.to_text();
        let mut fields: Vec<String> = text.split(' ').map(str::to_string).collect();
        fields[field] = token;
        check_handle_text(&fields.join(" "));
    }

    #[test]
    fn cuda_mem_handle_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..70), version in 0u8..4, kind in prop_oneof![Just(b'c'), Just(b'e'), any::<u8>()]) {
        check_mem_handle(&bytes);
        let mut framed = vec![version, kind];
        framed.extend_from_slice(&bytes);
        check_mem_handle(&framed);
    }
}

// ---- segment names --------------------------------------------------------

/// The rule the validator implements, written independently.
fn model_accepts(name: &str) -> bool {
    let b = name.as_bytes();
    b.first() == Some(&b'/') && b.len() > 1 && !b[1..].contains(&b'/') && !b.contains(&0) && b.len() - 1 <= MAX_SHM_NAME_LEN
}

fn check_name(name: &str) {
    let ours = validate_shm_name(name);
    assert_eq!(ours.is_ok(), model_accepts(name), "{name:?}: {ours:?}");
    if let Err(e) = ours {
        assert!(matches!(e.kind(), ErrorKind::InvalidArgument | ErrorKind::NameTooLong), "{e}");
    }
}

/// A name we accept is one the kernel accepts: create and remove it.
fn kernel_accepts(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else { return false };
    // SAFETY: shm_open/shm_unlink with a valid C string; the fd is closed.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600);
        if fd < 0 {
            return false;
        }
        libc::close(fd);
        libc::shm_unlink(c.as_ptr());
    }
    true
}

#[test]
fn shm_names_corpus() {
    for (path, data) in corpus("shm_names") {
        for line in String::from_utf8_lossy(&data).lines() {
            let r = std::panic::catch_unwind(|| check_name(line));
            assert!(r.is_ok(), "corpus input {} line {line:?}", path.display());
        }
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn shm_names_any_text(name in "(/)?[^\u{0}]{0,8}(/)?(\u{0})?[a-z]{0,300}") {
        check_name(&name);
    }

    /// Names we accept, made unique to this process, really open (kept
    /// short in count: each one is a real shm_open).
    #[test]
    fn shm_names_we_accept_the_kernel_accepts(stem in "[a-zA-Z0-9._-]{1,40}") {
        let name = format!("/ss_fuzz_{}_{stem}", std::process::id());
        prop_assume!(name.len() - 1 <= MAX_SHM_NAME_LEN && name != "/." && name != "/..");
        check_name(&name);
        prop_assert!(kernel_accepts(&name), "{name:?} validated but shm_open refused it");
    }
}

// ---- TCPStore requests ------------------------------------------------------

use storage_sharing::store::tcp::protocol::{
    parse_counter, parse_request, query, Request, RequestScanner, MAX_FIELD, MAX_KEYS, MAX_KEY_LEN, MAX_VALUE_LEN,
};

/// Feeds `bytes` to the server's scanner in the chunks given by `cuts`
/// (the way reads deliver them) and returns what it decided for the
/// first request: its length, "needs more", or the error.
fn scan_in_chunks(bytes: &[u8], cuts: &[usize]) -> Result<Option<usize>, storage_sharing::Error> {
    let mut s = RequestScanner::new();
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    ends.push(bytes.len());
    ends.sort_unstable();
    for end in ends {
        match s.scan(&bytes[..end])? {
            Some(n) => return Ok(Some(n)),
            None => continue,
        }
    }
    Ok(None)
}

/// Parses a stream of requests as the server does: every accepted request
/// re-encodes to exactly the bytes it used, every shorter prefix of it
/// asks for more bytes, the scanner finds the same end (also when the
/// bytes come in pieces), and a refusal is a `Protocol` error naming a
/// bad query type or an over-long field. Returns the requests.
fn check_request_stream(bytes: &[u8], cuts: &[usize]) -> Vec<Request> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let rest = &bytes[at..];
        let parsed = parse_request(rest);
        let scanned = scan_in_chunks(rest, cuts);
        match parsed {
            Ok(Some((req, n))) => {
                assert!(n > 0 && n <= rest.len());
                assert_eq!(req.to_bytes(), &rest[..n], "{req:?} does not re-encode to its bytes");
                assert_eq!(scanned.as_ref().ok(), Some(&Some(n)), "scanner disagrees on {:?}", &rest[..n]);
                for cut in [0, n / 2, n - 1] {
                    assert_eq!(parse_request(&rest[..cut]).unwrap(), None, "prefix {cut} of a {n}-byte request");
                }
                match &req {
                    Request::Check(k) | Request::Wait(k) | Request::MultiGet(k) => assert!(k.len() as u64 <= MAX_KEYS),
                    Request::MultiSet(p) => assert!(p.len() as u64 <= MAX_KEYS),
                    _ => {}
                }
                out.push(req);
                at += n;
            }
            Ok(None) => {
                assert_eq!(scanned.unwrap(), None, "scanner completed what the parser calls partial: {rest:?}");
                return out;
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
                let m = e.message();
                assert!(m.contains("query type") || m.contains("over the limit"), "{m}");
                assert!(scanned.is_err(), "parser refused what the scanner accepts: {rest:?} ({m})");
                return out;
            }
        }
    }
}

#[test]
fn tcpstore_request_corpus() {
    for (path, data) in corpus("tcpstore_request") {
        let r = std::panic::catch_unwind(|| check_request_stream(&data, &[1, 7, 9, 100]));
        assert!(r.is_ok(), "corpus input {} broke the request parser", path.display());
    }
}

fn any_key() -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![Just(b"/k".to_vec()), Just(Vec::new()), proptest::collection::vec(any::<u8>(), 0..12)]
}

fn any_request() -> impl Strategy<Value = Request> {
    let keys = proptest::collection::vec(any_key(), 0..4);
    prop_oneof![
        any::<u32>().prop_map(Request::Validate),
        (any_key(), any_key()).prop_map(|(key, value)| Request::Set { key, value }),
        (any_key(), any_key(), any_key()).prop_map(|(key, expected, desired)| Request::CompareSet { key, expected, desired }),
        any_key().prop_map(Request::Get),
        (any_key(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        keys.clone().prop_map(Request::Check),
        keys.clone().prop_map(Request::Wait),
        Just(Request::GetNumKeys),
        any_key().prop_map(Request::DeleteKey),
        (any_key(), any_key()).prop_map(|(key, value)| Request::Append { key, value }),
        keys.prop_map(Request::MultiGet),
        proptest::collection::vec((any_key(), any_key()), 0..4).prop_map(Request::MultiSet),
        Just(Request::CancelWait),
        any::<u32>().prop_map(Request::Ping),
        (any_key(), any_key()).prop_map(|(key, value)| Request::QueuePush { key, value }),
        any_key().prop_map(Request::QueuePop),
        any_key().prop_map(Request::QueueLen),
        Just(Request::ListKeys),
        (any_key(), any::<i64>()).prop_map(|(key, world_size)| Request::Barrier { key, world_size }),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn tcpstore_request_any_bytes(kind in prop_oneof![0u8..16, any::<u8>()], rest in proptest::collection::vec(any::<u8>(), 0..80),
                                  cuts in proptest::collection::vec(any::<usize>(), 0..4)) {
        let mut bytes = vec![kind];
        bytes.extend_from_slice(&rest);
        check_request_stream(&bytes, &cuts);
    }

    /// Valid request streams, then a few bytes changed and the end cut.
    #[test]
    fn tcpstore_request_mutated(reqs in proptest::collection::vec(any_request(), 1..5),
                                edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
                                cut in 0usize..6, cuts in proptest::collection::vec(any::<usize>(), 0..4)) {
        let mut bytes = Vec::new();
        for r in &reqs {
            r.encode(&mut bytes);
        }
        if edits.is_empty() && cut == 0 {
            prop_assert_eq!(check_request_stream(&bytes, &cuts), reqs);
            return Ok(());
        }
        for (at, v) in edits {
            let i = at % bytes.len();
            bytes[i] = v;
        }
        bytes.truncate(bytes.len().saturating_sub(cut));
        check_request_stream(&bytes, &cuts);
    }

    /// Lengths and counts at and around the limits: refused before any
    /// byte of the field is waited for, never allocated.
    #[test]
    fn tcpstore_request_limits(kind in prop::sample::select(vec![query::GET, query::SET, query::CHECK, query::MULTI_SET, query::ADD]),
                               n in prop_oneof![Just(MAX_KEY_LEN), Just(MAX_KEY_LEN + 1), Just(MAX_VALUE_LEN), Just(MAX_FIELD + 1), Just(MAX_KEYS), Just(MAX_KEYS + 1), Just(u64::MAX), any::<u64>()]) {
        let mut bytes = vec![kind];
        bytes.extend_from_slice(&n.to_le_bytes());
        // The first field of GET, SET and ADD is a key.
        let limit = if matches!(kind, query::CHECK | query::MULTI_SET) { MAX_KEYS } else { MAX_KEY_LEN };
        match parse_request(&bytes) {
            Ok(None) => prop_assert!(n <= limit),
            Ok(Some(_)) => prop_assert!(n == 0 && matches!(kind, query::CHECK | query::MULTI_SET)),
            Err(e) => {
                prop_assert!(n > limit);
                prop_assert!(e.message().contains("over the limit"));
            }
        }
        check_request_stream(&bytes, &[3]);
    }

    /// A value's limit is its own (8 MiB), a key's 8 KiB, as PyTorch's
    /// libuv server: a SET with a key at its limit and a value just over
    /// its limit is refused at the value's length.
    #[test]
    fn tcpstore_value_limits(value_len in prop_oneof![Just(MAX_VALUE_LEN), Just(MAX_VALUE_LEN + 1), Just(MAX_FIELD), any::<u64>()]) {
        let mut bytes = vec![query::SET];
        bytes.extend_from_slice(&MAX_KEY_LEN.to_le_bytes());
        bytes.extend(std::iter::repeat_n(b'k', MAX_KEY_LEN as usize));
        bytes.extend_from_slice(&value_len.to_le_bytes());
        match parse_request(&bytes) {
            Ok(None) => prop_assert!(value_len <= MAX_VALUE_LEN),
            Ok(Some(_)) => prop_assert!(false, "a SET without its value bytes was accepted"),
            Err(e) => {
                prop_assert!(value_len > MAX_VALUE_LEN);
                prop_assert!(e.message().contains("value length") && e.message().contains("over the limit"), "{}", e.message());
            }
        }
        check_request_stream(&bytes, &[3, 9000]);
    }

    /// `ADD` on a stored value parses it as C++ `std::stoll` does; the
    /// model is written independently of the server's parser.
    #[test]
    fn tcpstore_counter_like_stoll(text in "[ \t]{0,2}[-+]?[0-9]{0,21}[x ]?[0-9]{0,2}", raw in proptest::collection::vec(any::<u8>(), 0..12)) {
        prop_assert_eq!(parse_counter(text.as_bytes()), stoll_model(text.as_bytes()));
        prop_assert_eq!(parse_counter(&raw), stoll_model(&raw));
    }
}

fn stoll_model(b: &[u8]) -> Option<i64> {
    std::str::from_utf8(b).ok()?;
    let mut i = b.iter().take_while(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)).count();
    let neg = match b.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let digits: Vec<u8> = b[i..].iter().take_while(|c| c.is_ascii_digit()).map(|c| c - b'0').collect();
    if digits.is_empty() {
        return None;
    }
    let mut v: i128 = 0;
    for d in digits {
        v = v * 10 + i128::from(d);
        if v > i128::from(i64::MAX) + 1 {
            return None;
        }
    }
    i64::try_from(if neg { -v } else { v }).ok()
}

// ---- content store: native tensor record -----------------------------------

use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::content_store::meta::TensorMeta;
use storage_sharing::content_store::record::{self, MAX_RECORD_LEN};

/// Decodes any bytes: a record that decodes re-encodes to exactly the same
/// bytes (the format has one spelling per value), and a refusal is a typed
/// error: `Corrupt`, `Unsupported` (another version) or `InvalidArgument`
/// (a dtype code this library does not know).
fn check_record_bytes(bytes: &[u8]) -> Option<TensorMeta> {
    match record::decode(bytes) {
        Ok(m) => {
            assert_eq!(record::encode(&m), bytes, "{m:?} re-encodes differently");
            assert!(m.shape.len() == m.stride.len() && m.shape.len() <= 64);
            Some(m)
        }
        Err(e) => {
            assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Unsupported | ErrorKind::InvalidArgument), "{e}");
            assert!(e.message().contains("tensor record") || e.message().contains("tensor view"), "{}", e.message());
            None
        }
    }
}

/// Recomputes the trailing checksum after an edit, so the checks behind it run.
fn reseal(mut r: Vec<u8>) -> Vec<u8> {
    if r.len() >= 8 {
        let n = r.len() - 8;
        let sum = xxhash_rust::xxh3::xxh3_64(&r[..n]);
        r[n..].copy_from_slice(&sum.to_le_bytes());
    }
    r
}

#[test]
fn tensor_record_corpus() {
    for (path, data) in corpus("tensor_record") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let r = std::panic::catch_unwind(|| check_record_bytes(&data));
        let got = r.unwrap_or_else(|_| panic!("corpus input {name} broke the record decoder"));
        // Seeds named ok_* are valid records; everything else is refused.
        assert_eq!(got.is_some(), name.starts_with("ok_"), "corpus input {name}");
    }
}

fn any_meta() -> impl Strategy<Value = TensorMeta> {
    let dtypes = prop::sample::select(vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 23, 24, 27, 28, 29]);
    let dim = prop_oneof![0..4i64, 0..1i64 << 20, any::<i64>()];
    (dtypes, prop_oneof![0..100i64, any::<i64>()], proptest::collection::vec((dim.clone(), dim), 0..6), "[0-9a-f]{1,64}").prop_map(
        |(code, offset, dims, hash)| TensorMeta {
            dtype: Dtype::from_code(code).unwrap(),
            storage_hash: hash,
            offset,
            shape: dims.iter().map(|d| d.0).collect(),
            stride: dims.iter().map(|d| d.1).collect(),
        },
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn tensor_record_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..MAX_RECORD_LEN + 2), sealed in any::<bool>()) {
        let bytes = if sealed { reseal(bytes) } else { bytes };
        check_record_bytes(&bytes);
    }

    /// Records of random views (valid or not: negative, overflowing), then
    /// a few bytes changed and the checksum recomputed: every field check
    /// has to hold on its own.
    #[test]
    fn tensor_record_mutated(m in any_meta(), edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4), cut in 0usize..3) {
        let good = record::encode(&m);
        let fits = storage_sharing::content_store::bounds::required_bytes(&m, ErrorKind::Corrupt).is_ok();
        prop_assert_eq!(check_record_bytes(&good).is_some(), fits, "{:?}", m);
        let mut r = good[..good.len() - 8].to_vec();
        for (at, v) in edits {
            let i = at % r.len();
            r[i] = v;
        }
        r.truncate(r.len().saturating_sub(cut));
        r.extend_from_slice(&[0; 8]);
        check_record_bytes(&reseal(r));
    }
}

// ---- shareable CPU arena: the handle a consumer decodes ----------------------

use storage_sharing::arena::handle::{is_segment_name, ArenaHandle, Strategy as ArenaStrategy, MAX_NAME_LEN, WIRE_SIZE};
use storage_sharing::arena::segment::SegmentKey;

/// Decodes any bytes: a handle that decodes is valid and re-encodes to
/// exactly the same bytes (one spelling per handle: the reserved word and
/// the bytes after the name's NUL have one allowed value, 0); a refusal
/// is `SizeMismatch`, `Corrupt` or `InvalidArgument` naming the handle.
fn check_arena_handle(bytes: &[u8]) -> Option<ArenaHandle> {
    match ArenaHandle::decode(bytes) {
        Ok(h) => {
            assert_eq!(&h.encode()[..], bytes, "{h:?} re-encodes differently");
            h.validate().unwrap();
            assert!(h.size > 0 && h.offset + h.size <= h.segment_data_size && h.key.producer_pid > 0);
            Some(h)
        }
        Err(e) => {
            assert!(matches!(e.kind(), ErrorKind::SizeMismatch | ErrorKind::Corrupt | ErrorKind::InvalidArgument), "{e}");
            assert!(e.message().contains("arena handle"), "{}", e.message());
            None
        }
    }
}

/// The name rule, written independently: numbers that print back as
/// themselves, eight lowercase hex digits.
fn model_segment_name(name: &str) -> bool {
    let canonical = |s: &str| s.parse::<u128>().is_ok_and(|v| v.to_string() == s);
    let Some(rest) = name.strip_prefix("/ss_arena_") else { return false };
    let mut parts = rest.splitn(3, '_');
    let (Some(pid), Some(id), Some(tag)) = (parts.next(), parts.next(), parts.next()) else { return false };
    canonical(pid) && canonical(id) && tag.len() == 8 && tag.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

#[test]
fn arena_handle_corpus() {
    for (path, data) in corpus("arena_handle") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let r = std::panic::catch_unwind(|| check_arena_handle(&data));
        let got = r.unwrap_or_else(|_| panic!("corpus input {name} broke the arena handle decoder"));
        // Seeds named ok_* are valid handles; everything else is refused.
        assert_eq!(got.is_some(), name.starts_with("ok_"), "corpus input {name}");
    }
}

fn any_arena_handle() -> impl Strategy<Value = ArenaHandle> {
    let sizes = (1u64..1 << 40, any::<u64>(), any::<u64>()).prop_map(|(seg, a, b)| {
        let offset = a % seg;
        (seg, offset, 1 + b % (seg - offset))
    });
    (any::<bool>(), 1..=i32::MAX, any::<u64>(), prop_oneof![0u64..100, 0u64..1 << 40], sizes, any::<u32>(), any::<u32>(), any::<u32>())
        .prop_map(|(by_name, pid, start, id, (seg, offset, size), slot, generation, tag)| ArenaHandle {
            strategy: if by_name { ArenaStrategy::Name } else { ArenaStrategy::Fd },
            key: SegmentKey { producer_pid: pid, producer_start: start, segment_id: id },
            segment_data_size: seg,
            offset,
            size,
            slot,
            generation,
            name: if by_name { format!("/ss_arena_{pid}_{id}_{tag:08x}") } else { String::new() },
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arena_handle_round_trips(h in any_arena_handle()) {
        prop_assert!(h.name.len() <= MAX_NAME_LEN);
        prop_assert_eq!(check_arena_handle(&h.encode()), Some(h));
    }

    /// Random bytes, most of them behind a real magic and strategy so the
    /// later checks run; also wrong lengths.
    #[test]
    fn arena_handle_any_bytes(bytes in proptest::collection::vec(any::<u8>(), WIRE_SIZE), head in 0u8..3,
                              strategy in prop_oneof![1u32..3, any::<u32>()], len in prop_oneof![Just(WIRE_SIZE), 0..WIRE_SIZE + 9]) {
        let mut bytes = bytes;
        if head > 0 {
            bytes[0..4].copy_from_slice(b"SSAH");
            bytes[4..8].copy_from_slice(&strategy.to_le_bytes());
        }
        if head > 1 {
            bytes[12..16].fill(0);
        }
        bytes.resize(len, 0);
        check_arena_handle(&bytes);
    }

    /// Valid handles with a few bytes changed.
    #[test]
    fn arena_handle_mutated(h in any_arena_handle(), edits in proptest::collection::vec((0..WIRE_SIZE, any::<u8>()), 1..4)) {
        let mut b = h.encode();
        for (at, v) in edits {
            b[at] = v;
        }
        check_arena_handle(&b);
    }

    /// The defect this section found: a non-zero reserved word or byte
    /// after the name's NUL was ignored (many spellings of one handle).
    #[test]
    fn arena_handle_has_one_spelling(h in any_arena_handle(), pick in any::<usize>(), v in 1u8..=255) {
        let mut b = h.encode();
        let after_nul = 64 + h.name.len()..WIRE_SIZE;
        let slack: Vec<usize> = (12..16).chain(after_nul.skip(1)).collect();
        b[slack[pick % slack.len()]] = v;
        let e = ArenaHandle::decode(&b).unwrap_err();
        prop_assert_eq!(e.kind(), ErrorKind::Corrupt);
        prop_assert!(e.message().contains("reserved word") || e.message().contains("after the name's NUL"), "{}", e.message());
    }

    #[test]
    fn arena_segment_names_match_a_model(name in "/ss_arena_[0-9]{0,4}_?[0-9]{0,3}_?[0-9a-fA-F_/]{0,10}", real in any::<(u32, u32, u32)>()) {
        prop_assert_eq!(is_segment_name(&name), model_segment_name(&name), "{:?}", name);
        let made = format!("/ss_arena_{}_{}_{:08x}", real.0, real.1, real.2);
        prop_assert!(is_segment_name(&made) && model_segment_name(&made), "{:?}", made);
    }
}

// ---- symmetric memory: the rendezvous request every rank publishes ----------

use storage_sharing::symm::request::{RendezvousRequest, HOSTNAME_LEN, REQUEST_SIZE};

/// Parses any bytes as rank 5's request: what is accepted re-encodes to the
/// same bytes except the 10 padding bytes (ignored: PyTorch leaves them
/// unspecified), and parses again to the same value; a refusal is a
/// `Protocol` error naming the rank.
fn check_symm_request(bytes: &[u8]) -> Option<RendezvousRequest> {
    match RendezvousRequest::from_bytes(bytes, 5) {
        Ok(r) => {
            let mut canonical = bytes.to_vec();
            for p in RendezvousRequest::PADDING {
                canonical[p].fill(0);
            }
            assert_eq!(r.to_bytes(), canonical, "{r:?} re-encodes differently");
            assert_eq!(RendezvousRequest::from_bytes(&r.to_bytes(), 5).unwrap(), r);
            assert!(r.pid > 0 && r.device_idx >= 0 && r.buffer_offset + r.buffer_size <= r.block_size);
            assert!(r.hostname.contains(&0), "a host name ends with its NUL");
            Some(r)
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
            assert!(e.message().contains("rendezvous request of rank 5"), "{}", e.message());
            None
        }
    }
}

#[test]
fn symm_request_corpus() {
    for (path, data) in corpus("symm_request") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let r = std::panic::catch_unwind(|| check_symm_request(&data));
        let got = r.unwrap_or_else(|_| panic!("corpus input {name} broke the request parser"));
        assert_eq!(got.is_some(), name.starts_with("ok_"), "corpus input {name}");
    }
}

fn host_bytes(host: &str) -> [u8; HOSTNAME_LEN] {
    let mut h = [0u8; HOSTNAME_LEN];
    h[..host.len()].copy_from_slice(host.as_bytes());
    h
}

fn any_symm_request() -> impl Strategy<Value = RendezvousRequest> {
    let layout = (0u64..1 << 40, 0u64..1 << 20, 0u64..1 << 40).prop_map(|(buf, off, extra)| (off + buf + extra, buf, off));
    (0..=i32::MAX, 1..=i32::MAX, layout, any::<bool>(), any::<i32>(), "[a-z0-9.-]{0,64}").prop_map(
        |(device_idx, pid, (block_size, buffer_size, buffer_offset), has_multicast_support, clique_id, host)| RendezvousRequest {
            device_idx,
            pid,
            block_size,
            buffer_size,
            buffer_offset,
            has_multicast_support,
            clique_id,
            hostname: host_bytes(&host),
        },
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn symm_request_round_trips(r in any_symm_request()) {
        prop_assert_eq!(check_symm_request(&r.to_bytes()), Some(r));
    }

    #[test]
    fn symm_request_any_bytes(bytes in proptest::collection::vec(any::<u8>(), REQUEST_SIZE), len in prop_oneof![Just(REQUEST_SIZE), 0..REQUEST_SIZE + 9],
                              zero_host_tail in any::<bool>()) {
        let mut bytes = bytes;
        if zero_host_tail {
            // Past the first random byte of the host name, so the later checks run.
            bytes[41..105].fill(0);
        }
        bytes.resize(len, 0);
        check_symm_request(&bytes);
    }

    /// Valid requests with a few bytes changed: accepted only as another
    /// valid request with the same single spelling.
    #[test]
    fn symm_request_mutated(r in any_symm_request(), edits in proptest::collection::vec((0..REQUEST_SIZE, any::<u8>()), 1..4)) {
        let mut b = r.to_bytes();
        for (at, v) in edits {
            b[at] = v;
        }
        check_symm_request(&b);
    }

    /// Padding as a PyTorch rank may send it: ignored, same request.
    #[test]
    fn symm_request_padding_is_ignored(r in any_symm_request(), fill in proptest::collection::vec(any::<u8>(), 10)) {
        let mut b = r.to_bytes();
        let at: Vec<usize> = RendezvousRequest::PADDING.into_iter().flatten().collect();
        prop_assert_eq!(at.len(), 10);
        for (i, v) in at.into_iter().zip(fill) {
            b[i] = v;
        }
        prop_assert_eq!(check_symm_request(&b), Some(r));
    }
}

/// Writes the seed inputs of tests/corpus/tcpstore_request,
/// tests/corpus/tensor_record, tests/corpus/arena_handle and
/// tests/corpus/symm_request (regression inputs of the first two are
/// added by hand):
/// `cargo test --release --test parsers_fuzzed -- --ignored write_seed_corpus`.
#[test]
#[ignore = "writes the committed seed corpus"]
fn write_seed_corpus() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let put = |dir: &str, name: &str, bytes: &[u8]| {
        std::fs::create_dir_all(root.join(dir)).unwrap();
        std::fs::write(root.join(dir).join(name), bytes).unwrap();
    };
    let k = |s: &str| s.as_bytes().to_vec();
    let hello = [Request::Validate(storage_sharing::store::tcp::protocol::VALIDATION_MAGIC), Request::Ping(0x2e22)];
    let session: Vec<Request> = vec![
        Request::Set { key: k("/a"), value: k("1") },
        Request::CompareSet { key: k("/a"), expected: k("1"), desired: k("2") },
        Request::Get(k("/a")),
        Request::Add { key: k("/n"), delta: -5 },
        Request::Check(vec![k("/a"), k("/n")]),
        Request::Wait(vec![k("/a")]),
        Request::GetNumKeys,
        Request::DeleteKey(k("/a")),
        Request::Append { key: k("/l"), value: k("xy") },
        Request::MultiGet(vec![k("/l"), k("/n")]),
        Request::MultiSet(vec![(k("/p"), k("")), (k("/q"), k("v"))]),
        Request::CancelWait,
        Request::QueuePush { key: k("/qu"), value: k("v1") },
        Request::QueueLen(k("/qu")),
        Request::QueuePop(k("/qu")),
        Request::ListKeys,
        Request::Barrier { key: k("/b"), world_size: 1 },
    ];
    let enc = |reqs: &[Request]| reqs.iter().flat_map(Request::to_bytes).collect::<Vec<u8>>();
    put("tcpstore_request", "handshake.bin", &enc(&hello));
    put("tcpstore_request", "session_every_query.bin", &[enc(&hello), enc(&session)].concat());
    for (i, r) in session.iter().enumerate() {
        put(
            "tcpstore_request",
            &format!("one_{i:02}_{}.bin", format!("{r:?}").split([' ', '(']).next().unwrap().to_lowercase()),
            &r.to_bytes(),
        );
    }
    let mut huge = vec![query::GET];
    huge.extend_from_slice(&(MAX_FIELD + 1).to_le_bytes());
    put("tcpstore_request", "field_over_limit.bin", &huge);
    let mut many = vec![query::MULTI_GET];
    many.extend_from_slice(&(MAX_KEYS + 1).to_le_bytes());
    put("tcpstore_request", "count_over_limit.bin", &many);
    put("tcpstore_request", "unknown_query_14.bin", &[14, 0, 0]);
    let mut partial = Request::Set { key: k("/a"), value: vec![7; 100] }.to_bytes();
    partial.truncate(50);
    put("tcpstore_request", "partial_set.bin", &partial);

    let m =
        TensorMeta { dtype: Dtype::Float32, storage_hash: "0123456789abcdef".repeat(2), offset: 1, shape: vec![3, 4], stride: vec![1, 3] };
    put("tensor_record", "ok_f32_transposed.bin", &record::encode(&m));
    let scalar = TensorMeta { dtype: Dtype::BFloat16, storage_hash: "a".into(), offset: 0, shape: vec![], stride: vec![] };
    put("tensor_record", "ok_bf16_scalar.bin", &record::encode(&scalar));
    let empty = TensorMeta { dtype: Dtype::ComplexDouble, storage_hash: "f".repeat(128), offset: 9, shape: vec![0, 5], stride: vec![5, 1] };
    put("tensor_record", "ok_complex_empty_max_hash.bin", &record::encode(&empty));
    let rec = record::encode(&m);
    let edit = |at: usize, v: &[u8]| {
        let mut r = rec.clone();
        r[at..at + v.len()].copy_from_slice(v);
        reseal(r)
    };
    put("tensor_record", "bad_checksum.bin", &{
        let mut r = rec.clone();
        r[40] ^= 1;
        r
    });
    put("tensor_record", "bad_version_2.bin", &edit(8, &2u32.to_le_bytes()));
    put("tensor_record", "bad_dtype_12.bin", &edit(12, &12i32.to_le_bytes()));
    put("tensor_record", "bad_ndim_65.bin", &edit(16, &65u32.to_le_bytes()));
    put("tensor_record", "bad_ndim_u32_max.bin", &edit(16, &u32::MAX.to_le_bytes()));
    put("tensor_record", "bad_hash_len_0.bin", &edit(20, &0u32.to_le_bytes()));
    put("tensor_record", "bad_hash_len_u32_max.bin", &edit(20, &u32::MAX.to_le_bytes()));
    put("tensor_record", "bad_negative_offset.bin", &edit(24, &(-1i64).to_le_bytes()));
    put("tensor_record", "bad_negative_stride.bin", &edit(48, &(-1i64).to_le_bytes()));
    put("tensor_record", "bad_overflowing_extent.bin", &edit(24, &i64::MAX.to_le_bytes()));
    put("tensor_record", "bad_uppercase_hash.bin", &edit(64, b"A"));
    put("tensor_record", "bad_truncated.bin", &rec[..rec.len() - 9]);
    put("tensor_record", "bad_empty.bin", b"");
    put("tensor_record", "bad_too_long.bin", &vec![0u8; MAX_RECORD_LEN + 1]);

    let by_name = ArenaHandle {
        strategy: ArenaStrategy::Name,
        key: SegmentKey { producer_pid: 4242, producer_start: 123_456_789, segment_id: 7 },
        segment_data_size: 64 << 20,
        offset: 4096,
        size: 1000,
        slot: 3,
        generation: 11,
        name: "/ss_arena_4242_7_9f3c01aa".into(),
    };
    let by_fd = ArenaHandle { strategy: ArenaStrategy::Fd, name: String::new(), offset: 0, size: 64 << 20, ..by_name.clone() };
    put("arena_handle", "ok_by_name.bin", &by_name.encode());
    put("arena_handle", "ok_by_fd_whole_segment.bin", &by_fd.encode());
    let h = by_name.encode();
    let edit = |at: usize, v: &[u8]| {
        let mut b = h;
        b[at..at + v.len()].copy_from_slice(v);
        b
    };
    put("arena_handle", "regression_reserved_word_nonzero.bin", &edit(12, &1u32.to_le_bytes()));
    put("arena_handle", "regression_byte_after_name_nul.bin", &edit(64 + by_name.name.len() + 1, b"x"));
    put("arena_handle", "bad_magic.bin", &edit(0, b"SSAX"));
    put("arena_handle", "bad_strategy_7.bin", &edit(4, &7u32.to_le_bytes()));
    put("arena_handle", "bad_pid_0.bin", &edit(8, &0u32.to_le_bytes()));
    put("arena_handle", "bad_size_0.bin", &edit(48, &0u64.to_le_bytes()));
    put("arena_handle", "bad_block_past_segment.bin", &edit(40, &(64u64 << 20).to_le_bytes()));
    put("arena_handle", "bad_offset_overflows.bin", &edit(40, &u64::MAX.to_le_bytes()));
    put("arena_handle", "bad_name_no_nul.bin", &edit(64, &[b'a'; MAX_NAME_LEN + 1]));
    put("arena_handle", "bad_name_not_utf8.bin", &edit(74, &[0xff]));
    put("arena_handle", "bad_name_slash.bin", &edit(74, b"/"));
    put("arena_handle", "bad_name_uppercase_hex.bin", &edit(64 + 17, b"F"));
    put("arena_handle", "bad_name_torch_prefix.bin", &edit(64, b"/torch_123_4_5\0\0\0\0\0\0\0\0\0\0\0"));
    put("arena_handle", "bad_fd_with_name.bin", &edit(4, &1u32.to_le_bytes()));
    put("arena_handle", "bad_name_empty.bin", &edit(64, &[0; MAX_NAME_LEN + 1]));
    put("arena_handle", "bad_truncated.bin", &h[..WIRE_SIZE - 1]);
    put("arena_handle", "bad_empty.bin", b"");

    // Native-endian struct bytes (x86-64), as PyTorch sends them.
    let cpu = RendezvousRequest {
        device_idx: 0,
        pid: 4242,
        block_size: 20480,
        buffer_size: 100,
        buffer_offset: 12288,
        has_multicast_support: false,
        clique_id: 0,
        hostname: host_bytes("trainer-01"),
    };
    let cuda = RendezvousRequest {
        device_idx: 7,
        block_size: 2 << 20,
        buffer_size: 1 << 20,
        buffer_offset: 16384,
        has_multicast_support: true,
        clique_id: 3,
        hostname: host_bytes(&"n".repeat(HOSTNAME_LEN - 1)),
        ..cpu.clone()
    };
    put("symm_request", "ok_cpu_rank.bin", &cpu.to_bytes());
    put("symm_request", "ok_cuda_multicast_clique_3_longest_host.bin", &cuda.to_bytes());
    let r = cpu.to_bytes();
    let edit = |at: usize, v: &[u8]| {
        let mut b = r.clone();
        b[at..at + v.len()].copy_from_slice(v);
        b
    };
    put("symm_request", "ok_padding_not_zero.bin", &{
        let mut b = edit(33, &[0xa5; 3]);
        b[105..].fill(0x5a);
        b
    });
    put("symm_request", "regression_multicast_byte_2.bin", &edit(32, &[2]));
    put("symm_request", "regression_hostname_byte_after_nul.bin", &edit(40 + 11, b"x"));
    put("symm_request", "regression_hostname_no_nul.bin", &edit(40, &[b'h'; HOSTNAME_LEN]));
    put("symm_request", "bad_pid_0.bin", &edit(4, &0i32.to_ne_bytes()));
    put("symm_request", "bad_pid_negative.bin", &edit(4, &(-1i32).to_ne_bytes()));
    put("symm_request", "bad_device_negative.bin", &edit(0, &(-1i32).to_ne_bytes()));
    put("symm_request", "bad_buffer_past_block.bin", &edit(16, &20000u64.to_ne_bytes()));
    put("symm_request", "bad_buffer_offset_overflows.bin", &edit(24, &u64::MAX.to_ne_bytes()));
    put("symm_request", "bad_older_40_byte_struct.bin", &r[..40]);
    put("symm_request", "bad_104_bytes_no_clique_id.bin", &r[..104]);
    put("symm_request", "bad_empty.bin", b"");
}
