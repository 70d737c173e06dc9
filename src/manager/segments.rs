//! The segments in /dev/shm that look like ours or PyTorch's
//! (`torch_<pid>_<rand>_<n>`, or the older `torch_<pid>_<n>`; arena
//! segments `ss_arena_<pid>_<id>_<hex>`, host pool segments
//! `ss_pool_<pid>_<hex>_<n>`), with what
//! `ssctl ls` shows and `ssctl gc` decides on.

use super::creator::{Creator, CreatorCheck};
use super::segment_users::{names_in_use, SHM_DIR};
use crate::shm::HEADER_SIZE;
use std::collections::HashSet;
use std::os::unix::fs::{FileExt, MetadataExt};

#[derive(Clone, Debug)]
pub struct Segment {
    /// `/torch_...`
    pub name: String,
    pub size: u64,
    /// The int32 at offset 0: the refcount of a refcounted segment.
    pub refcount: Option<i32>,
    /// Creating pid, from the name.
    pub pid: i32,
    /// The creator still runs (same pid, started before the segment), or
    /// may: its pid may name a process of a pid namespace we cannot see
    /// (`creator_unknown` says why).
    pub creator_alive: bool,
    /// Set when the creator may live in another pid namespace: why.
    pub creator_unknown: Option<String>,
    /// Some live process maps it or holds it open, or may: the scan of
    /// `/proc` could not read a process that could (never removed on doubt).
    pub in_use: bool,
    /// Seconds since the epoch of the segment's last size change (its
    /// creation, for segments nobody resized).
    pub created: f64,
}

impl Segment {
    /// `gc` removes it: its creator is gone and no live process uses it.
    pub fn collectable(&self) -> bool {
        !self.creator_alive && !self.in_use
    }
}

/// The creating pid if `file` (without the leading '/') has our naming:
/// ATen's `torch_<pid>_...`, an arena's `ss_arena_<pid>_<id>_<hex>` or a
/// host pool segment's `ss_pool_<pid>_<16 hex>_<n>`.
pub fn creator_pid(file: &str) -> Option<i32> {
    if let Some(rest) = file.strip_prefix("ss_arena_") {
        return arena_creator_pid(rest);
    }
    if let Some(rest) = file.strip_prefix("ss_pool_") {
        return pool_creator_pid(rest);
    }
    let rest = file.strip_prefix("torch_")?;
    let parts: Vec<&str> = rest.split('_').collect();
    if !(parts.len() == 2 || parts.len() == 3) || parts.iter().any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    parts[0].parse().ok()
}

fn pool_creator_pid(rest: &str) -> Option<i32> {
    pid_of_three_fields(rest, [is_digits, |p| is_hex(p, 16), is_digits])
}

fn arena_creator_pid(rest: &str) -> Option<i32> {
    pid_of_three_fields(rest, [is_digits, is_digits, |p| is_hex(p, 8)])
}

/// The first of three `_`-separated fields, each passing its check, as a pid.
fn pid_of_three_fields(rest: &str, checks: [fn(&str) -> bool; 3]) -> Option<i32> {
    let parts: Vec<&str> = rest.split('_').collect();
    if parts.len() != 3 || !parts.iter().zip(checks).all(|(p, ok)| ok(p)) {
        return None;
    }
    parts[0].parse().ok()
}

fn is_digits(p: &str) -> bool {
    !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
}

fn is_hex(p: &str, len: usize) -> bool {
    p.len() == len && p.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Every segment with our naming whose name starts with `prefix` (with
/// or without the leading '/').
pub fn scan(prefix: &str) -> Vec<Segment> {
    let prefix = prefix.trim_start_matches('/');
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return found };
    let mut creators = CreatorCheck::default();
    for entry in dir.flatten() {
        let Some(file) = entry.file_name().to_str().map(str::to_string) else { continue };
        if !file.starts_with(prefix) {
            continue;
        }
        let Some(pid) = creator_pid(&file) else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let created = meta.mtime() as f64 + meta.mtime_nsec() as f64 * 1e-9;
        let creator = creators.judge(&entry.path(), pid, created);
        found.push(Segment {
            name: format!("/{file}"),
            size: meta.len(),
            // Arena and pool segments hold data at offset 0, not a count.
            refcount: if file.starts_with("torch_") { read_refcount(&entry.path(), meta.len()) } else { None },
            pid,
            creator_alive: creator != Creator::Dead,
            creator_unknown: match creator {
                Creator::Unknown(why) => Some(why),
                _ => None,
            },
            in_use: false,
            created,
        });
    }
    let names: HashSet<String> = found.iter().map(|s| s.name.clone()).collect();
    let used = names_in_use(&names, None);
    for s in &mut found {
        s.in_use = used.may_use(&s.name);
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

fn read_refcount(path: &std::path::Path, size: u64) -> Option<i32> {
    if size < HEADER_SIZE as u64 {
        return None;
    }
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking and not through a symlink: a FIFO or a link planted at
    // the name since it was listed cannot hold us or lead us elsewhere.
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, 0).ok()?;
    Some(i32::from_ne_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naming() {
        assert_eq!(creator_pid("torch_12_345_6"), Some(12));
        assert_eq!(creator_pid("torch_12_6"), Some(12));
        assert_eq!(creator_pid("torch_12"), None);
        assert_eq!(creator_pid("torch_a_1_2"), None);
        assert_eq!(creator_pid("torch_1__2"), None);
        assert_eq!(creator_pid("other_1_2_3"), None);
        assert_eq!(creator_pid("ss_arena_77_3_0a1b2c3d"), Some(77));
        assert_eq!(creator_pid("ss_arena_77_3"), None);
        assert_eq!(creator_pid("ss_arena_77_3_xyz"), None);
        assert_eq!(creator_pid("ss_pool_77_00ff00ff00ff00ff_0"), Some(77));
        assert_eq!(creator_pid("ss_pool_77_00ff00ff00ff00ff"), None);
        assert_eq!(creator_pid("ss_pool_77_00ff_0"), None);
        assert_eq!(creator_pid("ss_pool_x_00ff00ff00ff00ff_0"), None);
    }
}
