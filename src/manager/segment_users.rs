//! Which live processes use a shared-memory segment: the ground truth the
//! manager and `ssctl gc` decide on, because the count in a segment's
//! header stays too high forever once a holder was killed.
//!
//! A process uses a segment when a line of `/proc/<pid>/maps` or a link in
//! `/proc/<pid>/fd` points at `/dev/shm/<name>`. A segment is created with
//! mode 0600, so only processes of its owner's uid can open it by name
//! (root aside), and the manager serves clients of its own uid only.
//!
//! A scan that cannot vouch for every process that could use a segment is
//! *in doubt*, and a name in doubt is never removed: `/proc` or an entry
//! of a live process of our uid that cannot be read (out of descriptors, a
//! non-dumpable process whose entries only root may read, any other
//! error) may hide a user. Only a process that is gone, or one we may not
//! read that runs as another user or holds capabilities we lack, is
//! passed over (see `not_ours`).

use crate::shm::HEADER_SIZE;
use std::collections::HashSet;
use std::fs;
use std::io::ErrorKind as IoKind;

/// Where POSIX shared-memory objects live.
pub const SHM_DIR: &str = "/dev/shm";

/// The file of a POSIX shm name (`/torch_1_2_3` → `/dev/shm/torch_1_2_3`).
pub fn shm_path(name: &str) -> String {
    format!("{SHM_DIR}{name}")
}

/// What a scan of `/proc` found out about some names.
#[derive(Debug, Default)]
pub struct Users {
    /// The names some live process maps or holds open.
    pub found: HashSet<String>,
    /// Set when the scan could not read everything that could hide a
    /// user: why. Then every name may be in use.
    pub doubt: Option<String>,
}

impl Users {
    /// Whether `name` may be in use: found, or the scan is in doubt.
    pub fn may_use(&self, name: &str) -> bool {
        self.doubt.is_some() || self.found.contains(name)
    }
}

/// Which of `names` (each `/name`) some live process other than
/// `skip_pid` maps or holds open; in doubt when that cannot be known.
pub fn names_in_use(names: &HashSet<String>, skip_pid: Option<i32>) -> Users {
    let mut users = Users::default();
    if names.is_empty() {
        return users;
    }
    let paths: Vec<(Vec<u8>, &String)> = names.iter().map(|n| (shm_path(n).into_bytes(), n)).collect();
    let dir = match fs::read_dir("/proc") {
        Ok(d) => d,
        Err(e) => {
            users.doubt = Some(format!("cannot list /proc: {e}"));
            return users;
        }
    };
    for entry in dir {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                users.doubt = Some(format!("cannot list /proc: {e}"));
                return users;
            }
        };
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if Some(pid) == skip_pid {
            continue;
        }
        let scanned = scan_maps(pid, &paths, &mut users.found).and_then(|()| {
            if users.found.len() < names.len() {
                scan_fds(pid, &paths, &mut users.found)
            } else {
                Ok(())
            }
        });
        if let Err(why) = scanned {
            users.doubt = Some(why);
            return users;
        }
        if users.found.len() == names.len() {
            break;
        }
    }
    users
}

/// Whether some live process maps or holds `name` open, or may (doubt).
pub fn in_use(name: &str) -> bool {
    let set: HashSet<String> = [name.to_string()].into_iter().collect();
    names_in_use(&set, None).may_use(name)
}

fn matches<'a>(target: &[u8], paths: &'a [(Vec<u8>, &String)]) -> Option<&'a String> {
    // A removed segment still shows with " (deleted)" after its path.
    let target = target.strip_suffix(b" (deleted)").unwrap_or(target);
    paths.iter().find(|(p, _)| p.as_slice() == target).map(|(_, n)| *n)
}

/// What an error reading `what` of process `pid` means: nothing when the
/// process is gone, or when we may not read it and it is not one that
/// could be ours (see [`not_ours`]); else doubt.
fn unreadable(pid: i32, what: &str, e: &std::io::Error) -> Result<(), String> {
    let gone = matches!(e.kind(), IoKind::NotFound) || e.raw_os_error() == Some(libc::ESRCH);
    if gone {
        return Ok(());
    }
    let denied = matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM));
    if denied && not_ours(pid) == Some(true) {
        return Ok(());
    }
    Err(format!("cannot read /proc/{pid}/{what}: {e}"))
}

/// Whether `pid`, which we may not inspect, cannot be a user of ours
/// (from `/proc/<pid>/status`, which anyone may read; None when that
/// cannot be read): it runs as another user (none of its real,
/// effective, saved and file-system uids is ours), so it cannot open our
/// 0600 segments nor be our client; or it holds capabilities we lack (a
/// system service such as a sandbox's init), which no rule of ours could
/// cover. A process of our uid that we may not read because it made
/// itself non-dumpable is not passed over: it may use our segments.
fn not_ours(pid: i32) -> Option<bool> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |text: &str, key: &str| text.lines().find_map(|l| l.strip_prefix(key)).map(|v| v.trim().to_string());
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let uids: Vec<libc::uid_t> = field(&status, "Uid:")?.split_whitespace().map(|u| u.parse().ok()).collect::<Option<_>>()?;
    if uids.len() != 4 {
        return None;
    }
    if !uids.contains(&me) {
        return Some(true);
    }
    let caps = |text: &str| field(text, "CapPrm:").and_then(|v| u64::from_str_radix(&v, 16).ok());
    let theirs = caps(&status)?;
    let mine = caps(&fs::read_to_string("/proc/self/status").ok()?)?;
    Some(theirs & !mine != 0)
}

