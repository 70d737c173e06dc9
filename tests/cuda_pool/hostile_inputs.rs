//! A consumer of the GPU weights pool facing hostile input: forged handles,
//! a fake producer (this process, so the pid check passes) sending
//! malformed hellos and manifests (storages and tensors outside their
//! segments, huge counts, bad dtypes, duplicate names, truncated bytes,
//! wrong descriptor counts, unsealed or short memfds), and a stranger
//! (uid 65534) answering at the name of a gone producer. Every case is a
//! clear error, and nothing is left mapped or open.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/nobody.rs"]
mod nobody;

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;
use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::cuda::pool::control::{ControlWriter, HoldSlot};
use storage_sharing::cuda::pool::manifest::{Manifest, SegmentEntry, StorageEntry, TensorEntry};
use storage_sharing::cuda::pool::wire::{Hello, CHUNK, STATUS_OK};
use storage_sharing::cuda::pool::{PoolDevice, PoolHandle, PoolKind, Weights};
use storage_sharing::fdpass::{abstract_socket, seals, send_fds};
use storage_sharing::ErrorKind;

const T: Option<Duration> = Some(Duration::from_secs(20));
const SEG: usize = 64 << 10;

/// This process's start time, as a handle of its own carries it.
fn me_started() -> u64 {
    storage_sharing::proc_identity::me().1
}

/// A handle naming this process (the fake producer) at socket `name`.
fn handle_of_ours(name: String) -> PoolHandle {
    PoolHandle {
        socket_name: name,
        producer_pid: std::process::id() as i32,
        producer_start: me_started(),
        device: PoolDevice::Host,
        kind: PoolKind::Vmm,
    }
}

fn pool_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("ss-pool") || l.contains("forged")).count()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd(size: usize, sealed: bool) -> OwnedFd {
    let fd = seals::sealable_memfd(c"forged-segment", "a forged segment").unwrap();
    // SAFETY: ftruncate on our own memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) }, 0);
    if sealed {
        seals::seal_against_shrinking(fd.as_raw_fd(), "a forged segment").unwrap();
    }
    fd
}

fn good_manifest() -> Manifest {
    Manifest {
        segments: vec![SegmentEntry { size: SEG as u64, handle: vec![] }],
        storages: vec![StorageEntry { segment: 0, offset: 0, nbytes: 4096 }],
        tensors: vec![TensorEntry {
            name: "w".into(),
            storage: 0,
            dtype: Dtype::Float32,
            sizes: vec![1024],
            strides: vec![1],
            storage_offset: 0,
        }],
    }
}

/// What a fake producer sends: the hello, its descriptors, manifest bytes
/// (maybe fewer than the hello announces), then it hangs up.
struct Forgery {
    hello: Hello,
    fds: Vec<OwnedFd>,
    manifest: Vec<u8>,
}

fn forgery(m: &Manifest) -> Forgery {
    let bytes = m.encode();
    let (_control, control_fd) = ControlWriter::create(4).unwrap();
    let (_hold, hold_fd) = HoldSlot::create().unwrap();
    let mut fds = vec![control_fd, hold_fd];
    fds.extend(m.segments.iter().map(|_| memfd(SEG, true)));
    let hello =
        Hello { status: STATUS_OK, kind: 0, slot: 0, slots: 4, segments: m.segments.len() as u32, manifest_len: bytes.len() as u64 };
    Forgery { hello, fds, manifest: bytes }
}

/// Serves `f` once at a fresh name in a thread of this process and opens
/// it: the error, with the check that nothing was left mapped or open.
fn open_forged(f: Forgery) -> storage_sharing::Error {
    let name = abstract_socket::unique_name_with("ss_pool_test");
    let listener = abstract_socket::listen(&name).unwrap();
    let server = std::thread::spawn(move || {
        let mut p = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 20_000) };
        let conn = abstract_socket::accept(listener.as_raw_fd()).unwrap();
        let raw: Vec<i32> = f.fds.iter().map(|fd| fd.as_raw_fd()).collect();
        let _ = send_fds(conn.as_raw_fd(), &f.hello.encode(), &raw);
        for chunk in f.manifest.chunks(CHUNK) {
            let _ = send_fds(conn.as_raw_fd(), chunk, &[]);
        }
        // Hang up once the consumer is done with us.
        let mut p = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 2_000) };
        // What was open before the consumer started stays open until counted.
        (listener, f.fds)
    });
    let h = handle_of_ours(name);
    let (fds, maps) = (open_fds(), pool_mappings());
    let e = Weights::open(&h, T).err().expect("a forged pool must be refused");
    let kept = server.join().unwrap();
    assert_eq!(pool_mappings(), maps, "{e}: something stayed mapped");
    assert_eq!(open_fds(), fds, "{e}: a descriptor leaked");
    drop(kept);
    e
}

