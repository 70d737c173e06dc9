//! Property-based fuzzing of the parsers that read bytes from another
//! process: the manager protocol record, the CUDA IPC handle text form and
//! memory-handle bytes, and segment-name validation. Each target first
//! replays its committed corpus (tests/corpus/<target>/, regression inputs
//! included), then runs random and mutated inputs. Properties: never a
//! panic; whatever parses re-encodes to the same value; the name validator
//! agrees with a model and with the kernel.
//!
//! More cases: PROPTEST_CASES=100000 cargo test --release --test fuzz_parsers

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
        .prop_map(|(device, mem_handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, ev, event_sync_required)| IpcHandle {
            device,
            mem_handle,
            size_bytes,
            offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle: ev.try_into().unwrap(),
            event_sync_required,
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
