//! A store owned by another user is untrusted: its owner may truncate a
//! storage file and grow it back at any moment. Readers (the Rust
//! reader, the C API, `ssctl store verify`) must then give the right
//! bytes or a clear error, never die of SIGBUS, including with tensors
//! read before the truncation still held. As root the files belong to
//! uid 65534 and a process of that uid shrinks them; otherwise the files
//! are left writable by others (which makes them untrusted as well) and
//! a process of our own uid shrinks them.

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use storage_sharing::content_store::{Dtype, Format, Reader, Writer};
use storage_sharing::ffi::content_store::*;
use storage_sharing::ffi::status::ss_status;
use storage_sharing::ErrorKind;

/// Storage size: big enough that a read or a hash is caught mid-way.
const LEN: usize = 8 << 20;
/// Reads done while the files shrink and grow (a count, not a time).
const READS: usize = 300;

fn am_root() -> bool {
    // SAFETY: geteuid has no side effects.
    unsafe { libc::geteuid() == 0 }
}

fn data(seed: u8) -> Vec<u8> {
    (0..LEN).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

/// A store in `format` with tensors `a` and `b` over two storages,
/// handed to the hostile owner.
fn hostile_store(tag: &str, format: Format) -> (PathBuf, Vec<(String, Vec<u8>)>) {
    let root = std::env::temp_dir().join(format!("ss-cs-shrink-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let w = Writer::open(&root, format).unwrap();
    let mut stored = Vec::new();
    for (name, seed) in [("a", 1u8), ("b", 2u8)] {
        let bytes = data(seed);
        w.write_tensor(name, &bytes, Dtype::UInt8, 0, &[LEN as i64], &[1]).unwrap();
        stored.push((name.to_string(), bytes));
    }
    drop(w);
    for entry in walk(&root) {
        if am_root() {
            std::os::unix::fs::chown(&entry, Some(65534), Some(65534)).unwrap();
        } else if entry.is_file() {
            std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o666)).unwrap();
        }
    }
    (root, stored)
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A forked child that, as the files' owner, truncates every storage
/// file (to 0, a page, half) and grows it back with its bytes, over and
/// over, until dropped.
struct Shrinker {
    pid: libc::pid_t,
}

impl Shrinker {
    fn start(root: &Path) -> Shrinker {
        let files: Vec<(std::fs::File, Vec<u8>)> = std::fs::read_dir(root.join("storages"))
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                let bytes = std::fs::read(&p).unwrap();
                (std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap(), bytes)
            })
            .collect();
        let as_nobody = am_root();
        // SAFETY: the child makes only async-signal-safe calls (setgid,
        // setuid, prctl, ftruncate, pwrite, usleep, _exit) on memory prepared
        // before the fork, and never returns.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            unsafe {
                if as_nobody && (libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(65534) != 0 || libc::setuid(65534) != 0) {
                    libc::_exit(2);
                }
                // Dies with the test process, even one killed by a signal
                // (set after setuid, which clears it).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() == 1 {
                    libc::_exit(3);
                }
                let mut round = 0usize;
                loop {
                    for (f, bytes) in &files {
                        let fd = f.as_raw_fd();
                        let short = [0, 4096, bytes.len() / 2][round % 3];
                        libc::ftruncate(fd, short as libc::off_t);
                        libc::usleep(200);
                        libc::ftruncate(fd, bytes.len() as libc::off_t);
                        libc::pwrite(fd, bytes.as_ptr().cast(), bytes.len(), 0);
                        libc::usleep(500);
                    }
                    round += 1;
                }
            }
        }
        Shrinker { pid }
    }
}

impl Drop for Shrinker {
    fn drop(&mut self) {
        // SAFETY: our own child, killed and reaped once.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// An error a shrinking file may give: clear, and naming the storage.
fn assert_clear(e: &storage_sharing::Error) {
    assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::NotFound), "{:?}: {}", e.kind(), e.message());
    assert!(e.message().contains("storage"), "{}", e.message());
}

