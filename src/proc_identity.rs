//! Which process a pid names now. A pid alone is no identity: once its
//! process exits the kernel hands the number to the next fork (tens of
//! thousands of forks take seconds), so whatever recorded a pid also
//! records the process's start time (clock ticks since boot, field 22 of
//! `/proc/<pid>/stat`), and the pair names one process for good.

use crate::fork_safe::ForkSafeMutex;

/// The start time and state letter of `pid` (`R`, `S`, `Z` ...), or None
/// when there is no such process (or /proc cannot be read).
pub fn start_and_state(pid: i32) -> Option<(u64, char)> {
    if pid <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 4 to 21 come between the state (3) and the start time (22).
    Some((fields.nth(18)?.parse().ok()?, state))
}

/// The start time of `pid` in clock ticks since boot, or None.
pub fn start_ticks(pid: i32) -> Option<u64> {
    start_and_state(pid).map(|(start, _)| start)
}

/// `(pid, start time)` of this process, looked up once per process (a
/// forked child looks again).
pub fn me() -> (i32, u64) {
    static CACHE: ForkSafeMutex<(i32, u64)> = ForkSafeMutex::new((0, 0));
    let pid = std::process::id() as i32;
    let mut c = CACHE.lock_static();
    if c.0 != pid {
        *c = (pid, start_ticks(pid).unwrap_or(0));
    }
    *c
}

/// Whether the process recorded as `(pid, start)` still runs: the pid
/// exists, is not a zombie, and started at that time (not a reused pid).
pub fn alive(pid: i32, start: u64) -> bool {
    match start_and_state(pid) {
        Some((s, state)) => s == start && state != 'Z' && state != 'X',
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_and_its_start_time_name_one_process() {
        let (pid, start) = me();
        assert_eq!(pid, std::process::id() as i32);
        assert!(start > 0);
        assert_eq!(start_ticks(pid), Some(start));
        assert!(alive(pid, start));
        assert!(!alive(pid, start + 1), "same pid, other start time: a reused pid");
        assert!(!alive(0, 0));
        assert!(!alive(i32::MAX, start));
        assert_eq!(start_ticks(-1), None);
    }

    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let start = start_ticks(pid);
        // Exited but not reaped yet: a zombie until `wait`.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while start_and_state(pid).is_some_and(|(_, s)| s != 'Z') && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        if let Some(start) = start {
            assert!(!alive(pid, start), "a zombie counts as gone");
        }
        child.wait().unwrap();
    }
}
