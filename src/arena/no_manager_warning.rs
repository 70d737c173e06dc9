//! The one warning a process gets when its by-name arena segments cannot
//! be registered with a manager daemon (no `ss_shm_manager` binary found,
//! or it would not start): they still work, but a process killed with -9
//! leaves their `ss_arena_*` names in /dev/shm, which nothing else tells.

use crate::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};

static WARNED: AtomicBool = AtomicBool::new(false);

/// Logs, once per process (a forked child inherits the flag), what is
/// lost and how to get it back; `why` is the manager lookup's error.
pub fn warn_once(why: &Error) {
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let beside = crate::manager::spawn::own_object_dir()
        .map(|d| format!("beside this library (in {})", d.display()))
        .unwrap_or_else(|| "beside this library".to_string());
    crate::log::warn(&format!(
        "storage_sharing: by-name arena segments have no kill -9 cleanup in this process: a process killed with -9 \
         leaves its /dev/shm/ss_arena_* names behind (`ssctl gc` removes them). No shared memory manager: {why}. \
         To fix it, install {bin} {beside}, or set {env} to its path.",
        bin = crate::manager::spawn::MANAGER_BINARY,
        env = crate::manager::spawn::MANAGER_ENV,
    ));
}
