//! Which live processes use a shared-memory segment: the ground truth the
//! manager and `ssctl gc` decide on, because the count in a segment's
//! header stays too high forever once a holder was killed.
//!
//! A process uses a segment when a line of `/proc/<pid>/maps` or a link in
//! `/proc/<pid>/fd` points at `/dev/shm/<name>`. Only processes whose maps
//! we may read are seen; a segment is created with mode 0600, so those are
//! the only ones that can map it (root aside).

use crate::shm::HEADER_SIZE;
use std::collections::HashSet;
use std::fs;
use std::io::{BufRead, BufReader};

/// Where POSIX shared-memory objects live.
pub const SHM_DIR: &str = "/dev/shm";

/// The file of a POSIX shm name (`/torch_1_2_3` → `/dev/shm/torch_1_2_3`).
pub fn shm_path(name: &str) -> String {
    format!("{SHM_DIR}{name}")
}

/// The subset of `names` (each `/name`) that some live process other than
/// `skip_pid` maps or holds open.
pub fn names_in_use(names: &HashSet<String>, skip_pid: Option<i32>) -> HashSet<String> {
    let mut found = HashSet::new();
    if names.is_empty() {
        return found;
    }
    let paths: Vec<(String, &String)> = names.iter().map(|n| (shm_path(n), n)).collect();
    let Ok(dir) = fs::read_dir("/proc") else { return found };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if Some(pid) == skip_pid {
            continue;
        }
        scan_maps(pid, &paths, &mut found);
        if found.len() < names.len() {
            scan_fds(pid, &paths, &mut found);
        }
        if found.len() == names.len() {
            break;
        }
    }
    found
}

/// Whether some live process maps or holds `name` open.
pub fn in_use(name: &str) -> bool {
    let set: HashSet<String> = [name.to_string()].into_iter().collect();
    !names_in_use(&set, None).is_empty()
}

fn matches<'a>(target: &str, paths: &'a [(String, &String)]) -> Option<&'a String> {
    // A removed segment still shows with " (deleted)" after its path.
    let target = target.strip_suffix(" (deleted)").unwrap_or(target);
    paths.iter().find(|(p, _)| p == target).map(|(_, n)| *n)
}

fn scan_maps(pid: i32, paths: &[(String, &String)], found: &mut HashSet<String>) {
    let Ok(f) = fs::File::open(format!("/proc/{pid}/maps")) else { return };
    for line in BufReader::new(f).lines().map_while(|l| l.ok()) {
        // address perms offset dev inode path: the path is the sixth field
        // and may itself contain spaces.
        let Some(at) = line.find(SHM_DIR) else { continue };
        if let Some(name) = matches(&line[at..], paths) {
            found.insert(name.clone());
        }
    }
}

fn scan_fds(pid: i32, paths: &[(String, &String)], found: &mut HashSet<String>) {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else { return };
    for entry in dir.flatten() {
        if let Ok(target) = fs::read_link(entry.path()) {
            if let Some(name) = target.to_str().and_then(|t| matches(t, paths)) {
                found.insert(name.clone());
            }
        }
    }
}

/// The reference count in the header of the refcounted segment `name` (an
/// int32 at offset 0 of its 64-byte header, whose other bytes stay zero),
/// read through a read-only mapping so that reading never changes it.
/// None when `name` is gone or is not laid out as a refcounted segment:
/// shorter than the header plus one byte, or with anything but zeros in
/// the header's unused bytes (an arena segment, say, whose header starts
/// with a magic number).
pub fn header_refcount(name: &str) -> Option<i32> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(shm_path(name)).ok()?;
    if file.metadata().ok()?.len() <= HEADER_SIZE as u64 {
        return None;
    }
    // SAFETY: a fresh read-only shared mapping of the header only; the
    // file is at least that long (checked above).
    let base = unsafe { libc::mmap(std::ptr::null_mut(), HEADER_SIZE, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    if base == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the mapping is page-aligned and HEADER_SIZE bytes long;
    // holders update the count atomically, so it is read atomically too.
    let (count, rest_zero) = unsafe {
        let count = (*(base as *const std::sync::atomic::AtomicI32)).load(std::sync::atomic::Ordering::SeqCst);
        let rest = std::slice::from_raw_parts((base as *const u8).add(4), HEADER_SIZE - 4);
        (count, rest.iter().all(|b| *b == 0))
    };
    // SAFETY: unmapping exactly what was mapped above.
    unsafe { libc::munmap(base, HEADER_SIZE) };
    rest_zero.then_some(count)
}

/// Start time of `pid` in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`), or None when there is no such process.
pub fn process_start_ticks(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Seconds since the epoch at which `pid` started, or None.
pub fn process_start_epoch(pid: i32) -> Option<f64> {
    let ticks = process_start_ticks(pid)?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let btime: f64 =
        fs::read_to_string("/proc/stat").ok()?.lines().find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse().ok()))?;
    Some(btime + ticks as f64 / hz)
}

/// Whether the process that created a segment at `created_epoch` (seconds)
/// can still be `pid`: it exists, is not a zombie, and started no later
/// than the segment was made (else the pid was reused by a newer process).
/// A second of slack covers the clock-tick rounding of start times.
pub fn creator_alive(pid: i32, created_epoch: f64) -> bool {
    if pid <= 0 || is_zombie(pid) {
        return false;
    }
    match process_start_epoch(pid) {
        Some(start) => start <= created_epoch + 1.0,
        None => false,
    }
}

fn is_zombie(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|at| s[at + 1..].trim_start().starts_with('Z')))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{flags, names::new_process_wide_shm_handle, MapAllocator};

    #[test]
    fn sees_own_mapping_and_fd() {
        let name = new_process_wide_shm_handle();
        let m = MapAllocator::open(&name, flags::SHAREDMEM | flags::EXCLUSIVE, 4096).unwrap();
        assert!(in_use(&name));
        let set: HashSet<String> = [name.clone()].into_iter().collect();
        assert!(names_in_use(&set, Some(std::process::id() as i32)).is_empty());
        drop(m);
        assert!(!in_use(&name));
    }

    #[test]
    fn reads_the_header_count_without_changing_it() {
        use crate::shm::flags::NOCREATE;
        use crate::shm::RefcountedMapAllocator;
        let name = new_process_wide_shm_handle();
        let a = RefcountedMapAllocator::open(&name, flags::SHAREDMEM | flags::EXCLUSIVE, 100).unwrap();
        assert_eq!(header_refcount(&name), Some(1));
        let b = RefcountedMapAllocator::open(&name, flags::SHAREDMEM | NOCREATE, 100).unwrap();
        a.incref().unwrap();
        assert_eq!(header_refcount(&name), Some(3));
        assert_eq!(a.refcount().unwrap(), 3);
        drop(b);
        assert_eq!(header_refcount(&name), Some(2));
        // Something other than zeros after the count: not a refcounted header.
        // SAFETY: the user data follows the 64-byte header; writing the
        // header's unused bytes through the base is what another layout does.
        unsafe { *a.data().sub(HEADER_SIZE).add(8) = 1 };
        assert_eq!(header_refcount(&name), None);
        a.decref().unwrap();
        drop(a);
        assert_eq!(header_refcount(&name), None);
    }

    #[test]
    fn start_times() {
        let me = std::process::id() as i32;
        let start = process_start_epoch(me).unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(start <= now + 1.0);
        assert!(creator_alive(me, now));
        // A segment made long before this process started is not ours.
        assert!(!creator_alive(me, start - 3600.0));
        assert!(!creator_alive(i32::MAX, now));
    }
}
