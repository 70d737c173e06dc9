//! `ssctl gc [--dry-run] [--prefix P]`: removes the segments whose creator
//! is dead (or whose pid now belongs to a newer process) and that no live
//! process maps or holds open, then says what it removed. A creator whose
//! pid may name a process of another pid namespace is never called dead
//! (see `manager::creator`).

use storage_sharing::manager::gc::collect;

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
                println!("usage: ssctl gc [--dry-run] [--prefix NAME_PREFIX]\nRemoves /dev/shm segments named like ours or PyTorch's whose creating process\nis gone and that no live process maps or holds open. A creator that may live in another pid\nnamespace (a container sharing /dev/shm) counts as alive.");
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
    for s in report.kept.iter().filter(|s| !s.in_use) {
        if let Some(why) = &s.creator_unknown {
            println!("kept {}: {why}", s.name);
        }
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
