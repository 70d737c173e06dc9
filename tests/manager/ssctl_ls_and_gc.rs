//! `ssctl ls` and `ssctl gc`: what they show, what gc removes, and that a
//! live creator's segment is never removed (also when its pid was reused,
//! and when the creator runs in another pid namespace).

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
        // As the library's own segments: the pid in the name is of our namespace.
        storage_sharing::shm::creator_record::stamp(fd);
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

/// A process of another pid namespace (here a child namespace made with
/// unshare(CLONE_NEWPID), as a container sharing /dev/shm has) whose pid
/// there names no process here: the segments it made and left unmapped
/// (one with our creator record, one without, as PyTorch's) are kept while
/// it lives. Once it is gone they are removed where gc can see every
/// namespace (the initial one), else kept. Needs root for unshare.
#[test]
fn creator_in_another_pid_namespace_is_not_called_dead() {
    // SAFETY: geteuid has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED creator_in_another_pid_namespace_is_not_called_dead: unshare(CLONE_NEWPID) needs root");
        return;
    }
    // A pid free here: the creator gets it inside its own namespace.
    let inner = (20_000..30_000).find(|p| std::fs::metadata(format!("/proc/{p}")).is_err()).unwrap();
    let tag = std::process::id();
    let stamped = format!("/torch_{inner}_{tag}_1");
    let bare = format!("/torch_{inner}_{tag}_2");
    let names = [CString::new(stamped.as_str()).unwrap(), CString::new(bare.as_str()).unwrap()];
    let last_pid = CString::new((inner - 1).to_string()).unwrap();
    let mut fds = [0; 2];
    // SAFETY: a two-int array for pipe(2).
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the children make only async-signal-safe calls on memory
    // prepared before the fork, and end in pause or _exit.
    let holder = unsafe { libc::fork() };
    assert!(holder >= 0);
    if holder == 0 {
        unsafe {
            let report = |code: i32| {
                libc::write(fds[1], (&code as *const i32).cast(), 4);
                libc::_exit(0)
            };
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::unshare(libc::CLONE_NEWPID) != 0 {
                report(-*libc::__errno_location());
            }
            // The first child is pid 1 of the new namespace; it sets the
            // namespace's last pid so that its own child gets `inner`.
            if libc::fork() == 0 {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                let f = libc::open(c"/proc/sys/kernel/ns_last_pid".as_ptr(), libc::O_WRONLY);
                if f < 0 || libc::write(f, last_pid.as_ptr().cast(), last_pid.as_bytes().len()) < 0 {
                    report(-1000 - *libc::__errno_location());
                }
                libc::close(f);
                if libc::fork() == 0 {
                    if libc::getpid() != inner {
                        report(-2000 - libc::getpid());
                    }
                    for (i, n) in names.iter().enumerate() {
                        let fd = libc::shm_open(n.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
                        if fd < 0 || libc::ftruncate(fd, 4096) != 0 {
                            report(-3000 - *libc::__errno_location());
                        }
                        if i == 0 {
                            // The record our library writes: this namespace's inode.
                            let mut st: libc::stat = std::mem::zeroed();
                            if libc::stat(c"/proc/self/ns/pid".as_ptr(), &mut st) == 0 {
                                let mut text = [0u8; 24];
                                let mut v = st.st_ino;
                                let mut at = text.len();
                                loop {
                                    at -= 1;
                                    text[at] = b'0' + (v % 10) as u8;
                                    v /= 10;
                                    if v == 0 {
                                        break;
                                    }
                                }
                                libc::fsetxattr(fd, c"user.ss.pidns".as_ptr(), text[at..].as_ptr().cast(), text.len() - at, 0);
                            }
                        }
                        libc::close(fd);
                    }
                    let code = 0i32;
                    libc::write(fds[1], (&code as *const i32).cast(), 4);
                    loop {
                        libc::pause();
                    }
                }
                loop {
                    libc::pause();
                }
            }
            loop {
                libc::pause();
            }
        }
    }
    // SAFETY: our copy of the write end; then one report from the children.
    unsafe { libc::close(fds[1]) };
    let mut code = i32::MIN;
    // SAFETY: reads 4 bytes into `code`.
    unsafe { libc::read(fds[0], (&mut code as *mut i32).cast(), 4) };
    // SAFETY: our read end.
    unsafe { libc::close(fds[0]) };
    let stop = || {
        // SAFETY: our child, killed and reaped once; its namespace dies with it.
        unsafe {
            libc::kill(holder, libc::SIGKILL);
            libc::waitpid(holder, std::ptr::null_mut(), 0);
        }
    };
    if code == -libc::EPERM || code == -libc::EINVAL || code == -libc::ENOSYS {
        stop();
        eprintln!("SKIPPED creator_in_another_pid_namespace_is_not_called_dead: unshare(CLONE_NEWPID) refused here ({code})");
        return;
    }
    assert_eq!(code, 0, "the creator in the new pid namespace failed (report {code})");
    let prefix = format!("torch_{inner}_{tag}_");
    let r = gc::collect(&prefix, false);
    let removed: Vec<&str> = r.removed.iter().map(|s| s.name.as_str()).collect();
    let kept_alive = shm_exists(&stamped) && shm_exists(&bare);
    stop();
    if !kept_alive {
        unlink(&stamped);
        unlink(&bare);
    }
    assert!(kept_alive, "gc removed {removed:?}, segments of a live creator (pid {inner} of another pid namespace)");
    assert!(r.kept.iter().all(|s| s.creator_alive && !s.in_use), "{:?}", r.kept);

    // Gone: wait until no process has `inner` in a nested namespace any more.
    let nested_gone = || {
        std::fs::read_dir("/proc").unwrap().flatten().all(|e| {
            let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
            let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:")).unwrap_or("");
            !nspid.split_whitespace().skip(1).any(|p| p == inner.to_string())
        })
    };
    assert!(common::wait_until(std::time::Duration::from_secs(10), nested_gone), "the creator did not go");
    let in_init_ns = std::fs::metadata("/proc/self/ns/pid").map(|m| std::os::unix::fs::MetadataExt::ino(&m)).ok()
        == Some(storage_sharing::manager::creator::INIT_PID_NS);
    let r = gc::collect(&prefix, false);
    let mut removed: Vec<&str> = r.removed.iter().map(|s| s.name.as_str()).collect();
    removed.sort();
    unlink(&stamped);
    unlink(&bare);
    if in_init_ns {
        assert_eq!(removed, vec![stamped.as_str(), bare.as_str()], "from the initial namespace every creator can be seen");
    } else {
        assert!(removed.is_empty(), "removed {removed:?} although the creator's namespace cannot be seen from here");
    }
}

