//! A hostile or broken client of the same user against the manager daemon:
//! descriptors sent with ordinary messages are closed at once (a flood
//! cannot exhaust the daemon's table), a segment whose users or header the
//! daemon cannot read is kept (never removed on doubt: out of descriptors,
//! or used by a non-dumpable process whose `/proc` entries it may not
//! read), and a file that its owner shrinks and regrows while the daemon
//! reads its header does not crash it (headers are read with `pread`).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/nobody.rs"]
mod nobody;

use common::{child_command_of, manager_bin, my_role, shm_exists, wait_until};
use nobody::{retry_while_busy, run_as_nobody, NobodyDir};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use storage_sharing::manager::protocol::AllocInfo;
use storage_sharing::manager::spawn::spawn_manager_at;
use storage_sharing::manager::Client;
use storage_sharing::shm::new_process_wide_shm_handle;

const LIMIT: Duration = Duration::from_secs(30);

fn connect(path: &str) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

fn record(free: bool, name: &str) -> [u8; 68] {
    AllocInfo::new(std::process::id() as i32, free, name).unwrap().encode()
}

/// Registers over a raw stream and expects "OK"; false when the manager
/// is gone (or does not answer).
fn try_register(s: &mut UnixStream, name: &str) -> bool {
    let mut ok = [0u8; 2];
    s.write_all(&record(false, name)).is_ok() && s.read_exact(&mut ok).is_ok() && &ok == b"OK"
}

fn register(s: &mut UnixStream, name: &str) {
    assert!(try_register(s, name), "the manager did not answer a registration of {name}");
}

/// Two round trips on `s`: every event the daemon saw before the first
/// (a connection closed, say) has been handled once the second is answered.
fn settle(s: &mut UnixStream) {
    for _ in 0..2 {
        register(s, &new_process_wide_shm_handle());
    }
}

/// A segment of `size` zero bytes nobody maps (a zero header: a
/// refcounted segment whose count is 0), or with `count` in its header.
fn create(name: &str, size: i64, count: i32) {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscalls on a name we own.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
        assert!(fd >= 0, "shm_open {name}: {}", std::io::Error::last_os_error());
        assert_eq!(libc::ftruncate(fd, size), 0);
        assert_eq!(libc::pwrite(fd, count.to_ne_bytes().as_ptr().cast(), 4, 0), 4);
        libc::close(fd);
    }
}

/// Maps `name` read-only in this process (raw, so unmapping removes nothing).
fn map(name: &str, size: usize) -> usize {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscalls on our own segment.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0);
        assert!(fd >= 0);
        let p = libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ, libc::MAP_SHARED, fd, 0);
        assert_ne!(p, libc::MAP_FAILED);
        libc::close(fd);
        p as usize
    }
}

fn unmap(p: usize, size: usize) {
    // SAFETY: unmapping what `map` mapped.
    unsafe { libc::munmap(p as *mut libc::c_void, size) };
}

fn unlink(name: &str) {
    let c = CString::new(name).unwrap();
    // SAFETY: plain syscall.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

/// The manager's pid, from the connected socket's peer credentials.
fn peer_pid(s: &UnixStream) -> i32 {
    use std::os::fd::AsRawFd;
    storage_sharing::fdpass::peer::credentials(s.as_raw_fd()).expect("SO_PEERCRED of a connected socket").0
}

/// The descriptor numbers process `pid` has open.
fn open_fds(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect()
}

/// Sets both limits of RLIMIT_NOFILE of process `pid` to `n`, or to its
/// hard limit if that is lower (ours to lower: same uid).
fn set_fd_limit(pid: i32, n: u64) {
    // SAFETY: plain data filled by prlimit.
    let mut old: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: reading the target's limits into `old`.
    assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) }, 0);
    let n = n.min(old.rlim_max);
    let r = libc::rlimit { rlim_cur: n, rlim_max: n };
    // SAFETY: plain data; prlimit only touches the target's limits.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &r, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