fn scan_maps(pid: i32, paths: &[(Vec<u8>, &String)], found: &mut HashSet<String>) -> Result<(), String> {
    // Read as bytes: a mapped file whose path is not UTF-8 must not end
    // the scan of the lines after it.
    let maps = match fs::read(format!("/proc/{pid}/maps")) {
        Ok(m) => m,
        Err(e) => return unreadable(pid, "maps", &e),
    };
    let dir = SHM_DIR.as_bytes();
    for line in maps.split(|b| *b == b'\n') {
        // address perms offset dev inode path: the path is the sixth field
        // and may itself contain spaces.
        let Some(at) = line.windows(dir.len()).position(|w| w == dir) else { continue };
        if let Some(name) = matches(&line[at..], paths) {
            found.insert(name.clone());
        }
    }
    Ok(())
}

fn scan_fds(pid: i32, paths: &[(Vec<u8>, &String)], found: &mut HashSet<String>) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let dir = match fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(d) => d,
        Err(e) => return unreadable(pid, "fd", &e),
    };
    for entry in dir {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => return unreadable(pid, "fd", &e),
        };
        match fs::read_link(entry.path()) {
            Ok(target) => {
                if let Some(name) = matches(target.as_os_str().as_bytes(), paths) {
                    found.insert(name.clone());
                }
            }
            // Closed since it was listed.
            Err(e) if e.kind() == IoKind::NotFound => {}
            Err(e) => return unreadable(pid, "fd", &e),
        }
    }
    Ok(())
}

/// What the header of a tracked name says, read with `pread` (never
/// through a mapping: the file's owner may shrink it under the read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Header {
    /// No such name any more.
    Gone,
    /// A refcounted segment holding this count.
    Count(i32),
    /// Not laid out as a refcounted segment: not a regular file, no longer
    /// than the header plus one byte, or with anything but zeros in the
    /// header's unused bytes (an arena segment, whose header starts with a
    /// magic number, say).
    NoCount,
    /// It could not be read (out of descriptors, no permission, shrunk
    /// while read, ...): why. Nothing may be decided on it.
    Unreadable(String),
}

/// The header of the segment `name` (an int32 count at offset 0 of its
/// 64-byte header, whose other bytes stay zero), read without changing it
/// and without a mapping. The file is opened non-blocking (a FIFO planted
/// at the name cannot hold us) and without following a symlink.
pub fn read_header(name: &str) -> Header {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let path = shm_path(name);
    let file = match fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == IoKind::NotFound => return Header::Gone,
        // A symlink: not a segment of ours.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Header::NoCount,
        Err(e) => return Header::Unreadable(format!("cannot open <{path}>: {e}")),
    };
    let meta = match file.metadata() {
        Ok(m) => m,
        Err(e) => return Header::Unreadable(format!("cannot stat <{path}>: {e}")),
    };
    if !meta.is_file() || meta.len() <= HEADER_SIZE as u64 {
        return Header::NoCount;
    }
    let mut header = [0u8; HEADER_SIZE];
    if let Err(e) = file.read_exact_at(&mut header, 0) {
        return Header::Unreadable(format!("cannot read the header of <{path}>: {e}"));
    }
    if header[4..].iter().any(|b| *b != 0) {
        return Header::NoCount;
    }
    Header::Count(i32::from_ne_bytes([header[0], header[1], header[2], header[3]]))
}

/// The reference count in the header of the refcounted segment `name`;
/// None when it is gone, not laid out as one, or unreadable.
pub fn header_refcount(name: &str) -> Option<i32> {
    match read_header(name) {
        Header::Count(c) => Some(c),
        _ => None,
    }
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
    use crate::test_support::soon;
    use std::ffi::CString;

    const TEN_S: std::time::Duration = std::time::Duration::from_secs(10);

    #[test]
    fn sees_own_mapping_and_fd() {
        let name = new_process_wide_shm_handle();
        let m = MapAllocator::open(&name, flags::SHAREDMEM | flags::EXCLUSIVE, 4096).unwrap();
        assert!(in_use(&name));
        let set: HashSet<String> = [name.clone()].into_iter().collect();
        let others = || names_in_use(&set, Some(std::process::id() as i32));
        assert!(soon(TEN_S, || others().found.is_empty()), "{:?}", others());
        assert!(others().doubt.is_none(), "{:?}", others());
        drop(m);
        assert!(soon(TEN_S, || !in_use(&name)), "still in use after the drop");
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
    fn a_fifo_symlink_or_short_file_at_a_name_has_no_count_and_blocks_nothing() {
        use std::os::unix::fs::symlink;
        let fifo = new_process_wide_shm_handle();
        let path = CString::new(shm_path(&fifo)).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        // No writer: a blocking open would wait here for good.
        assert_eq!(read_header(&fifo), Header::NoCount);
        std::fs::remove_file(shm_path(&fifo)).unwrap();
        let link = new_process_wide_shm_handle();
        let short = new_process_wide_shm_handle();
        std::fs::write(shm_path(&short), [0u8; HEADER_SIZE]).unwrap();
        symlink(shm_path(&short), shm_path(&link)).unwrap();
        assert_eq!(read_header(&link), Header::NoCount, "a symlink is not followed");
        assert_eq!(read_header(&short), Header::NoCount, "the header alone holds no data");
        assert_eq!(read_header(&new_process_wide_shm_handle()), Header::Gone);
        std::fs::remove_file(shm_path(&link)).unwrap();
        std::fs::remove_file(shm_path(&short)).unwrap();
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
