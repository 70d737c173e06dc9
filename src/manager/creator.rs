//! Whether the creator of a segment is gone, across pid namespaces.
//!
//! A segment's name carries its creator's pid, which names a process only
//! in the creator's pid namespace. Containers sharing /dev/shm each have
//! their own: "pid 300" seen from here may be a live process there. So a
//! creator is called dead only when we can see the namespace it ran in:
//!
//! - the segment's creator record (see [`creator_record`]) names our own
//!   namespace: the pid is looked up here (alive, and started no later
//!   than the segment, else the pid was reused);
//! - we run in the initial pid namespace, which sees every process of
//!   every namespace: the creator is gone when no process has that pid
//!   here, nor that pid inside a nested namespace (`NSpid` of
//!   `/proc/<pid>/status`) while having started before the segment;
//! - otherwise (a container without a record saying it is ours, as for
//!   every segment PyTorch makes) the creator may live where we cannot
//!   look: the segment is kept.

use super::segment_users::{creator_alive, process_start_epoch};
use crate::shm::creator_record;
use std::collections::HashMap;
use std::path::Path;

/// The inode of the initial pid namespace (the kernel's PROC_PID_INIT_INO).
pub const INIT_PID_NS: u64 = 0xEFFF_FFFC;

/// What is known of a segment's creator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Creator {
    /// A process that may be it runs (here or in a nested namespace).
    Alive,
    /// Gone, and we could see every place it could have run.
    Dead,
    /// Its pid may belong to a namespace we cannot see: why.
    Unknown(String),
}

/// Judges creators, reading `/proc` for nested namespaces once.
pub struct CreatorCheck {
    ours: Option<u64>,
    /// Pids inside nested namespaces -> the pids here of those processes.
    nested: Option<HashMap<i32, Vec<i32>>>,
}

impl Default for CreatorCheck {
    fn default() -> Self {
        CreatorCheck { ours: creator_record::pid_namespace(), nested: None }
    }
}

impl CreatorCheck {
    /// The creator of the segment file at `path`, made (last resized) at
    /// `created` seconds since the epoch by pid `pid` of some namespace.
    pub fn judge(&mut self, path: &Path, pid: i32, created: f64) -> Creator {
        let record = creator_record::recorded(path);
        let ours = self.ours;
        if record.is_some() && record == ours {
            return if creator_alive(pid, created) { Creator::Alive } else { Creator::Dead };
        }
        // No record (or another namespace's): a same-numbered process here
        // may be it, so it keeps the segment as before.
        if record.is_none() && creator_alive(pid, created) {
            return Creator::Alive;
        }
        if ours != Some(INIT_PID_NS) {
            let whose = match record {
                Some(ns) => format!("pid namespace {ns}, not ours"),
                None => "no record of its pid namespace".to_string(),
            };
            return Creator::Unknown(format!(
                "creator pid {pid} may live in another pid namespace ({whose}; this one, {}, cannot see the others)",
                ours.map_or("unreadable".to_string(), |n| n.to_string())
            ));
        }
        let hosts = self.nested().get(&pid).cloned().unwrap_or_default();
        let alive = hosts.iter().any(|&h| process_start_epoch(h).is_some_and(|start| start <= created + 1.0));
        if alive {
            Creator::Alive
        } else {
            Creator::Dead
        }
    }

    fn nested(&mut self) -> &HashMap<i32, Vec<i32>> {
        self.nested.get_or_insert_with(nested_pids)
    }
}

/// Every process in a nested pid namespace, by its pid there (each level
/// below ours of its `NSpid` line) -> its pid here.
fn nested_pids() -> HashMap<i32, Vec<i32>> {
    let mut map: HashMap<i32, Vec<i32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return map };
    for entry in dir.flatten() {
        let Some(here) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{here}/status")) else { continue };
        let Some(line) = status.lines().find_map(|l| l.strip_prefix("NSpid:")) else { continue };
        for inner in line.split_whitespace().skip(1).filter_map(|p| p.parse::<i32>().ok()) {
            map.entry(inner).or_default().push(here);
        }
    }
    map
}