fn alive(pid: i32) -> bool {
    // SAFETY: probing the pid only.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// 720 registrations carrying 28 descriptors each (the flood)
/// once exhausted the daemon's descriptors: it then could not read /proc
/// or headers, took that for "nobody uses it", and removed a segment in
/// flight and one mapped by a live process; new clients got EMFILE. The
/// daemon's limit is lowered to 1024 (or less) first, so the flood would
/// exhaust it on any machine.
#[test]
fn a_flood_of_descriptors_is_closed_and_live_segments_stay() {
    let path = spawn_manager_at(&manager_bin()).unwrap();
    let mut flooder = connect(&path);
    let manager = peer_pid(&flooder);
    set_fd_limit(manager, 1024);
    let (mapped, in_flight) = (new_process_wide_shm_handle(), new_process_wide_shm_handle());
    create(&mapped, 8192, 0);
    // A sender's reference for its receiver on top of its own: in flight.
    create(&in_flight, 8192, 2);
    let view = map(&mapped, 8192);
    let mut victim = connect(&path);
    register(&mut victim, &mapped);
    register(&mut victim, &in_flight);

    let null = std::fs::File::open("/dev/null").unwrap();
    let fds = [null.as_raw_fd(); 28];
    let mut ok = [0u8; 2];
    for _ in 0..720 {
        let name = new_process_wide_shm_handle();
        let sent = storage_sharing::fdpass::send_fds(flooder.as_raw_fd(), &record(false, &name), &fds).unwrap();
        assert_eq!(sent, 68);
        flooder.read_exact(&mut ok).expect("the manager answers every registration");
    }
    let held = open_fds(manager).len();
    assert!(held < 64, "the manager holds {held} descriptors after the flood (the flood's were not closed)");

    // The victim goes: both names are abandoned, and must stay.
    drop(victim);
    settle(&mut flooder);
    let (mapped_kept, in_flight_kept) = (shm_exists(&mapped), shm_exists(&in_flight));
    // New clients are still served.
    let client = Client::connect(&path).unwrap();
    client.register(&new_process_wide_shm_handle()).unwrap();
    client.sync().unwrap();
    unmap(view, 8192);
    unlink(&mapped);
    unlink(&in_flight);
    assert!(mapped_kept, "a segment mapped by a live process was removed");
    assert!(in_flight_kept, "a segment in flight to a receiver was removed");
}

/// Out of descriptors, the daemon cannot read the /proc entries that say
/// who maps a segment: it must keep the segment, not take the silence for
/// "nobody". Its limit is set to exactly the descriptors it holds, so once
/// the victim's connection closes it can open one more file: the header,
/// or the /proc folder, but not a process's maps behind it.
#[test]
fn out_of_descriptors_it_keeps_what_it_cannot_check() {
    let path = spawn_manager_at(&manager_bin()).unwrap();
    let mut keeper = connect(&path);
    let manager = peer_pid(&keeper);
    let name = new_process_wide_shm_handle();
    create(&name, 8192, 0);
    let view = map(&name, 8192);
    let mut victim = connect(&path);
    register(&mut victim, &name);
    let max_fd = *open_fds(manager).iter().max().unwrap();
    set_fd_limit(manager, max_fd as u64 + 1);
    drop(victim);
    settle(&mut keeper);
    let kept = shm_exists(&name);
    unmap(view, 8192);
    unlink(&name);
    assert!(kept, "a segment mapped by a live process was removed when the manager could not read /proc");
}

#[test]
#[ignore = "entry point of the child process"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    assert_eq!(role, "non-dumpable-user");
    println!("\nresult={}", non_dumpable_user_keeps_its_segment(&args[0]));
}

/// Runs as uid 65534 with the manager `manager`: a forked child maps a
/// segment and makes itself non-dumpable (its /proc maps and fd are then
/// root's only); the client that registered the segment goes. Returns
/// "kept" or "removed".
fn non_dumpable_user_keeps_its_segment(manager: &str) -> String {
    let path = spawn_manager_at(std::path::Path::new(manager)).unwrap();
    let mut keeper = connect(&path);
    let name = new_process_wide_shm_handle();
    create(&name, 8192, 0);
    let c = CString::new(name.clone()).unwrap();
    let (mut to_child, mut from_parent) = ([0i32; 2], [0i32; 2]);
    // SAFETY: two pipes; the child below runs only syscalls until _exit.
    let pid = unsafe {
        assert_eq!(libc::pipe(to_child.as_mut_ptr()), 0);
        assert_eq!(libc::pipe(from_parent.as_mut_ptr()), 0);
        libc::fork()
    };
    if pid == 0 {
        // SAFETY: async-signal-safe syscalls only, then _exit.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0);
            let p = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_SHARED, fd, 0);
            libc::close(fd);
            let ok = p != libc::MAP_FAILED && libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) == 0;
            let b = if ok { b'y' } else { b'n' };
            libc::write(to_child[1], (&b as *const u8).cast(), 1);
            libc::close(from_parent[1]);
            let mut x = 0u8;
            libc::read(from_parent[0], (&mut x as *mut u8).cast(), 1);
            libc::_exit(0);
        }
    }
    let mut b = 0u8;
    // SAFETY: reading one byte from our pipe; closing our copies.
    unsafe {
        libc::close(to_child[1]);
        libc::close(from_parent[0]);
        assert_eq!(libc::read(to_child[0], (&mut b as *mut u8).cast(), 1), 1);
    }
    assert_eq!(b, b'y', "the child could not map the segment and become non-dumpable");
    assert!(std::fs::read(format!("/proc/{pid}/maps")).is_err(), "a non-dumpable process's maps are readable by its own uid here");
    let mut victim = connect(&path);
    register(&mut victim, &name);
    drop(victim);
    settle(&mut keeper);
    let kept = shm_exists(&name);
    // SAFETY: ending and reaping our child.
    unsafe {
        libc::close(from_parent[1]);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    unlink(&name);
    if kept { "kept" } else { "removed" }.to_string()
}

