//! What the soak observes from outside: segments in /dev/shm by creator
//! pid, processes carrying the run's tag, and this process's descriptors.

use std::collections::HashSet;

/// Environment variable holding `<run>:<round>` in every participant and,
/// inherited, in every manager daemon a participant starts.
pub const TAG_VAR: &str = "SS_SOAK_TAG";

/// Names (without '/') in /dev/shm created by one of `pids` (our naming
/// `torch_<pid>_...`).
pub fn segments_of(pids: &HashSet<i32>) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| storage_sharing::ssctl::segments::creator_pid(n).is_some_and(|p| pids.contains(&p)))
        .collect()
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
