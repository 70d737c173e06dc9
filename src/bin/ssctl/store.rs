//! `ssctl store ls|show|verify|gc PATH`: look into a content store, check
//! it, and drop storages no tensor refers to.

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::Path;
use storage_sharing::content_store::{self, Reader};

const USAGE: &str = "usage: ssctl store <command> PATH
commands:
  ls PATH               every tensor: dtype, shape, storage and its size
  show PATH [NAME...]   the store's summary, or the named tensors in full
  verify PATH           hash every storage against its name, check every tensor;
                        exit 1 and list the corrupt objects if there are any
                        (a PyTorch-format name may be the SHA-1 or PyTorch's default hash)
  gc [--dry-run] PATH   remove storages no tensor refers to and leftovers of killed writers
                        (--dry-run may come before or after PATH)";

/// Storages at least this big in total get a progress bar on verify.
const PROGRESS_FROM: u64 = 256 << 20;

pub fn run(args: &[String]) -> i32 {
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => return usage("no command"),
    };
    if matches!(cmd, "-h" | "--help") {
        println!("{USAGE}");
        return 0;
    }
    if cmd == "gc" {
        return match gc_args(rest) {
            Ok((path, dry_run)) => report(cmd, gc(Path::new(path), dry_run)),
            Err(msg) => usage(&msg),
        };
    }
    let Some((path, rest)) = rest.split_first() else { return usage(&format!("{cmd}: PATH missing")) };
    let path = Path::new(path);
    let result = match cmd {
        "ls" if rest.is_empty() => ls(path),
        "show" => show(path, rest),
        "verify" if rest.is_empty() => return verify(path),
        "ls" | "verify" => return usage(&format!("{cmd} takes only PATH")),
        other => return usage(&format!("unknown command {other:?}")),
    };
    report(cmd, result)
}

fn report(cmd: &str, result: storage_sharing::Result<()>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ssctl store {cmd}: {e}");
            1
        }
    }
}

/// `gc`'s PATH and whether `--dry-run` was given, in any order.
fn gc_args(args: &[String]) -> Result<(&str, bool), String> {
    let mut path = None;
    let mut dry_run = false;
    for a in args {
        match a.as_str() {
            "--dry-run" | "-n" => dry_run = true,
            flag if flag.starts_with('-') => return Err(format!("gc: unknown option {flag:?}")),
            p if path.is_none() => path = Some(p),
            extra => return Err(format!("gc takes one PATH, got a second: {extra:?}")),
        }
    }
    path.map(|p| (p, dry_run)).ok_or_else(|| "gc: PATH missing".to_string())
}

fn usage(msg: &str) -> i32 {
    eprintln!("ssctl store: {msg}\n{USAGE}");
    2
}

fn shape_text(v: &[i64]) -> String {
    format!("[{}]", v.iter().map(i64::to_string).collect::<Vec<_>>().join(", "))
}

fn ls(path: &Path) -> storage_sharing::Result<()> {
    let r = Reader::open(path)?;
    let sizes: std::collections::HashMap<String, u64> = r.list_storages()?.into_iter().collect();
    println!("{:<40} {:<10} {:<20} {:<34} {:>10}", "TENSOR", "DTYPE", "SHAPE", "STORAGE", "SIZE");
    let listing = r.list_entries()?;
    for name in &listing.names {
        match r.read_meta(name) {
            Ok(m) => {
                let size = sizes.get(&m.storage_hash).map_or("missing".to_string(), |s| HumanBytes(*s).to_string());
                println!("{:<40} {:<10} {:<20} {:<34} {:>10}", name, m.dtype.torch_name(), shape_text(&m.shape), m.storage_hash, size);
            }
            Err(e) => println!("{name:<40} unreadable: {e}"),
        }
    }
    for odd in &listing.odd {
        println!("{:<40} unreadable: {} (not a regular entry)", odd.object, odd.kind);
    }
    let total: u64 = sizes.values().sum();
    println!("{} tensor(s), {} storage(s), {} ({} format)", listing.names.len(), sizes.len(), HumanBytes(total), r.format().name());
    Ok(())
}

