//! `ssctl gc [--dry-run] [--prefix P]`: removes the segments whose creator
//! is dead (or whose pid now belongs to a newer process) and that no live
//! process maps or holds open, then says what it removed.

use super::segments::{scan, Segment};
use crate::error::{Error, Result};
use crate::shm::flags::SHAREDMEM;
use crate::shm::map::unlink_name;
use std::ffi::CString;

/// What one gc pass did.
#[derive(Debug, Default)]
pub struct Report {
    pub removed: Vec<Segment>,
    pub kept: Vec<Segment>,
    pub failed: Vec<(Segment, Error)>,
}

/// Collects segments named with `prefix`; with `dry_run` only reports.
pub fn collect(prefix: &str, dry_run: bool) -> Report {
    let mut report = Report::default();
    for s in scan(prefix) {
        if !s.collectable() {
            report.kept.push(s);
            continue;
        }
        if dry_run {
            report.removed.push(s);
            continue;
        }
        match unlink(&s.name) {
            Ok(()) => report.removed.push(s),
            Err(e) => report.failed.push((s, e)),
        }
    }
    report
}

fn unlink(name: &str) -> Result<()> {
    let c = CString::new(name).map_err(|_| Error::new(crate::ErrorKind::InvalidArgument, format!("segment name <{name}> contains NUL")))?;
    unlink_name(&c, name, SHAREDMEM)
}

pub fn run(args: &[String]) -> i32 {
    let mut prefix = String::new();
    let mut dry_run = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-n" | "--dry-run" => dry_run = true,
            "--prefix" => match it.next() {
                Some(p) => prefix = p.clone(),
                None => return usage("--prefix needs a value"),
            },
            "-h" | "--help" => {
                println!("usage: ssctl gc [--dry-run] [--prefix NAME_PREFIX]\nRemoves /dev/shm segments named like ours or PyTorch's whose creating process\nis gone and that no live process maps or holds open.");
                return 0;
            }
            other => return usage(&format!("unknown argument {other}")),
        }
    }
    let report = collect(&prefix, dry_run);
    let verb = if dry_run { "would remove" } else { "removed" };
    for s in &report.removed {
        println!(
            "{verb} {} ({} bytes, refcount {}, creator pid {} dead)",
            s.name,
            s.size,
            s.refcount.map_or("-".into(), |r| r.to_string()),
            s.pid
        );
    }
    for (s, e) in &report.failed {
        eprintln!("failed {}: {e}", s.name);
    }
    let bytes: u64 = report.removed.iter().map(|s| s.size).sum();
    println!("{verb} {} segment(s), {bytes} bytes; kept {} in use or with a live creator", report.removed.len(), report.kept.len());
    if report.failed.is_empty() {
        0
    } else {
        1
    }
}

fn usage(msg: &str) -> i32 {
    eprintln!("ssctl gc: {msg}\nusage: ssctl gc [--dry-run] [--prefix NAME_PREFIX]");
    2
}