fn refused(f: Forgery, kind: ErrorKind, what: &str) {
    let e = open_forged(f);
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.message().contains(what), "{what:?} not in: {e}");
}

/// The forgeries share the process's descriptor table: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn a_well_formed_forgery_opens() {
    let _g = serial();
    // The harness itself works: a correct fake producer is accepted.
    let name = abstract_socket::unique_name_with("ss_pool_test");
    let listener = abstract_socket::listen(&name).unwrap();
    let f = forgery(&good_manifest());
    let server = std::thread::spawn(move || {
        let mut p = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 20_000) };
        let conn = abstract_socket::accept(listener.as_raw_fd()).unwrap();
        let raw: Vec<i32> = f.fds.iter().map(|fd| fd.as_raw_fd()).collect();
        send_fds(conn.as_raw_fd(), &f.hello.encode(), &raw).unwrap();
        send_fds(conn.as_raw_fd(), &f.manifest, &[]).unwrap();
        conn
    });
    let h = handle_of_ours(name);
    let w = Weights::open(&h, T).unwrap();
    let _conn = server.join().unwrap();
    assert_eq!(w.tensors()[0].name, "w");
}

#[test]
fn malformed_manifests_are_refused_and_nothing_is_mapped() {
    let _g = serial();
    let mut m = good_manifest();
    m.storages[0].offset = SEG as u64 - 100;
    refused(forgery(&m), ErrorKind::Protocol, "lies outside segment 0");
    let mut m = good_manifest();
    m.storages[0].offset = u64::MAX - 8;
    refused(forgery(&m), ErrorKind::Protocol, "lies outside segment 0");
    let mut m = good_manifest();
    m.tensors[0].sizes = vec![1025];
    refused(forgery(&m), ErrorKind::Protocol, "reaches 4100 bytes");
    let mut m = good_manifest();
    m.tensors[0].strides = vec![i64::MAX];
    refused(forgery(&m), ErrorKind::Protocol, "overflows");
    let mut m = good_manifest();
    m.tensors.push(m.tensors[0].clone());
    refused(forgery(&m), ErrorKind::Protocol, "appears twice");
    // A bad dtype code.
    let mut f = forgery(&good_manifest());
    let at = f.manifest.len() - (8 * 3 + 1 + 4);
    f.manifest[at..at + 4].copy_from_slice(&77i32.to_le_bytes());
    refused(f, ErrorKind::Protocol, "dtype code 77");
    // Huge counts.
    let mut f = forgery(&good_manifest());
    f.manifest[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    refused(f, ErrorKind::Protocol, "above the limits");
    // Truncated: fewer bytes than the hello announced, then a hang-up.
    let mut f = forgery(&good_manifest());
    f.manifest.truncate(20);
    refused(f, ErrorKind::PeerGone, "is gone");
    // A manifest longer than announced.
    let mut f = forgery(&good_manifest());
    f.hello.manifest_len -= 1;
    refused(f, ErrorKind::Protocol, "more manifest bytes");
    // An absurd manifest length.
    let mut f = forgery(&good_manifest());
    f.hello.manifest_len = u64::MAX;
    refused(f, ErrorKind::Protocol, "announced a manifest");
}

#[test]
fn malformed_hellos_and_descriptors_are_refused() {
    let _g = serial();
    let mut f = forgery(&good_manifest());
    f.fds.pop();
    refused(f, ErrorKind::Protocol, "sent 2 descriptors for 1 segments");
    let mut f = forgery(&good_manifest());
    f.fds.push(memfd(SEG, true));
    refused(f, ErrorKind::Protocol, "sent 4 descriptors");
    let mut f = forgery(&good_manifest());
    f.hello.kind = 1;
    refused(f, ErrorKind::Protocol, "its handle says Vmm");
    let mut f = forgery(&good_manifest());
    f.hello.slot = 9;
    refused(f, ErrorKind::Protocol, "gave slot 9 of 4");
    let mut f = forgery(&good_manifest());
    f.hello.slots = 5000;
    f.hello.slot = 4999;
    refused(f, ErrorKind::Protocol, "5000 slots announced");
    // A segment descriptor the sender could shrink under our mapping.
    let mut f = forgery(&good_manifest());
    f.fds[2] = memfd(SEG, false);
    refused(f, ErrorKind::Permission, "not sealed against shrinking");
    // A segment smaller than the manifest says.
    let mut f = forgery(&good_manifest());
    f.fds[2] = memfd(4096, true);
    refused(f, ErrorKind::SizeMismatch, "fewer than the 65536");
    // A control block that is no control block.
    let mut f = forgery(&good_manifest());
    f.fds[0] = memfd(4096, true);
    refused(f, ErrorKind::Protocol, "control block has magic");
    // Segments announced but the manifest has another count.
    let mut f = forgery(&good_manifest());
    f.hello.segments = 0;
    f.fds.truncate(2);
    refused(f, ErrorKind::Protocol, "announced 0 segments, its manifest has 1");
    // Not a hello at all.
    let mut f = forgery(&good_manifest());
    f.hello.status = STATUS_OK;
    let mut bytes = f.hello.encode();
    bytes[0] = b'X';
    let name = abstract_socket::unique_name_with("ss_pool_test");
    let listener = abstract_socket::listen(&name).unwrap();
    let server = std::thread::spawn(move || {
        let mut p = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 20_000) };
        let conn = abstract_socket::accept(listener.as_raw_fd()).unwrap();
        send_fds(conn.as_raw_fd(), &bytes, &[]).unwrap();
        conn
    });
    let h = handle_of_ours(name);
    let e = Weights::open(&h, T).err().unwrap();
    drop(server.join().unwrap());
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
}