/// A non-dumpable process may map a segment, but /proc shows its maps and
/// descriptors to root only: a manager of the same (non-root) uid cannot
/// tell, so it keeps the segment. Runs the scenario as uid 65534.
#[test]
fn a_segment_a_non_dumpable_process_may_use_is_kept() {
    // SAFETY: geteuid has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        println!("a_segment_a_non_dumpable_process_may_use_is_kept: skipped: not root, cannot switch to uid 65534");
        return;
    }
    let dir = NobodyDir::new("nondumpable");
    let exe = dir.copy_of(&std::env::current_exe().unwrap());
    let manager = dir.copy_of(&manager_bin());
    let tmp = dir.path.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::os::unix::fs::chown(&tmp, Some(65534), Some(65534)).unwrap();
    let mut cmd = child_command_of(&exe, "non-dumpable-user", &[manager.to_str().unwrap()]);
    cmd.env("TMPDIR", &tmp);
    run_as_nobody(&mut cmd);
    let out = retry_while_busy(|| cmd.output());
    assert!(out.status.success(), "child failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("result=kept"), "the segment a non-dumpable process maps was removed:\n{text}");
}

/// A client registers its own /dev/shm file, abandons it, keeps it open,
/// and flips its size between 0 and 8 KiB while sending frees of it (each
/// makes the daemon read its header again). The daemon once read the
/// header through a mapping and died of SIGBUS within a second. It must
/// keep answering, and keep cleaning other segments.
#[test]
fn a_file_shrunk_and_regrown_under_it_does_not_crash_it() {
    let path = spawn_manager_at(&manager_bin()).unwrap();
    let mut sender = connect(&path);
    let manager = peer_pid(&sender);
    let flipped = new_process_wide_shm_handle();
    create(&flipped, 8192, 0);
    let c = CString::new(flipped.clone()).unwrap();
    // SAFETY: our own segment; the descriptor keeps it in use.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
    assert!(fd >= 0);
    let mut victim = connect(&path);
    register(&mut victim, &flipped);
    drop(victim);
    settle(&mut sender);
    assert!(shm_exists(&flipped), "a segment held open was removed");

    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let count = 5i32.to_ne_bytes();
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: resizing and writing our own file.
                unsafe {
                    libc::ftruncate(fd, 0);
                    libc::ftruncate(fd, 8192);
                    // Half the time a count above the dead reference (in
                    // flight), half a zero header (read, then /proc scanned).
                    libc::pwrite(fd, count.as_ptr().cast(), 4, 0);
                }
            }
        })
    };
    let free = record(true, &flipped);
    let mut answered = 0;
    for _ in 0..150 {
        if (0..20).any(|_| sender.write_all(&free).is_err()) || !try_register(&mut sender, &new_process_wide_shm_handle()) {
            break;
        }
        answered += 1;
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
    let survived = alive(manager);
    // SAFETY: closing our descriptor.
    unsafe { libc::close(fd) };
    unlink(&flipped);
    assert!(survived && answered == 150, "the manager died after {answered} of 150 rounds of 20 frees");

    // It still cleans up: an abandoned segment nobody uses goes.
    let other = new_process_wide_shm_handle();
    let mut s = connect(&path);
    register(&mut s, &other);
    create(&other, 4096, 0);
    drop(s);
    let gone = wait_until(LIMIT, || !shm_exists(&other));
    unlink(&other);
    assert!(gone, "an abandoned segment nobody uses was left after the flips");
}