fn reader_holds_and_reads(format: Format, tag: &str) {
    let (root, stored) = hostile_store(tag, format);
    let r = Reader::open(&root).unwrap();
    // Read before the owner starts: held through every truncation below.
    let held: Vec<_> = stored.iter().map(|(n, _)| r.read_tensor(n).unwrap()).collect();
    assert!(held.iter().all(|t| t.storage.is_copied()), "another user's storage was mapped, not copied");
    let shrinker = Shrinker::start(&root);
    let (mut good, mut refused) = (0, 0);
    let mut kept = Vec::new();
    for i in 0..READS {
        let (name, bytes) = &stored[i % stored.len()];
        // A fresh reader: its cache does not hand back the held storages.
        match Reader::open(&root).unwrap().read_tensor(name) {
            Ok(t) => {
                assert!(t.storage.bytes() == &bytes[..], "tensor {name}: wrong bytes handed out");
                good += 1;
                kept.push(t);
                kept.truncate(4);
            }
            Err(e) => {
                assert_clear(&e);
                refused += 1;
            }
        }
        // Every tensor held, old or new, still reads (no SIGBUS) and right.
        for (t, (_, want)) in held.iter().zip(&stored) {
            assert!(t.storage.bytes() == &want[..]);
        }
        for t in &kept {
            assert!(t.storage.bytes().iter().map(|b| *b as u64).sum::<u64>() > 0);
        }
    }
    drop(shrinker);
    println!("{tag}: {good} reads right, {refused} refused with a clear error, while the owner shrank the files");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn reader_of_a_hostile_torch_store_never_faults() {
    reader_holds_and_reads(Format::Torch, "torch");
}

#[test]
fn reader_of_a_hostile_native_store_never_faults() {
    reader_holds_and_reads(Format::Native, "native");
}

#[test]
fn c_api_tensor_data_of_a_hostile_store_never_faults() {
    let (root, stored) = hostile_store("capi", Format::Torch);
    let path = CString::new(root.to_str().unwrap()).unwrap();
    let name = CString::new("a").unwrap();
    let mut r = std::ptr::null_mut();
    let mut t = std::ptr::null_mut();
    // SAFETY: valid pointers and live handles; the data pointer is read
    // only while its tensor lives, for the length the library gives.
    unsafe {
        assert_eq!(ss_content_reader_open(path.as_ptr(), &mut r), ss_status::SS_OK);
        assert_eq!(ss_content_reader_read_tensor(r, name.as_ptr(), &mut t), ss_status::SS_OK);
        let shrinker = Shrinker::start(&root);
        for _ in 0..READS {
            let p = ss_content_tensor_data(t).cast::<u8>();
            let n = ss_content_tensor_nbytes(t);
            assert!(std::slice::from_raw_parts(p, n) == &stored[0].1[..], "the held tensor's bytes changed");
            // A fresh reader: its cache does not hand back the held storage.
            let (mut r2, mut again) = (std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(ss_content_reader_open(path.as_ptr(), &mut r2), ss_status::SS_OK);
            if ss_content_reader_read_tensor(r2, name.as_ptr(), &mut again) == ss_status::SS_OK {
                let q = ss_content_tensor_data(again).cast::<u8>();
                assert!(std::slice::from_raw_parts(q, ss_content_tensor_nbytes(again)) == &stored[0].1[..]);
                ss_content_tensor_free(again);
            }
            ss_content_reader_free(r2);
        }
        drop(shrinker);
        ss_content_tensor_free(t);
        ss_content_reader_free(r);
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ssctl_verify_of_a_hostile_store_never_faults() {
    for format in [Format::Torch, Format::Native] {
        let (root, _) = hostile_store(&format!("verify-{}", format.name()), format);
        let shrinker = Shrinker::start(&root);
        for _ in 0..READS / 10 {
            let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(["store", "verify", root.to_str().unwrap()]).output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            // Exit 0 (all right) or 1 (a storage caught short, named): never a signal.
            match out.status.code() {
                Some(0) => assert!(text.contains("ok: no corrupt object"), "{text}"),
                Some(1) => assert!(text.contains("corrupt object(s)") && !text.contains("panicked"), "{text}"),
                other => panic!("ssctl store verify ended with {other:?} ({}):\n{text}", out.status),
            }
        }
        drop(shrinker);
        let _ = std::fs::remove_dir_all(&root);
    }
}