/// Arena segments by name and the weights pool's named (legacy) segments
/// carry the creator record too, as `torch_*` segments do: without it `ssctl
/// gc` in a container can never call their creator dead, and a kill -9 there
/// leaves them for good.
#[test]
fn arena_and_pool_segments_record_their_creators_pid_namespace() {
    use storage_sharing::arena::{Arena, ArenaOptions, Strategy};
    use storage_sharing::cuda::pool::{Pool, PoolDevice, PoolKind, PoolOptions};
    use storage_sharing::shm::creator_record::{pid_namespace, recorded};

    let probe = format!("/ss_xattr_probe_{}", std::process::id());
    create_raw(&probe);
    let supported = recorded(std::path::Path::new(&format!("/dev/shm{probe}"))).is_some();
    unlink(&probe);
    if !supported {
        eprintln!("SKIPPED arena_and_pool_segments_record_their_creators_pid_namespace: /dev/shm keeps no user extended attributes here");
        return;
    }
    let ours = pid_namespace();
    assert!(ours.is_some());
    let arena =
        Arena::new(ArenaOptions { segment_size: 1 << 20, strategy: Strategy::Name, max_holds: 64, large_threshold: 256 << 10 }).unwrap();
    let block = arena.alloc(4096, 64).unwrap();
    let handle = arena.share(block).unwrap();
    assert_eq!(recorded(std::path::Path::new(&format!("/dev/shm{}", handle.name))), ours, "arena segment {}", handle.name);
    arena.unshare(&handle).unwrap();

    let pool =
        Pool::new(PoolOptions { device: PoolDevice::Host, kind: PoolKind::Legacy, segment_size: 1 << 16, max_consumers: 2 }).unwrap();
    pool.alloc(1 << 16).unwrap();
    let prefix = format!("ss_pool_{}_", std::process::id());
    let names: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(!names.is_empty(), "the legacy pool made no named segment");
    for n in &names {
        assert_eq!(recorded(std::path::Path::new(&format!("/dev/shm/{n}"))), ours, "pool segment {n}");
    }
}
