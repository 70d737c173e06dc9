//! Content store speed. (1) Hash throughput at 16 MiB, 256 MiB and 1 GiB
//! beside a plain read of the same buffer on all cores (the physical
//! limit), with the fast hash's share of it; the candidates for the fast
//! hash (XXH3-128 on one core, BLAKE3 on all); SHA-1 beside OpenSSL's
//! (`openssl speed -evp sha1`, and Python's hashlib, which is OpenSSL's).
//! (2) Writer and reader for 64 tensors of 16 MiB, half of them
//! duplicates, beside PyTorch's ContentStoreWriter/Reader on the same data
//! where torch imports ($SS_TEST_PYTHON, else python3).
//!
//! Run: `cargo bench --bench content_store`. SS_BENCH_QUICK=1 skips 1 GiB.

use rayon::prelude::*;
use std::process::Command;
use std::time::Instant;
use storage_sharing::content_store::{self, Dtype, Format, HashMode, Reader, Writer};

const MIB: usize = 1 << 20;

fn pattern(len: usize, k: u64) -> Vec<u8> {
    (0..len as u64).into_par_iter().map(|j| ((31 * j + k) & 255) as u8).collect()
}

/// Best wall time of `reps` runs of `f`, in seconds.
fn best(reps: usize, mut f: impl FnMut() -> u64) -> f64 {
    let mut sink = 0u64;
    let mut t_best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        sink = sink.wrapping_add(f());
        t_best = t_best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    t_best
}

/// Sums the buffer as u64 words on all cores: every byte read once.
fn read_all(buf: &[u8]) -> u64 {
    buf.par_chunks(MIB)
        .map(|c| c.chunks_exact(8).fold(0u64, |a, w| a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()))))
        .reduce(|| 0, u64::wrapping_add)
}

