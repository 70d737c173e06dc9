//! `ssctl demo symm`: two ranks (this process and a child) meet through a
//! file store, rendezvous a symmetric block, read each other's buffer,
//! signal each other, and time barriers and the rendezvous.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::{self, group, DeviceType};

/// Hidden subcommand the demo runs as rank 1.
pub const CHILD_COMMAND: &str = "__demo-symm-rank";

const GROUP: &str = "demo";
const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));
const MESSAGE: &[u8] = b"hello from rank 0, through your own buffer";
const BARRIERS: u32 = 5_000;

/// The buffer size when none is given, and the largest one taken (KiB).
const DEFAULT_KIB: usize = 1024;
const MAX_KIB: usize = 1 << 20;

/// The buffer size in bytes the arguments ask for, or the usage error.
/// Checked before anything starts, so a bad argument leaves nothing behind.
fn size_arg(args: &[String]) -> Result<usize, String> {
    let kib = match args {
        [] => DEFAULT_KIB,
        [kib] => kib
            .parse::<usize>()
            .ok()
            .filter(|k| (1..=MAX_KIB).contains(k))
            .ok_or_else(|| format!("demo symm: the size must be a whole number of KiB from 1 to {MAX_KIB} (got {kib:?})"))?,
        [_, extra, ..] => return Err(format!("demo symm: unexpected argument {extra:?} (usage: ssctl demo symm [KiB])")),
    };
    Ok(kib << 10)
}

pub fn run(args: &[String]) -> i32 {
    let size = match size_arg(args) {
        Ok(size) => size,
        Err(usage) => {
            eprintln!("{usage}");
            return 2;
        }
    };
    let dir = std::env::temp_dir().join(format!("ssctl-demo-symm-{}", std::process::id()));
    let result = parent(&dir, size);
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("demo symm failed: {e}");
            1
        }
    }
}

fn parent(dir: &Path, size: usize) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    println!("rank 0 (pid {}): file store {}, starting rank 1", std::process::id(), dir.display());
    let mut child = Command::new(std::env::current_exe()?)
        .args([CHILD_COMMAND, dir.to_str().ok_or("store path is not UTF-8")?, &size.to_string()])
        .spawn()?;
    let result = rank(dir, 0, size);
    if result.is_err() {
        // Rank 1 would wait for us until its timeout.
        let _ = child.kill();
    }
    let status = child.wait()?;
    result?;
    if !status.success() {
        return Err(format!("rank 1 failed: {status}").into());
    }
    println!("rank 0: done; blocks were memfd-backed, so nothing was ever named in /dev/shm");
    Ok(())
}

pub fn child(args: &[String]) -> i32 {
    let [dir, size] = args else {
        eprintln!("{CHILD_COMMAND}: bad arguments");
        return 2;
    };
    let Ok(size) = size.parse() else { return 2 };
    match rank(&PathBuf::from(dir), 1, size) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rank 1 failed: {e}");
            1
        }
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}

fn rank(dir: &Path, me: usize, size: usize) -> Result<(), Box<dyn std::error::Error>> {
    let store: StoreRef = Arc::new(FileStore::open(dir)?);
    group::set_group_info(GROUP, me as i64, 2, store)?;
    let ptr = symm::alloc(DeviceType::Cpu, 0, size, Some(GROUP))?;
    let t = Instant::now();
    let mem = symm::rendezvous(ptr, None, TIMEOUT)?;
    let rdv_ms = t.elapsed().as_secs_f64() * 1e3;
    let peer = 1 - me;
    // SAFETY: both buffers are mapped for `size` bytes until the free below;
    // each rank writes only its own buffer between barriers.
    let own = unsafe { std::slice::from_raw_parts_mut(ptr, size) };
    let theirs = unsafe { std::slice::from_raw_parts_mut(mem.buffer_ptr(peer as i64)?, size) };
    for (i, b) in own.iter_mut().enumerate() {
        *b = (i.wrapping_mul(31) + me * 101) as u8;
    }
    let mine = checksum(own);
    mem.barrier(0, TIMEOUT, 0)?;
    let expect: Vec<u8> = (0..size).map(|i| (i.wrapping_mul(31) + peer * 101) as u8).collect();
    let ok = theirs == &expect[..];
    println!(
        "rank {me}: rendezvous {rdv_ms:.2} ms; wrote {} KiB (checksum {mine:016x}); read rank {peer}'s buffer in place: {}",
        size >> 10,
        if ok { format!("as rank {peer} wrote it") } else { "DIFFERENT".to_string() }
    );
    if !ok {
        return Err("peer buffer differs".into());
    }
    mem.barrier(0, TIMEOUT, 0)?;
    if me == 0 {
        theirs[..MESSAGE.len()].copy_from_slice(MESSAGE);
        mem.put_signal(1, 1, TIMEOUT, 0)?;
    } else {
        mem.wait_signal(0, 1, TIMEOUT, 0)?;
        println!("rank 1: signal on channel 1, then read {:?} from my own buffer", String::from_utf8_lossy(&own[..MESSAGE.len()]));
    }
    let t = Instant::now();
    for _ in 0..BARRIERS {
        mem.barrier(2, TIMEOUT, 0)?;
    }
    let ns = t.elapsed().as_nanos() as f64 / BARRIERS as f64;
    if me == 0 {
        println!("rank 0: {BARRIERS} barriers, {ns:.0} ns each");
    }
    symm::free(ptr)?;
    Ok(())
}
