//! What the soak observes from outside: segments in /dev/shm by creator
//! pid, processes carrying the run's tag, and this process's descriptors.

use std::collections::HashSet;

/// Environment variable holding `<run>:<round>` in every participant and,
/// inherited, in every manager daemon a participant starts.
pub const TAG_VAR: &str = "SS_SOAK_TAG";

/// Every segment in /dev/shm with our naming: (name with the '/',
/// creator pid, creation time in seconds since the epoch). Cheap: no walk
/// of /proc, unlike `ssctl`'s scan.
pub fn our_segments() -> Vec<(String, i32, f64)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| {
            let file = e.file_name().into_string().ok()?;
            let pid = storage_sharing::manager::segments::creator_pid(&file)?;
            let meta = e.metadata().ok()?;
            Some((format!("/{file}"), pid, meta.mtime() as f64 + meta.mtime_nsec() as f64 * 1e-9))
        })
        .collect()
}

/// Whether a segment of creator `pid` made at `created` belongs to a round
/// with `pids` that ran from `from` to `to` (one second of slack): other
/// programs on the machine may reuse a pid of ours, and theirs are not ours.
pub fn owned_by(pid: i32, created: f64, pids: &HashSet<i32>, from: f64, to: f64) -> bool {
    pids.contains(&pid) && created >= from - 1.0 && created <= to + 1.0
}

/// The segments of one round still in /dev/shm.
pub fn segments_of(pids: &HashSet<i32>, from: f64, to: f64) -> Vec<String> {
    our_segments().into_iter().filter(|(_, pid, t)| owned_by(*pid, *t, pids, from, to)).map(|(n, _, _)| n).collect()
}

/// Removes the segments of `pids` made between `from` and `to` whose
/// creator is dead and that no process maps or holds open (what `ssctl
/// gc` removes); returns how many.
pub fn gc(pids: &HashSet<i32>, from: f64, to: f64) -> u64 {
    let mut removed = 0;
    for s in storage_sharing::manager::segments::scan("torch_") {
        if owned_by(s.pid, s.created, pids, from, to) && s.collectable() {
            let c = std::ffi::CString::new(s.name).expect("no NUL in a listed name");
            // SAFETY: shm_unlink with a valid C string.
            removed += u64::from(unsafe { libc::shm_unlink(c.as_ptr()) } == 0);
        }
    }
    removed
}

/// Seconds since the epoch, now.
pub fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Live (not zombie) processes whose environment holds `TAG_VAR=<tag...>`
/// with the given prefix: (pid, command name).
pub fn tagged_processes(tag_prefix: &str) -> Vec<(i32, String)> {
    let needle = format!("{TAG_VAR}={tag_prefix}");
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return found };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        if !env.split(|b| *b == 0).any(|kv| kv.starts_with(needle.as_bytes())) {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the ')' that ends the command name.
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
        if state == Some('Z') || state.is_none() {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string();
        found.push((pid, comm));
    }
    found
}

/// Manager daemons among the tagged processes.
pub fn daemons(tag_prefix: &str) -> Vec<i32> {
    tagged_processes(tag_prefix).into_iter().filter(|(_, c)| c.starts_with("ss_shm_manager")).map(|(p, _)| p).collect()
}

/// Descriptors open in this process now.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count().saturating_sub(1)).unwrap_or(0)
}

/// The int32 count at offset 0 of `/dev/shm/<name>` (a refcounted
/// segment's header), read without mapping it; None when gone.
pub fn header_count(name: &str) -> Option<i32> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(format!("/dev/shm/{}", name.trim_start_matches('/'))).ok()?;
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, 0).ok()?;
    Some(i32::from_ne_bytes(b))
}

/// An int64 at `at` in `/dev/shm/<name>`; None when gone.
pub fn read_i64(name: &str, at: u64) -> Option<i64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(format!("/dev/shm/{}", name.trim_start_matches('/'))).ok()?;
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, at).ok()?;
    Some(i64::from_ne_bytes(b))
}
