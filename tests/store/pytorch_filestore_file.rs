//! The store in PyTorch's FileStore file against real PyTorch processes
//! (`torch.distributed.FileStore`, `init_process_group("file://...")`):
//! each side's operations are seen by the other, counters stay exact under
//! adders on both sides, waits wake on the other side's sets, the last of
//! mixed users removes the file, and symmetric memory meets through a file
//! PyTorch created. Then the bad inputs, which need no PyTorch.

#[path = "../common/mod.rs"]
mod common;

use common::{child_command, my_role, pattern, python, torch_available, wait_until};
use std::ffi::CString;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;
use storage_sharing::store::{Store, StoreRef, TorchFileStore};
use storage_sharing::symm::{self, group, DeviceType};
use storage_sharing::ErrorKind;

const LONG: Option<Duration> = Some(Duration::from_secs(120));

fn test_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ss-torchfile-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn open(path: &Path, world_size: i64) -> TorchFileStore {
    TorchFileStore::open(path, world_size, LONG).unwrap()
}

/// Starts PyTorch's Python on `script` with the store path as argv[1].
fn spawn_python(script: &str, path: &Path, extra: &[&str]) -> Child {
    let mut cmd = Command::new(python());
    cmd.arg("-c").arg(script).arg(path).args(extra).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.spawn().expect("spawn python")
}