#[test]
fn forged_handles_are_refused_before_or_at_the_socket() {
    let _g = serial();
    let e = PoolHandle::from_bytes(b"SSPH\x01\x00").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // Nobody listens at that name.
    let h = PoolHandle {
        socket_name: "ss_pool-1-nobody".into(),
        producer_pid: 1,
        producer_start: 1,
        device: PoolDevice::Host,
        kind: PoolKind::Vmm,
    };
    assert_eq!(Weights::open(&h, T).err().unwrap().kind(), ErrorKind::PeerGone);
    // Someone listens, but not the pid the handle names.
    let name = abstract_socket::unique_name_with("ss_pool_test");
    let _listener = abstract_socket::listen(&name).unwrap();
    let h = PoolHandle { producer_pid: std::process::id() as i32 + 1, ..handle_of_ours(name) };
    let e = Weights::open(&h, T).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("refused"), "{e}");
    // The pid the handle names, but a process that started at another time:
    // the producer exited and its pid went to this one.
    let name = abstract_socket::unique_name_with("ss_pool_test");
    let _listener = abstract_socket::listen(&name).unwrap();
    let h = PoolHandle { producer_start: me_started() + 1, ..handle_of_ours(name) };
    let e = Weights::open(&h, T).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("reused"), "{e}");
}

/// The stranger's side: binds the name in its argument and answers with a
/// pool-looking hello whose descriptors would be mapped if trusted.
#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = common::my_role() else { return };
    assert_eq!(role, "squatter");
    let listener = abstract_socket::listen(&args[0]).unwrap();
    println!("ready");
    let mut p = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, 20_000) };
    if let Ok(conn) = abstract_socket::accept(listener.as_raw_fd()) {
        let f = forgery(&good_manifest());
        let raw: Vec<i32> = f.fds.iter().map(|fd| fd.as_raw_fd()).collect();
        let _ = send_fds(conn.as_raw_fd(), &f.hello.encode(), &raw);
        let _ = send_fds(conn.as_raw_fd(), &f.manifest, &[]);
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn a_strangers_socket_at_a_gone_producers_name_is_refused() {
    use std::io::BufRead;
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        println!("a_strangers_socket_at_a_gone_producers_name_is_refused: skipped: needs root to play uid 65534");
        return;
    }
    let _g = serial();
    // A producer that exported and went: its name is free for anyone.
    let pool = storage_sharing::cuda::pool::Pool::new(storage_sharing::cuda::pool::PoolOptions {
        device: PoolDevice::Host,
        kind: PoolKind::Vmm,
        segment_size: SEG,
        max_consumers: 4,
    })
    .unwrap();
    pool.alloc(512).unwrap();
    let h = pool.export().unwrap();
    drop(pool);
    let dir = nobody::NobodyDir::new("pool-squatter");
    let exe = dir.copy_of(&std::env::current_exe().unwrap());
    let mut cmd = common::child_command_of(&exe, "squatter", &[&h.socket_name]);
    cmd.stdout(std::process::Stdio::piped());
    nobody::run_as_nobody(&mut cmd);
    let mut child = nobody::retry_while_busy(|| cmd.spawn());
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("ready") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the squatter never bound the name");
    }
    let (fds, maps) = (open_fds(), pool_mappings());
    let e = Weights::open(&h, T).err().expect("a stranger's socket must be refused");
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("uid 65534"), "{e}");
    assert_eq!((open_fds(), pool_mappings()), (fds, maps), "nothing mapped or kept open");
    let _ = child.wait();
}
