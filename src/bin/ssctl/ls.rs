//! `ssctl ls [--prefix P]`: the segments that look like ours or PyTorch's.

use std::io::Write;
use storage_sharing::manager::segments::{scan, Segment};

/// The table `ssctl ls` prints.
pub fn render(segments: &[Segment]) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let mut out = format!("{:<40} {:>12} {:>8} {:>8} {:>7} {:>6} {:>8}\n", "NAME", "SIZE", "REFCOUNT", "PID", "CREATOR", "IN_USE", "AGE_S");
    for s in segments {
        let rc = s.refcount.map_or("-".to_string(), |r| r.to_string());
        let alive = match (&s.creator_unknown, s.creator_alive) {
            (Some(_), _) => "unknown",
            (None, true) => "alive",
            (None, false) => "dead",
        };
        let used = if s.in_use { "yes" } else { "no" };
        out +=
            &format!("{:<40} {:>12} {:>8} {:>8} {:>7} {:>6} {:>8.0}\n", s.name, s.size, rc, s.pid, alive, used, (now - s.created).max(0.0));
    }
    out += &format!("{} segment(s)\n", segments.len());
    out
}

pub fn run(args: &[String]) -> i32 {
    let mut prefix = String::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--prefix" => match it.next() {
                Some(p) => prefix = p.clone(),
                None => return usage("--prefix needs a value"),
            },
            "-h" | "--help" => {
                println!("usage: ssctl ls [--prefix NAME_PREFIX]\nLists /dev/shm segments named like ours or PyTorch's (torch_<pid>_..., ss_arena_<pid>_..., ss_pool_<pid>_...):\nsize, header refcount, creating pid and whether it is alive (unknown: it may live in a pid namespace\nthis one cannot see), whether a live process maps it.");
                return 0;
            }
            other => return usage(&format!("unknown argument {other}")),
        }
    }
    let _ = std::io::stdout().write_all(render(&scan(&prefix)).as_bytes());
    0
}

fn usage(msg: &str) -> i32 {
    eprintln!("ssctl ls: {msg}\nusage: ssctl ls [--prefix NAME_PREFIX]");
    2
}
