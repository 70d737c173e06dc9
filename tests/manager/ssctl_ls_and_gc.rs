//! `ssctl ls` and `ssctl gc`: what they show, what gc removes, and that a
//! live creator's segment is never removed (also when its pid was reused).

#[path = "../common/mod.rs"]
mod common;

use common::{child_main, shm_exists, Parent, Peer};
use std::ffi::CString;
use std::process::Command;
use storage_sharing::manager::{gc, segments};
use storage_sharing::shm::flags::{NOCREATE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};

const ENTRY: &str = "child_entry";

#[test]
fn child_entry() {
    child_main(|role, mut parent| match role {
        "creator" => creator(&mut parent),
        other => panic!("unknown role {other}"),
    });
}

/// Creates a refcounted segment named after itself, leaves it behind
/// (count 1, as a killed holder would) and exits.
fn creator(parent: &mut Parent) {
    let name = new_process_wide_shm_handle();
    let m = RefcountedMapAllocator::open(&name, SHAREDMEM | storage_sharing::shm::flags::EXCLUSIVE, 1000).unwrap();
    std::mem::forget(m);
    parent.send(&name);
}

fn create_raw(name: &str) {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscalls on a name we own.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, 4096), 0);
        libc::close(fd);
    }
}

fn backdate(name: &str, secs: i64) {
    let path = CString::new(format!("/dev/shm{name}")).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let t = libc::timespec { tv_sec: now - secs, tv_nsec: 0 };
    // SAFETY: valid path and two timespecs.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), [t, t].as_ptr(), 0) }, 0);
}

fn unlink(name: &str) {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscall.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

fn ssctl(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(args).output().unwrap();
    assert!(out.status.success(), "ssctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn dead_creator_unused_segment_is_collected() {
    let mut peer = Peer::spawn(ENTRY, "creator", "");
    let name = peer.recv();
    let pid = peer.pid();
    peer.finish();
    let prefix = format!("torch_{pid}_");
    let listing = ssctl(&["ls", "--prefix", &prefix]);
    let row = listing.lines().find(|l| l.starts_with(&name)).unwrap_or_else(|| panic!("{listing}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cols[1..6], &["1064", "1", &pid.to_string(), "dead", "no"], "{row}");
    // Dry run reports, removes nothing.
    let dry = ssctl(&["gc", "--dry-run", "--prefix", &prefix]);
    assert!(dry.contains(&format!("would remove {name}")), "{dry}");
    assert!(shm_exists(&name));
    let out = ssctl(&["gc", "--prefix", &prefix]);
    assert!(out.contains(&format!("removed {name}")), "{out}");
    assert!(out.contains("removed 1 segment(s), 1064 bytes"), "{out}");
    assert!(!shm_exists(&name));
}

#[test]
fn dead_creator_segment_in_use_is_kept() {
    let mut peer = Peer::spawn(ENTRY, "creator", "");
    let name = peer.recv();
    let pid = peer.pid();
    peer.finish();
    let prefix = format!("torch_{pid}_");
    let map = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 1000).unwrap();
    let r = gc::collect(&prefix, false);
    assert!(r.removed.is_empty() && r.kept.len() == 1 && r.kept[0].in_use);
    assert_eq!(r.kept[0].refcount, Some(2));
    drop(map);
    // Our close took the count to 1 (the dead creator's), so it is still there.
    assert!(shm_exists(&name));
    let r = gc::collect(&prefix, false);
    assert_eq!(r.removed.len(), 1);
    assert!(!shm_exists(&name));
}

#[test]
fn live_creator_is_never_collected_even_unused() {
    let name = new_process_wide_shm_handle();
    create_raw(&name);
    let prefix = format!("torch_{}_", std::process::id());
    let segs = segments::scan(&prefix);
    let mine = segs.iter().find(|s| s.name == name).unwrap();
    assert!(mine.creator_alive && !mine.in_use);
    let r = gc::collect(&prefix, false);
    assert!(r.removed.iter().all(|s| s.name != name));
    assert!(shm_exists(&name));
    unlink(&name);
}

#[test]
fn reused_pid_does_not_keep_a_segment_alive() {
    // A live process whose pid is in the name, but which started after the
    // segment was made: not its creator.
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = sleeper.id();
    let old = format!("/torch_{pid}_1_424242");
    let new = format!("/torch_{pid}_1_424243");
    create_raw(&old);
    create_raw(&new);
    backdate(&old, 3600);
    let prefix = format!("torch_{pid}_1_42424");
    let r = gc::collect(&prefix, false);
    let removed: Vec<&str> = r.removed.iter().map(|s| s.name.as_str()).collect();
    let kept: Vec<&str> = r.kept.iter().map(|s| s.name.as_str()).collect();
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    unlink(&old);
    unlink(&new);
    assert_eq!(removed, vec![old.as_str()]);
    assert_eq!(kept, vec![new.as_str()]);
}

#[test]
fn usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(["gc", "--bogus"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument --bogus"));
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).arg("nope").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(ssctl(&["ls", "--prefix", "torch_0_"]).contains("0 segment(s)"));
}

#[test]
fn demo_symm_two_ranks_exchange_data() {
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(["demo", "symm", "64"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("rank 0: rendezvous") && text.contains("read rank 1's buffer in place: as rank 1 wrote it"), "{text}");
    assert!(text.contains("read rank 0's buffer in place: as rank 0 wrote it"), "{text}");
    assert!(text.contains("read \"hello from rank 0, through your own buffer\""), "{text}");
}

/// Processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(needle))
        .collect()
}

/// A size that is not a whole number of KiB in range is a usage error
/// (exit 2, a message) that starts nothing and leaves nothing behind.
#[test]
fn demo_symm_refuses_bad_sizes() {
    let tmp = std::env::temp_dir().join(format!("ssctl-demo-bad-{}", std::process::id()));
    for arg in ["0", "-5", "lots", "1048577", "99999999999999999999999"] {
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(["demo", "symm", arg]).env("TMPDIR", &tmp).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{arg}: {err}");
        assert!(
            err.contains(&format!("demo symm: the size must be a whole number of KiB from 1 to 1048576 (got {arg:?})")),
            "{arg}: {err}"
        );
        let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "{arg}: left in TMPDIR: {left:?}");
        let tmp_str = tmp.to_string_lossy().into_owned();
        assert_eq!(processes_mentioning(&tmp_str), Vec::<String>::new(), "{arg}: a rank is still running");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ssctl")).args(["demo", "symm", "64", "extra"]).env("TMPDIR", &tmp).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument \"extra\""));
    let _ = std::fs::remove_dir_all(&tmp);
}
