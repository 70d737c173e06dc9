//! `ssctl demo`: shares a buffer with a second process, by descriptor and by
//! name through the manager daemon, and prints what each side saw and how
//! long it took.

use std::os::fd::RawFd;
use std::process::Command;
use std::time::Instant;
use storage_sharing::shm::{flags, share_memory, MapAllocator};
use storage_sharing::storage::Storage;

/// Hidden subcommand the demo runs in its second process.
pub const CHILD_COMMAND: &str = "__demo-child";

const GREETING: &[u8] = b"hello from the child";

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

pub fn run(args: &[String]) -> i32 {
    let mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(64);
    match demo(mib << 20) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("demo failed: {e}");
            1
        }
    }
}

fn demo(len: usize) -> Result<(), Box<dyn std::error::Error>> {
    let src = pattern(len);
    let sum = checksum(&src);
    println!("parent {}: a {} MiB buffer, checksum {sum:016x}", std::process::id(), len >> 20);

    let t = Instant::now();
    let mut copy = vec![0u8; len];
    copy.copy_from_slice(&src);
    let memcpy_ms = ms(t);
    drop(copy);

    // 1. By descriptor: share_memory, then hand the fd to a child.
    let t = Instant::now();
    let map = share_memory(&src)?;
    let share_ms = ms(t);
    println!(
        "share_memory: {share_ms:.2} ms into anonymous segment {} (fd {}); plain memcpy of the same bytes into fresh heap: {memcpy_ms:.2} ms",
        map.filename(),
        map.fd()
    );
    let child_fd = inheritable_dup(map.fd())?;
    let status = Command::new(std::env::current_exe()?)
        .args([CHILD_COMMAND, "fd", &child_fd.to_string(), &len.to_string(), &format!("{sum:x}")])
        .status()?;
    // SAFETY: our own duplicate, no longer needed once the child ran.
    unsafe { libc::close(child_fd) };
    if !status.success() {
        return Err(format!("child (by fd) failed: {status}").into());
    }
    // SAFETY: the mapping holds len bytes; the child has exited.
    let head = unsafe { std::slice::from_raw_parts(map.data(), GREETING.len()) };
    println!("parent: the child wrote {:?} into the shared bytes", String::from_utf8_lossy(head));
    drop(map);

    // 2. By name through the manager daemon (PyTorch's file_system strategy):
    // a managed refcounted segment, cleaned up even if every holder dies.
    let storage = Storage::from_bytes(&src)?;
    let t = Instant::now();
    let handle = storage.share_filename()?;
    storage.shared_incref()?; // the sender's reference "in flight"
    println!(
        "share_filename: {:.2} ms into {} ({} bytes), registered with the manager at {}",
        ms(t),
        handle.filename,
        handle.nbytes,
        handle.manager_handle
    );
    let status = Command::new(std::env::current_exe()?)
        .args([CHILD_COMMAND, "name", &format!("{}\n{}", handle.manager_handle, handle.filename), &len.to_string(), &format!("{sum:x}")])
        .status()?;
    if !status.success() {
        return Err(format!("child (by name) failed: {status}").into());
    }
    let mut head = vec![0u8; GREETING.len()];
    head.copy_from_slice(&storage.to_vec()[..GREETING.len()]);
    println!("parent: the child wrote {:?}; refcount now {}", String::from_utf8_lossy(&head), storage.shared_refcount()?);
    drop(storage);
    let gone = !std::path::Path::new(&format!("/dev/shm{}", handle.filename)).exists();
    println!("parent: dropped the last reference; {} removed from /dev/shm: {gone}", handle.filename);
    Ok(())
}

/// A duplicate of `fd` that a child process inherits.
fn inheritable_dup(fd: RawFd) -> Result<RawFd, Box<dyn std::error::Error>> {
    // SAFETY: dup of a descriptor we own; the copy has no CLOEXEC flag.
    let d = unsafe { libc::dup(fd) };
    if d < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(d)
}

pub fn child(args: &[String]) -> i32 {
    match child_main(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("child failed: {e}");
            1
        }
    }
}

fn child_main(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let [how, what, len, sum] = args else { return Err("child: bad arguments".into()) };
    let len: usize = len.parse()?;
    let want = u64::from_str_radix(sum, 16)?;
    let me = std::process::id();
    let t = Instant::now();
    let (data, holder): (*mut u8, Box<dyn std::any::Any>) = if how == "fd" {
        let fd: RawFd = what.parse()?;
        let m = MapAllocator::open_fd("", fd, flags::OPEN_SHARED_FD, len)?;
        (m.data(), Box::new(m))
    } else {
        let (manager, name) = what.split_once('\n').ok_or("child: bad name argument")?;
        let s = Storage::new_shared_filename(manager, name, len)?;
        s.shared_decref()?; // cancels the sender's in-flight reference
        println!("child {me}: opened {name} by name through the manager, refcount now {}", s.shared_refcount()?);
        (s.data(), Box::new(s))
    };
    let open_us = t.elapsed().as_secs_f64() * 1e6;
    // SAFETY: the mapping holds len bytes and lives in `holder`.
    let bytes = unsafe { std::slice::from_raw_parts_mut(data, len) };
    let t = Instant::now();
    let got = checksum(bytes);
    let read_ms = ms(t);
    println!(
        "child {me}: opened by {how} in {open_us:.1} us, read {} MiB in {read_ms:.2} ms, checksum {}",
        len >> 20,
        if got == want { "matches" } else { "DIFFERS" }
    );
    if got != want {
        return Err("checksum mismatch".into());
    }
    bytes[..GREETING.len()].copy_from_slice(GREETING);
    drop(holder);
    Ok(())
}