fn gbs(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// OpenSSL's SHA-1 in GB/s from `openssl speed -evp sha1` on 16 MiB blocks.
fn openssl_sha1() -> Option<f64> {
    let out = Command::new("openssl").args(["speed", "-evp", "sha1", "-bytes", "16777216", "-seconds", "2"]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with("sha1") || l.starts_with("SHA1"))?;
    let k: f64 = line.split_whitespace().last()?.trim_end_matches('k').parse().ok()?;
    Some(k * 1000.0 / 1e9)
}

fn python() -> String {
    std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Python hashlib.sha1 (OpenSSL) on 256 MiB, GB/s.
fn hashlib_sha1() -> Option<f64> {
    let code = "import hashlib,time\nb=bytes(range(256))*(1<<20)\nbest=9e9\nfor _ in range(3):\n t=time.perf_counter(); hashlib.sha1(b).hexdigest(); best=min(best,time.perf_counter()-t)\nprint(len(b)/best/1e9)";
    let out = Command::new(python()).args(["-c", code]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn hash_table(quick: bool) {
    let openssl = openssl_sha1();
    let hashlib = hashlib_sha1();
    println!("## Hash throughput (GB/s, best of several runs; {} cores)", rayon::current_num_threads());
    println!();
    println!("| buffer | read, all cores | fast (ours, XXH3-128 tree, all cores) | fast / read | XXH3-128, 1 core | BLAKE3, all cores | SHA-1 (stable, ours) | SHA-1 / OpenSSL |");
    println!("|---|---|---|---|---|---|---|---|");
    let sizes: &[usize] = if quick { &[16 * MIB, 256 * MIB] } else { &[16 * MIB, 256 * MIB, 1024 * MIB] };
    for &n in sizes {
        let buf = pattern(n, 7);
        let reps = if n <= 16 * MIB { 20 } else { 5 };
        let read = gbs(n, best(reps, || read_all(&buf)));
        let fast = gbs(n, best(reps, || content_store::hash_hex(&buf, HashMode::Fast).len() as u64));
        let xxh = gbs(n, best(reps, || xxhash_rust::xxh3::xxh3_128(&buf) as u64));
        let b3 = gbs(n, best(reps.min(5), || blake3::Hasher::new().update_rayon(&buf).finalize().as_bytes()[0] as u64));
        let sha = gbs(n, best(reps.min(3), || content_store::hash_hex(&buf, HashMode::Stable).len() as u64));
        let vs = openssl.map_or("n/a".to_string(), |o| format!("{:.2}", sha / o));
        println!("| {} MiB | {read:.2} | {fast:.2} | {:.0} % | {xxh:.2} | {b3:.2} | {sha:.2} | {vs} |", n / MIB, 100.0 * fast / read);
    }
    println!();
    println!(
        "OpenSSL SHA-1 (`openssl speed -evp sha1`, 16 MiB blocks): {}; Python hashlib.sha1 (OpenSSL, 256 MiB): {}",
        openssl.map_or("not measured".into(), |v| format!("{v:.2} GB/s")),
        hashlib.map_or("not measured".into(), |v| format!("{v:.2} GB/s"))
    );
    println!();
}

fn store_table() {
    const N: usize = 16 * MIB;
    let patterns: Vec<Vec<u8>> = (0..32).map(|k| pattern(N, k)).collect();
    let root = std::env::temp_dir().join(format!("ss-bench-content-{}", std::process::id()));
    println!("## Writer and reader: 64 tensors of 16 MiB, half of them duplicates (1 GiB in, 512 MiB stored)");
    println!();
    println!("| what | time | input rate | speed vs PyTorch (its time / ours) | vs PyTorch's default-hash writer |");
    println!("|---|---|---|---|---|");
    let torch = torch_times(&root);
    let torch_write = torch.as_ref().and_then(|t| t.get("writer_default_hash").copied());
    let torch_write_stable = torch.as_ref().and_then(|t| t.get("writer_stable_hash").copied());
    let torch_read = torch.as_ref().and_then(|t| t.get("reader_load").copied());
    let row = |what: &str, secs: f64, vs: Option<f64>, vs_default: Option<f64>| {
        let ratio = |v: Option<f64>| v.map_or("".to_string(), |v| format!("{:.2}x", v / secs));
        println!("| {what} | {:.3} s | {:.2} GB/s | {} | {} |", secs, gbs(64 * N, secs), ratio(vs), ratio(vs_default));
    };
    for (format, durable) in [(Format::Native, true), (Format::Native, false), (Format::Torch, true), (Format::Torch, false)] {
        let _ = std::fs::remove_dir_all(&root);
        let t = Instant::now();
        let result = (|| -> storage_sharing::Result<()> {
            let w = Writer::open(&root, format)?;
            w.set_durable(durable);
            for i in 0..64 {
                w.write_tensor(&format!("t{i}"), &patterns[i / 2], Dtype::UInt8, 0, &[N as i64], &[1])?;
            }
            Ok(())
        })();
        let secs = t.elapsed().as_secs_f64();
        if let Err(e) = result {
            println!("| writer, {} format | failed: {e} | | | |", format.name());
            continue;
        }
        // Against PyTorch's faster writer (its default hash is far slower).
        let vs = match (torch_write, torch_write_stable) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let how = if durable { "fsync + rename per file" } else { "rename per file, no fsync, as PyTorch" };
        row(&format!("writer, {} format ({how})", format.name()), secs, vs, torch_write);
        if durable {
            continue;
        }
        let t = Instant::now();
        let r = Reader::open(&root).unwrap();
        let tensors: Vec<_> = (0..64).map(|i| r.read_tensor(&format!("t{i}")).unwrap()).collect();
        let map_secs = t.elapsed().as_secs_f64();
        let sum: u64 = tensors.iter().map(|t| read_all(t.storage.bytes())).fold(0, u64::wrapping_add);
        let touch_secs = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        row(&format!("reader, {} format: open + map 64 tensors", format.name()), map_secs, torch_read, None);
        row(&format!("reader, {} format: map + read every byte", format.name()), touch_secs, torch_read, None);
        drop(tensors);
    }
    let _ = std::fs::remove_dir_all(&root);
    match torch {
        Some(t) => {
            println!(
                "| PyTorch ContentStoreWriter, default (non-portable) hash | {:.3} s | {:.2} GB/s | | |",
                t["writer_default_hash"],
                gbs(64 * N, t["writer_default_hash"])
            );
            println!(
                "| PyTorch ContentStoreWriter, stable_hash=True (SHA-1) | {:.3} s | {:.2} GB/s | | |",
                t["writer_stable_hash"],
                gbs(64 * N, t["writer_stable_hash"])
            );
            println!(
                "| PyTorch ContentStoreReader (torch.load, copies) | {:.3} s | {:.2} GB/s | | |",
                t["reader_load"],
                gbs(64 * N, t["reader_load"])
            );
        }
        None => println!("\nPyTorch rows: skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)"),
    }
    println!();
    println!("Writer rows: the first ratio is against PyTorch's faster writer (stable_hash=True here), the second against its default; reader rows against its reader.");
}

fn torch_times(root: &std::path::Path) -> Option<std::collections::HashMap<String, f64>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/content_store_torch.py");
    let out = Command::new(python()).arg(script).arg(root.with_extension("torch")).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout).lines().last()?.to_string();
    // {"torch": "x", "a": 1.0, ...}: the numbers only.
    let mut map = std::collections::HashMap::new();
    for part in line.trim_matches(|c| c == '{' || c == '}').split(", ") {
        let (k, v) = part.split_once(": ")?;
        if let Ok(v) = v.parse::<f64>() {
            map.insert(k.trim_matches('"').to_string(), v);
        }
    }
    Some(map)
}

fn main() {
    let quick = std::env::var_os("SS_BENCH_QUICK").is_some();
    hash_table(quick);
    store_table();
}
