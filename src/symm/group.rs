//! Group info: a group name's rank, world size and store (PyTorch's
//! `set_group_info` / `get_group_info`), plus the group's own sequence of
//! store exchanges. The sequence is per group, so a rendezvous of one
//! group never shifts the keys of another (pytorch #196082).

use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use crate::store::StoreRef;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One registered group. The group holds its own reference to the store.
pub struct GroupInfo {
    pub name: String,
    pub rank: usize,
    pub world_size: usize,
    pub store: StoreRef,
    next_seq: AtomicU64,
}

impl GroupInfo {
    /// The next exchange number of this group (0, 1, 2, ...). Every rank
    /// of the group takes numbers in the same order.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }
}

/// The most ranks a group may have. Symmetric memory lives on one host, and
/// every rank maps every peer's block and takes part in a ring of
/// `world_size` steps: 4096 ranks is far more processes than the GPUs or
/// cores of any host, while a larger world is a mistake to report at once,
/// not a rendezvous to run (its store keys alone could exhaust memory).
pub const MAX_WORLD_SIZE: usize = 4096;

static GROUPS: Lazy<ForkSafeMutex<HashMap<String, Arc<GroupInfo>>>> = Lazy::new(|| ForkSafeMutex::new(HashMap::new()));

fn groups() -> std::sync::MutexGuard<'static, HashMap<String, Arc<GroupInfo>>> {
    GROUPS.lock_static()
}

/// Registers group `name`: this process is `rank` of `world_size`, and the
/// ranks meet through `store`. A second call for the same name is an error,
/// and so is a world of more than [`MAX_WORLD_SIZE`] ranks.
pub fn set_group_info(name: &str, rank: i64, world_size: i64, store: StoreRef) -> Result<()> {
    if name.is_empty() {
        return Err(Error::new(ErrorKind::InvalidArgument, "set_group_info: the group name is empty"));
    }
    if world_size <= 0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("set_group_info: world_size of group {name} must be positive (got {world_size})"),
        ));
    }
    if world_size as u64 > MAX_WORLD_SIZE as u64 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "set_group_info: world_size {world_size} of group {name} is too large: at most {MAX_WORLD_SIZE} ranks \
                 (symmetric memory runs every rank on one host)"
            ),
        ));
    }
    if rank < 0 || rank >= world_size {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("set_group_info: rank {rank} of group {name} is outside [0, {world_size})"),
        ));
    }
    let mut map = groups();
    if map.contains_key(name) {
        return Err(Error::new(ErrorKind::AlreadyExists, format!("set_group_info: group info for the group name {name} is already set")));
    }
    let info =
        GroupInfo { name: name.to_string(), rank: rank as usize, world_size: world_size as usize, store, next_seq: AtomicU64::new(0) };
    map.insert(name.to_string(), Arc::new(info));
    Ok(())
}

/// The info of group `name`.
pub fn get_group_info(name: &str) -> Result<Arc<GroupInfo>> {
    groups()
        .get(name)
        .cloned()
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("get_group_info: no group info associated with the group name {name}")))
}