fn finish_ok(child: Child, what: &str) -> String {
    let out = child.wait_with_output().unwrap();
    assert_ok(&out, what);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Common start of every Python side: the store at argv[1] with
/// world_size argv[2] (default -1) and a generous timeout.
const PY_OPEN: &str = r#"
import sys, datetime, time
import torch.distributed as d
ws = int(sys.argv[2]) if len(sys.argv) > 2 else -1
s = d.FileStore(sys.argv[1], ws)
s.set_timeout(datetime.timedelta(seconds=120))
"#;

// ------------------------------------------------------------- both ways

#[test]
fn pytorch_sees_our_operations_and_we_see_its() {
    if !torch_available("pytorch_sees_our_operations_and_we_see_its") {
        return;
    }
    let dir = test_dir("ops");
    let path = dir.join("store");
    let ours = open(&path, -1);
    ours.set(b"greeting", b"hello\0\xff").unwrap();
    assert_eq!(ours.add(b"count", 5).unwrap(), 5);
    assert_eq!(ours.add(b"count", -2).unwrap(), 3);
    assert_eq!(ours.compare_set(b"cas", b"", b"first").unwrap(), b"first");
    assert_eq!(ours.compare_set(b"cas", b"nope", b"x").unwrap(), b"first");
    ours.set(b"gone", b"x").unwrap();
    assert!(ours.delete_key(b"gone").unwrap());
    assert!(!ours.delete_key(b"gone").unwrap());
    ours.set(b"empty", b"").unwrap();
    let script = format!(
        "{PY_OPEN}{}",
        r#"
assert s.get(b"greeting") == b"hello\x00\xff", s.get(b"greeting")
assert s.add(b"count", 10) == 13
assert s.compare_set(b"cas", "first", "second") == b"second"
assert s.compare_set(b"cas", "first", "third") == b"second"
assert not s.check(["gone"])
assert s.check(["greeting", "count", "cas", "empty"])
assert s.get(b"empty") == b""
s.set(b"from_py", b"\x01\x00\x02")
s.delete_key(b"greeting")
print("num_keys", s.num_keys())
"#
    );
    let out = finish_ok(spawn_python(&script, &path, &[]), "python");
    // count, cas, empty, from_py and refcount/; PyTorch counts its own
    // bookkeeping keys, and we count them the same way.
    assert!(out.contains("num_keys 5"), "{out}");
    assert_eq!(ours.get(b"count", LONG).unwrap(), b"13");
    assert_eq!(ours.add(b"count", 1).unwrap(), 14);
    assert_eq!(ours.get(b"cas", LONG).unwrap(), b"second");
    assert_eq!(ours.get(b"from_py", LONG).unwrap(), b"\x01\x00\x02");
    assert!(!ours.check(&[b"greeting".as_slice()]).unwrap());
    assert!(ours.check(&[b"count".as_slice(), b"cas", b"empty", b"from_py"]).unwrap());
    let e = ours.get(b"greeting", Some(Duration::from_millis(50))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    // PyTorch's store closed since: cleanup/ joined the keys.
    assert_eq!(ours.num_keys().unwrap(), 6);
    drop(ours);
    assert!(path.exists(), "world_size -1 never removes the file");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn we_read_a_file_pytorch_wrote_from_its_start() {
    if !torch_available("we_read_a_file_pytorch_wrote_from_its_start") {
        return;
    }
    let dir = test_dir("pyfirst");
    let path = dir.join("store");
    let script = format!(
        "{PY_OPEN}{}",
        r#"
s.set(b"a", "1")
s.set(b"a", "2")
s.add(b"n", 7)
s.add(b"n", 7)
s.compare_set(b"c", "", "made")
s.set(b"d", "doomed")
s.delete_key(b"d")
s.set(b"big", bytes(range(256)) * 300)
"#
    );
    finish_ok(spawn_python(&script, &path, &[]), "python");
    let ours = open(&path, -1);
    assert_eq!(ours.get(b"a", LONG).unwrap(), b"2");
    assert_eq!(ours.get(b"n", LONG).unwrap(), b"14");
    assert_eq!(ours.get(b"c", LONG).unwrap(), b"made");
    assert!(!ours.check(&[b"d".as_slice()]).unwrap());
    let big: Vec<u8> = (0..300).flat_map(|_| 0..=255u8).collect();
    assert_eq!(ours.get(b"big", LONG).unwrap(), big);
    // a, n, c, big, refcount/, cleanup/
    assert_eq!(ours.num_keys().unwrap(), 6);
    drop(ours);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adders_on_both_sides_reach_exact_totals() {
    if !torch_available("adders_on_both_sides_reach_exact_totals") {
        return;
    }
    const EACH: i64 = 300;
    let dir = test_dir("adders");
    let path = dir.join("store");
    let shared = Arc::new(open(&path, -1));
    let script = format!("{PY_OPEN}s.wait([\"start\"])\nfor _ in range({EACH}):\n    s.add(\"total\", 1)\nprint(\"done\")\n");
    let pythons: Vec<Child> = (0..2).map(|_| spawn_python(&script, &path, &[])).collect();
    // Two threads share one store, a third has its own.
    let mut threads = Vec::new();
    for i in 0..3 {
        let store: Arc<TorchFileStore> = if i < 2 { shared.clone() } else { Arc::new(open(&path, -1)) };
        threads.push(std::thread::spawn(move || {
            store.wait(&[b"start".as_slice()], LONG).unwrap();
            for _ in 0..EACH {
                store.add(b"total", 1).unwrap();
            }
        }));
    }
    shared.set(b"start", b"").unwrap();
    for t in threads {
        t.join().unwrap();
    }
    for p in pythons {
        finish_ok(p, "python adder");
    }
    assert_eq!(shared.get(b"total", LONG).unwrap(), (5 * EACH).to_string().as_bytes());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn waits_wake_on_the_other_sides_set() {
    if !torch_available("waits_wake_on_the_other_sides_set") {
        return;
    }
    let dir = test_dir("wake");
    let path = dir.join("store");
    let ours = open(&path, -1);
    let script = format!(
        "{PY_OPEN}{}",
        r#"
s.set(b"py/waiting", "1")
s.wait(["ours"])
s.set(b"theirs", s.get(b"ours") + b"!")
"#
    );
    let child = spawn_python(&script, &path, &[]);
    // Python needs a while to start, so this wait really waits.
    ours.wait(&[b"py/waiting".as_slice()], LONG).unwrap();
    ours.set(b"ours", b"ping").unwrap();
    assert_eq!(ours.get(b"theirs", LONG).unwrap(), b"ping!");
    finish_ok(child, "python");
    let _ = std::fs::remove_dir_all(&dir);
}

// --------------------------------------------------------------- cleanup

#[test]
fn the_last_of_mixed_users_removes_the_file_when_it_is_ours() {
    if !torch_available("the_last_of_mixed_users_removes_the_file_when_it_is_ours") {
        return;
    }
    let dir = test_dir("cleanup-ours");
    let path = dir.join("store");
    let (a, b) = (open(&path, 3), open(&path, 3));
    let script = format!("{PY_OPEN}s.set(\"py/in\", \"1\")\ns.wait([\"release\"])\ndel s\n");
    let child = spawn_python(&script, &path, &["3"]);
    a.wait(&[b"py/in".as_slice()], LONG).unwrap();
    drop(a);
    assert!(path.exists(), "two users still have it open");
    b.set(b"release", b"").unwrap();
    finish_ok(child, "python");
    assert!(path.exists(), "one user still has it open");
    drop(b);
    assert!(!path.exists(), "the last of 3 users closed: the file must be gone");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_last_of_mixed_users_removes_the_file_when_it_is_pytorch() {
    if !torch_available("the_last_of_mixed_users_removes_the_file_when_it_is_pytorch") {
        return;
    }
    let dir = test_dir("cleanup-py");
    let path = dir.join("store");
    let a = open(&path, 2);
    // Python closes only after it sees our close: cleanup/ is a new key.
    let script = format!(
        "{PY_OPEN}{}",
        r#"
s.set(b"py/in", "1")
n = s.num_keys()
while s.num_keys() == n:
    time.sleep(0.01)
del s
"#
    );
    let child = spawn_python(&script, &path, &["2"]);
    a.wait(&[b"py/in".as_slice()], LONG).unwrap();
    drop(a);
    assert!(path.exists(), "PyTorch's store still has it open");
    finish_ok(child, "python");
    assert!(!path.exists(), "PyTorch's store closed last: it must have removed the file");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn init_process_group_ranks_share_the_file_with_us() {
    if !torch_available("init_process_group_ranks_share_the_file_with_us") {
        return;
    }
    let dir = test_dir("pg");
    let path = dir.join("store");
    let ours = open(&path, 2);
    let script = r#"
import sys, torch, torch.distributed as d
rank = int(sys.argv[2])
d.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
t = torch.ones(1) * (rank + 1)
d.all_reduce(t)
d.distributed_c10d._get_default_store().set(b"hello%d" % rank, "sum %d" % int(t.item()))
d.barrier()
d.destroy_process_group()
"#;
    let ranks: Vec<Child> = (0..2).map(|r| spawn_python(script, &path, &[&r.to_string()])).collect();
    // The default group's PrefixStore puts "default_pg/0/" + "/" before its keys.
    let keys: [&[u8]; 2] = [b"default_pg/0//hello0", b"default_pg/0//hello1"];
    ours.wait(&keys, LONG).unwrap();
    for k in keys {
        assert_eq!(ours.get(k, LONG).unwrap(), b"sum 3");
    }
    for (r, child) in ranks.into_iter().enumerate() {
        finish_ok(child, &format!("python rank {r}"));
    }
    assert!(path.exists(), "we still have it open");
    drop(ours);
    assert!(!path.exists(), "the last of the group's users closed: the file must be gone");
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------- symmetric memory

const SYMM_RANKS: usize = 3;

#[test]
fn symm_ranks_meet_through_a_file_pytorch_created() {
    if !torch_available("symm_ranks_meet_through_a_file_pytorch_created") {
        return;
    }
    let dir = test_dir("symm");
    let path = dir.join("store");
    let users = (SYMM_RANKS + 1).to_string();
    let script = format!("{PY_OPEN}s.set(\"py/created\", \"1\")\ns.wait([{}])\ndel s\n", done_keys().join(", "));
    let py = spawn_python(&script, &path, &[&users]);
    assert!(wait_until(Duration::from_secs(120), || path.exists()), "PyTorch never created {}", path.display());
    let ranks: Vec<Child> = (0..SYMM_RANKS)
        .map(|r| {
            let (p, rs) = (path.to_str().unwrap().to_string(), r.to_string());
            let mut cmd = child_command("symm_rank", &[&p, &rs, &users]);
            cmd.env("TMPDIR", &dir).stdout(Stdio::piped()).stderr(Stdio::piped());
            cmd.spawn().expect("spawn rank")
        })
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        assert_ok(&child.wait_with_output().unwrap(), &format!("rank {r}"));
    }
    finish_ok(py, "python");
    assert!(!path.exists(), "all {users} users closed: the file must be gone");
    let _ = std::fs::remove_dir_all(&dir);
}

fn done_keys() -> Vec<String> {
    (0..SYMM_RANKS).map(|r| format!("\"done/{r}\"")).collect()
}

/// One symmetric-memory rank: meets its peers through the FileStore file,
/// checks every peer's buffer, then tells PyTorch it is done.
fn symm_rank(args: Vec<String>) {
    let (path, rank, users): (&str, usize, i64) = (&args[0], args[1].parse().unwrap(), args[2].parse().unwrap());
    let store: StoreRef = Arc::new(TorchFileStore::open(path, users, LONG).unwrap());
    store.wait(&[b"py/created".as_slice()], LONG).unwrap();
    group::set_group_info("torchfile", rank as i64, SYMM_RANKS as i64, store.clone()).unwrap();
    let size = 4096;
    let p = symm::alloc(DeviceType::Cpu, 0, size, Some("torchfile")).unwrap();
    let h = symm::rendezvous(p, None, LONG).unwrap();
    // SAFETY: each rank writes only its own buffer before the barrier.
    unsafe { std::slice::from_raw_parts_mut(p, size) }.copy_from_slice(&pattern(size, rank as u8));
    h.barrier(0, LONG, 0).unwrap();
    for peer in 0..SYMM_RANKS {
        let q = h.buffer_ptr(peer as i64).unwrap();
        // SAFETY: every peer's buffer is mapped for `size` bytes and no
        // longer written.
        let got = unsafe { std::slice::from_raw_parts(q, size) };
        assert!(got == &pattern(size, peer as u8)[..], "rank {rank} read a wrong buffer of rank {peer}");
    }
    h.barrier(0, LONG, 0).unwrap();
    drop(h);
    symm::free(p).unwrap();
    store.set(format!("done/{rank}").as_bytes(), b"").unwrap();
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    match role.as_str() {
        "forks_a_child_that_exits" => forks_a_child_that_exits(args),
        "write_cut_by_a_file_size_limit" => write_cut_by_a_file_size_limit(args),
        "symm_rank" => symm_rank(args),
        "huge_lengths_are_corrupt" => huge_lengths_are_corrupt(args),
        other => panic!("unknown role {other}"),
    }
}

// ------------------------------------------------- without PyTorch: ours

#[test]
fn a_forked_child_does_not_count_its_parents_store_out() {
    let dir = test_dir("fork");
    let path = dir.join("store");
    let mut cmd = child_command("forks_a_child_that_exits", &[path.to_str().unwrap()]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    assert_ok(&cmd.output().unwrap(), "forking child");
    assert!(!path.exists(), "the parent, its only user (world_size 1), closed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failed_append_leaves_no_cut_record() {
    let dir = test_dir("fsize");
    let path = dir.join("store");
    let mut cmd = child_command("write_cut_by_a_file_size_limit", &[path.to_str().unwrap()]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    assert_ok(&cmd.output().unwrap(), "child under a file size limit");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sets a value the file size limit cuts halfway (the first write lands
/// in part, the rest fails), then checks the file is whole and usable.
fn write_cut_by_a_file_size_limit(args: Vec<String>) {
    let path = PathBuf::from(&args[0]);
    let store = open(&path, -1);
    store.set(b"a", b"1").unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on this process's own limits and signal mask.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut old), 0);
        let cut = libc::rlimit { rlim_cur: size + 10, rlim_max: old.rlim_max };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &cut), 0);
    }
    let e = store.set(b"big", &[7u8; 100]).unwrap_err();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &old) }, 0);
    assert!(e.message().contains(path.to_str().unwrap()), "{}", e.message());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), size, "a cut record was left behind");
    assert_eq!(store.get(b"a", LONG).unwrap(), b"1");
    store.set(b"big", &[7u8; 100]).unwrap();
    assert_eq!(store.get(b"big", LONG).unwrap(), [7u8; 100]);
}

/// Opens a store (world_size 1), forks a child that exits through libc's
/// `exit` (running the exit hooks), and checks the file still counts the
/// parent in.
fn forks_a_child_that_exits(args: Vec<String>) {
    let path = PathBuf::from(&args[0]);
    let store = open(&path, 1);
    // SAFETY: the child only calls exit, which runs the exit hooks.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: ends the forked child.
        unsafe { libc::exit(0) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: waits for the child we forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(path.exists(), "the child's exit removed its parent's file");
    assert_eq!(store.num_keys().unwrap(), 1, "the child's exit counted its parent out (cleanup/ appeared)");
    drop(store);
}

#[test]
fn our_stores_share_the_file_and_the_last_removes_it() {
    let dir = test_dir("alone");
    let path = dir.join("store");
    let stores: Vec<Arc<TorchFileStore>> = (0..3).map(|_| Arc::new(open(&path, 3))).collect();
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let s = stores[i % 3].clone();
            std::thread::spawn(move || {
                for _ in 0..200 {
                    s.add(b"n", 1).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(stores[1].get(b"n", LONG).unwrap(), b"1200");
    let mut stores = stores;
    stores.pop();
    stores.pop();
    assert!(path.exists());
    stores.pop();
    assert!(!path.exists(), "the last of 3 closed");
    // world_size -1: nobody removes it.
    drop(open(&path, -1));
    assert!(path.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_that_is_not_a_log_is_corrupt_with_its_offset() {
    let dir = test_dir("corrupt");
    // A whole record, then a key length promising more than the file holds.
    let path = dir.join("cut");
    let mut bytes = Vec::new();
    bytes.extend(2u32.to_ne_bytes());
    bytes.extend(b"/a");
    bytes.extend(1u32.to_ne_bytes());
    bytes.extend(b"1");
    let good = bytes.len();
    bytes.extend(0xffff_fff0u32.to_ne_bytes());
    bytes.extend(b"xyz");
    std::fs::write(&path, &bytes).unwrap();
    let e = TorchFileStore::open(&path, -1, LONG).err().expect("a corrupt file must be refused");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{}", e.message());
    assert!(e.message().contains(&format!("offset {good}")) && e.message().contains("cut"), "{}", e.message());
    // Through the C API: SS_ERR_CORRUPT.
    let c_path = CString::new(path.to_str().unwrap()).unwrap();
    let mut out = std::ptr::null_mut();
    // SAFETY: a valid string and out pointer.
    let st = unsafe { storage_sharing::ffi::store::ss_store_torch_file_open(c_path.as_ptr(), -1, 1000, &mut out) };
    assert_eq!(st, storage_sharing::ffi::status::ss_status::SS_ERR_CORRUPT);
    assert!(out.is_null());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_record_cut_after_open_fails_reads_instead_of_hanging() {
    let dir = test_dir("cut-later");
    let path = dir.join("store");
    let store = open(&path, -1);
    store.set(b"a", b"1").unwrap();
    let end = std::fs::metadata(&path).unwrap().len();
    // A writer killed after its key's length: 3 bytes of a 4-byte length.
    OpenOptions::new().append(true).open(&path).unwrap().write_all(&[9, 0, 0]).unwrap();
    let e = store.get(b"b", None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{}", e.message());
    assert!(e.message().contains(&format!("offset {end}")), "{}", e.message());
    assert_eq!(store.wait(&[b"b".as_slice()], None).unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(store.check(&[b"a".as_slice()]).unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(store.num_keys().unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(store.add(b"a", 1).unwrap_err().kind(), ErrorKind::Corrupt);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_refused_with_what_was_wrong() {
    let dir = test_dir("args");
    let e = TorchFileStore::open(&dir, -1, LONG).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("folder"), "{}", e.message());
    let e = TorchFileStore::open(dir.join("s"), -2, LONG).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("world_size is -2"), "{}", e.message());
    assert_eq!(TorchFileStore::open("", -1, LONG).err().unwrap().kind(), ErrorKind::InvalidArgument);
    let e = TorchFileStore::open(dir.join("no/such/folder/s"), -1, LONG).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{}", e.message());

    let store = open(&dir.join("s"), -1);
    store.set(b"text", b"twelve").unwrap();
    let e = store.add(b"text", 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("\"text\""), "{}", e.message());
    store.set(b"max", i64::MAX.to_string().as_bytes()).unwrap();
    assert_eq!(store.add(b"max", 1).unwrap(), i64::MIN, "add wraps, as in every store");
    let e = store.get(b"never", Some(Duration::from_millis(30))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.message().contains("\"never\"") && e.message().contains("FileStore"), "{}", e.message());
    let e = store.wait(&[b"text".as_slice(), b"never"], Some(Duration::from_millis(30))).unwrap_err();
    assert!(e.message().contains("\"never\"") && !e.message().contains("\"text\""), "{}", e.message());

    use storage_sharing::ffi::status::ss_status::*;
    let c_path = CString::new(dir.join("c").to_str().unwrap()).unwrap();
    let mut out = std::ptr::null_mut();
    // SAFETY: valid strings and out pointers, or NULLs the API must refuse.
    unsafe {
        use storage_sharing::ffi::store::ss_store_torch_file_open as open_c;
        assert_eq!(open_c(std::ptr::null(), -1, 0, &mut out), SS_ERR_NULL_POINTER);
        assert_eq!(open_c(c_path.as_ptr(), -1, 0, std::ptr::null_mut()), SS_ERR_NULL_POINTER);
        assert_eq!(open_c(c_path.as_ptr(), -1, -5, &mut out), SS_ERR_INVALID_ARGUMENT);
        assert_eq!(open_c(c_path.as_ptr(), -7, 0, &mut out), SS_ERR_INVALID_ARGUMENT);
        assert_eq!(open_c(c_path.as_ptr(), 1, 0, &mut out), SS_OK);
        storage_sharing::ffi::store::ss_store_free(out);
    }
    assert!(!dir.join("c").exists(), "its only user (world_size 1) closed");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_lock_held_by_a_stalled_peer_times_out() {
    let dir = test_dir("stalled");
    let path = dir.join("store");
    let store = TorchFileStore::open(&path, -1, Some(Duration::from_millis(100))).unwrap();
    let holder = std::fs::File::open(&path).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    let e = store.set(b"k", b"v").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.message().contains("lock") && e.message().contains(path.to_str().unwrap()), "{}", e.message());
    // Unlocked explicitly: a child that a sibling test is spawning may hold
    // a copy of `holder` for a moment, and a copy keeps a flock until closed.
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_UN) }, 0);
    drop(holder);
    store.set(b"k", b"v").unwrap();
    assert_eq!(store.get(b"k", LONG).unwrap(), b"v");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------- huge lengths a hostile writer declares

/// The size a hostile or broken process grows the file to (sparse).
const HUGE: u64 = 8 << 40;

/// Regression: catching up read the whole unread part of the file into one
/// `vec![0; len]`, so a file grown sparse to 8 TiB aborted the process
/// ("memory allocation failed"), which no C guard can catch. Now every
/// length is bounded by the file and read in chunks: the file is
/// `Corrupt`, through the Rust API and the C API, and the process lives.
/// Run in a child so the old abort shows as a failed child, not a lost
/// test binary.
#[test]
fn a_file_grown_sparse_to_8_tib_or_with_huge_lengths_is_corrupt() {
    let dir = test_dir("huge");
    let mut cmd = child_command("huge_lengths_are_corrupt", &[dir.to_str().unwrap()]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    assert_ok(&cmd.output().unwrap(), "child reading huge lengths");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One valid record (`/a` = `1`), as PyTorch writes it.
fn one_record() -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend(2u32.to_ne_bytes());
    bytes.extend(b"/a");
    bytes.extend(1u32.to_ne_bytes());
    bytes.extend(b"1");
    bytes
}

fn huge_lengths_are_corrupt(args: Vec<String>) {
    use storage_sharing::ffi::status::ss_status::*;
    use storage_sharing::ffi::store::{ss_store_free, ss_store_get, ss_store_torch_file_open};
    let dir = PathBuf::from(&args[0]);
    let c = |p: &Path| CString::new(p.to_str().unwrap()).unwrap();
    let c_get = |s: *mut storage_sharing::ffi::store::SsStore| {
        let mut buf = [0u8; 16];
        let mut len = 0usize;
        // SAFETY: a live handle, a NUL-terminated key and valid out pointers.
        unsafe { ss_store_get(s, c"a".as_ptr(), 1000, buf.as_mut_ptr().cast(), buf.len(), &mut len) }
    };

    // 1. A store in use, then the file grown sparse to 8 TiB behind it.
    let path = dir.join("sparse");
    let ours = open(&path, -1);
    ours.set(b"a", b"1").unwrap();
    let c_path = c(&path);
    let mut handle = std::ptr::null_mut();
    // SAFETY: a valid path and out pointer.
    assert_eq!(unsafe { ss_store_torch_file_open(c_path.as_ptr(), -1, 1000, &mut handle) }, SS_OK);
    let end = std::fs::metadata(&path).unwrap().len();
    if let Err(e) = OpenOptions::new().write(true).open(&path).unwrap().set_len(HUGE) {
        println!("SKIP: this file system cannot hold an 8 TiB sparse file: {e}");
        // SAFETY: the handle opened above.
        unsafe { ss_store_free(handle) };
        return;
    }
    let e = ours.get(b"a", LONG).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{}", e.message());
    for part in [path.to_str().unwrap(), &format!("offset {end}"), &format!("ends at offset {HUGE}")] {
        assert!(e.message().contains(part), "{part} missing: {}", e.message());
    }
    assert_eq!(ours.add(b"n", 1).unwrap_err().kind(), ErrorKind::Corrupt);
    let e = TorchFileStore::open(&path, -1, LONG).err().expect("a fresh store must refuse the file");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{}", e.message());
    assert_eq!(c_get(handle), SS_ERR_CORRUPT, "the C handle opened before the file grew");
    let mut fresh = std::ptr::null_mut();
    // SAFETY: a valid path and out pointer.
    assert_eq!(unsafe { ss_store_torch_file_open(c_path.as_ptr(), -1, 1000, &mut fresh) }, SS_ERR_CORRUPT);
    assert!(fresh.is_null());
    // SAFETY: the handle opened above, freed once.
    unsafe { ss_store_free(handle) };
    drop(ours);

    // 2. Records whose key or value claims more than the file holds: at
    // the format's largest length, and one byte more than is left.
    let good = one_record();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut max_key = good.clone();
    max_key.extend(u32::MAX.to_ne_bytes());
    max_key.extend(b"/k");
    cases.push(("max-key", max_key));
    let mut max_value = good.clone();
    max_value.extend(2u32.to_ne_bytes());
    max_value.extend(b"/k");
    max_value.extend(u32::MAX.to_ne_bytes());
    max_value.extend(b"v");
    cases.push(("max-value", max_value));
    let mut one_over = good.clone();
    one_over.extend(2u32.to_ne_bytes());
    one_over.extend(b"/k");
    one_over.extend(4u32.to_ne_bytes());
    one_over.extend(b"abc");
    cases.push(("one-over", one_over));
    for (tag, bytes) in cases {
        let path = dir.join(tag);
        std::fs::write(&path, &bytes).unwrap();
        let e = TorchFileStore::open(&path, -1, LONG).err().expect(tag);
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{tag}: {}", e.message());
        assert!(e.message().contains(&format!("offset {}", good.len())) && e.message().contains(tag), "{tag}: {}", e.message());
        assert!(e.message().contains("bytes but only"), "{tag}: the length is named: {}", e.message());
        let mut out = std::ptr::null_mut();
        // SAFETY: a valid path and out pointer.
        assert_eq!(unsafe { ss_store_torch_file_open(c(&path).as_ptr(), -1, 1000, &mut out) }, SS_ERR_CORRUPT, "{tag}");
        assert!(out.is_null());
        // The same record appended under an open store fails its reads.
        let path = dir.join(format!("{tag}-later"));
        std::fs::write(&path, &good).unwrap();
        let mut handle = std::ptr::null_mut();
        // SAFETY: as above.
        assert_eq!(unsafe { ss_store_torch_file_open(c(&path).as_ptr(), -1, 1000, &mut handle) }, SS_OK, "{tag}");
        OpenOptions::new().append(true).open(&path).unwrap().write_all(&bytes[good.len()..]).unwrap();
        assert_eq!(c_get(handle), SS_ERR_CORRUPT, "{tag}");
        // SAFETY: the handle opened above, freed once.
        unsafe { ss_store_free(handle) };
    }
    println!("ok");
}