fn show(path: &Path, names: &[String]) -> storage_sharing::Result<()> {
    let r = Reader::open(path)?;
    if names.is_empty() {
        let storages = r.list_storages()?;
        let tensors = r.list_tensors()?;
        let unique: u64 = storages.iter().map(|s| s.1).sum();
        let sizes: std::collections::HashMap<&str, u64> = storages.iter().map(|(h, s)| (h.as_str(), *s)).collect();
        let referenced: u64 =
            tensors.iter().filter_map(|n| r.read_meta(n).ok()).filter_map(|m| sizes.get(m.storage_hash.as_str()).copied()).sum();
        println!("store:     {}", path.display());
        println!("format:    {} (storage names: {})", r.format().name(), r.hash_mode().name());
        println!("tensors:   {}", tensors.len());
        println!("storages:  {} holding {}", storages.len(), HumanBytes(unique));
        println!("dedup:     tensors refer to {} of storage, {} on disk", HumanBytes(referenced), HumanBytes(unique));
        return Ok(());
    }
    for name in names {
        let t = r.read_tensor(name)?;
        let bytes = t.storage.bytes();
        let head: Vec<String> = bytes.iter().take(16).map(|b| format!("{b:02x}")).collect();
        println!("tensor:    {name}");
        println!("dtype:     {} (code {})", t.meta.dtype.torch_name(), t.meta.dtype.code());
        println!("shape:     {}", shape_text(&t.meta.shape));
        println!("stride:    {}", shape_text(&t.meta.stride));
        println!("offset:    {}", t.meta.offset);
        if t.bits.conj || t.bits.neg {
            let set: Vec<&str> = [("conj", t.bits.conj), ("neg", t.bits.neg)].iter().filter(|b| b.1).map(|b| b.0).collect();
            println!("lazy bits: {} (the storage holds the values before they apply)", set.join(", "));
        }
        println!("storage:   {} ({}, {} bytes)", t.meta.storage_hash, HumanBytes(bytes.len() as u64), bytes.len());
        println!("first bytes: {}", head.join(" "));
    }
    Ok(())
}

fn verify(path: &Path) -> i32 {
    let r = match Reader::open(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ssctl store verify: {e}");
            return 1;
        }
    };
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("verify {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let report = content_store::verify(&r, &mut |done, total| {
        if total >= PROGRESS_FROM {
            bar.set_length(total);
            bar.set_position(done);
        }
    });
    bar.finish_and_clear();
    let report = match report {
        Ok(rep) => rep,
        Err(e) => {
            eprintln!("ssctl store verify: {e}");
            return 1;
        }
    };
    let secs = started.elapsed().as_secs_f64();
    println!("checked {} storage(s) ({}) and {} tensor(s) in {secs:.2} s", report.storages, HumanBytes(report.bytes), report.tensors);
    if report.problems.is_empty() {
        println!("ok: no corrupt object");
        return 0;
    }
    println!("{} corrupt object(s):", report.problems.len());
    for p in &report.problems {
        println!("  {}: {}", p.object, p.why);
    }
    1
}

fn gc(path: &Path, dry_run: bool) -> storage_sharing::Result<()> {
    let report = content_store::gc(path, dry_run)?;
    let verb = if dry_run { "would remove" } else { "removed" };
    for (hash, size) in &report.storages {
        println!("{verb} storages/{hash} ({})", HumanBytes(*size));
    }
    for t in &report.temp_files {
        println!("{verb} {} (left by a killed writer)", t.display());
    }
    let freed: u64 = report.storages.iter().map(|s| s.1).sum();
    println!(
        "{verb} {} unreferenced storage(s), {}, and {} temporary file(s); kept {} storage(s)",
        report.storages.len(),
        HumanBytes(freed),
        report.temp_files.len(),
        report.kept_storages
    );
    Ok(())
}
