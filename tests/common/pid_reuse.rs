//! Playing a process that got the pid of one that exited: the kernel hands
//! out the number after `/proc/sys/kernel/ns_last_pid` to the next fork,
//! and root may set it. Other processes of the machine fork too, so the
//! spawn is tried again until the child has the pid wanted.

#![allow(dead_code)]

use std::process::{Child, Command};

/// Spawns `make()` as process `pid` (which must be free: its process
/// exited and was reaped). None, with the reason, where the next pid
/// cannot be steered here (not root, or /proc/sys read-only).
pub fn spawn_as_pid(pid: i32, mut make: impl FnMut() -> Command) -> Result<Child, String> {
    for _ in 0..2000 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .map_err(|e| format!("cannot steer the next pid (/proc/sys/kernel/ns_last_pid: {e})"))?;
        let mut child = make().spawn().map_err(|e| format!("spawn: {e}"))?;
        if child.id() as i32 == pid {
            return Ok(child);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    Err(format!("pid {pid} kept going to other processes"))
}

/// A pid that was just given up: a child that exited and was reaped,
/// with the start time it had. Returns once the clock has passed that
/// start tick: start times count 10 ms ticks, and a process started in
/// the same tick would have the same one (an attacker without root must
/// fork through the whole pid space to get a pid again, which takes far
/// longer than a tick).
pub fn freed_pid() -> (i32, u64) {
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id() as i32;
    let start = storage_sharing::proc_identity::start_ticks(pid).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    while now_ticks() <= start + 1 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    (pid, start)
}

/// Clock ticks since boot, as start times count them.
fn now_ticks() -> u64 {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    let secs: f64 = uptime.split_whitespace().next().unwrap().parse().unwrap();
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (secs * hz) as u64
}
