//! The table of sharing paths the soak drives. Adding a path is one file
//! in `scenarios/` implementing [`Scenario`] and one line in [`all`].

use crate::round::Round;

/// Who removes a killed participant's segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cleanup {
    /// Nothing may be left, kill or not (the names are unlinked at once).
    Immediate,
    /// The manager daemon removes abandoned segments (within seconds).
    Manager,
    /// A refcounted segment without a manager keeps a killed holder's
    /// reference; `ssctl gc` (creator dead, nobody maps it) removes it.
    Gc,
}

pub trait Scenario: Sync {
    /// Short name, used in `--only` and in the participants' `--role`.
    fn name(&self) -> &'static str;
    /// Commands a round sends at most (the kill lands on one of them).
    fn max_steps(&self) -> u32;
    /// Whether the round has a manager daemon that may be the victim.
    fn has_manager(&self) -> bool {
        false
    }
    /// How segments of a killed participant go away.
    fn cleanup(&self) -> Cleanup;
    /// The parent's side of one round: spawn, drive, check.
    fn run(&self, r: &mut Round) -> Result<(), String>;
    /// A participant's side: `role` with `args`; returns the exit code.
    fn participant(&self, role: &str, args: &[String]) -> i32;
}

/// Every path that exists today.
pub fn all() -> Vec<&'static dyn Scenario> {
    vec![
        &crate::scenarios::by_fd::ByFd,
        &crate::scenarios::by_name::ByName,
        &crate::scenarios::refcounted::Refcounted,
        &crate::scenarios::cuda_counters::CudaCounters,
        &crate::scenarios::symm::Symm,
        &crate::scenarios::content_store::ContentStore,
        &crate::scenarios::arena::ArenaPath,
    ]
}

/// The count a refcounted header must hold: `base` from acknowledged
/// steps, plus up to `slack` from a step the victim was killed in.
#[derive(Default, Debug)]
pub struct Expected {
    pub base: i64,
    pub slack: i64,
}

impl Expected {
    /// Checks `seen` against the model; counts the check when it is exact.
    pub fn check(&self, r: &mut Round, what: &str, seen: i64) -> Result<(), String> {
        if seen < self.base || seen > self.base + self.slack {
            return Err(format!("{what}: count {seen}, expected {} (+ up to {} from a killed step)", self.base, self.slack));
        }
        if self.slack == 0 {
            r.exact_checks += 1;
        }
        Ok(())
    }
}

/// Bytes a producer writes and a consumer checks.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len).map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8).collect()
}

/// Whether `len` bytes at `ptr` equal the pattern of `seed`.
pub fn holds_pattern(ptr: *const u8, len: usize, seed: u64) -> bool {
    // SAFETY: callers pass a live mapping of at least `len` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
    bytes == pattern(len, seed).as_slice()
}

/// `err <Kind> <message>` for a participant's reply.
pub fn err_reply(e: &storage_sharing::Error) -> String {
    format!("err {:?} {}", e.kind(), e.message().replace('\n', " "))
}

/// A round's own folder under the temporary directory (a store, sockets),
/// removed when dropped, whatever the round's outcome.
pub struct RoundDir(pub std::path::PathBuf);

impl RoundDir {
    pub fn new(scenario: &str, tag: &str) -> Result<RoundDir, String> {
        let dir = std::env::temp_dir().join(format!("ss-soak-{scenario}-{}", tag.replace(':', "-")));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        Ok(RoundDir(dir))
    }

    pub fn arg(&self) -> String {
        self.0.to_string_lossy().into_owned()
    }
}

impl Drop for RoundDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Entries of /dev/shm changed since `from` (seconds since the epoch)
/// whose name contains `needle`.
pub fn shm_entries_since(from: f64, needle: &str) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let m = e.metadata().ok()?;
            let t = m.mtime() as f64 + m.mtime_nsec() as f64 * 1e-9;
            (name.contains(needle) && t >= from - 1.0).then_some(name)
        })
        .collect()
}
