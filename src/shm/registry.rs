//! Process-wide index of live mappings by address range, so a data pointer
//! (or a pointer into the data) leads back to the object that owns it:
//! ATen's `fromDataPtr`, extended to interior pointers.

use crate::fork_safe::ForkSafeMutex;
use std::collections::BTreeMap;

struct Entry {
    len: usize,
    token: usize,
}

/// Fork-safe: a child forked while another thread registers a map must
/// still be able to open and close maps.
static LIVE: ForkSafeMutex<BTreeMap<usize, Entry>> = ForkSafeMutex::new(BTreeMap::new());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<usize, Entry>> {
    // A panic while holding the lock cannot leave the map half-updated
    // (every update is one insert or remove), so poisoning is ignored.
    LIVE.lock_static()
}

/// Records that `[start, start + len)` belongs to `token`.
pub fn register(start: usize, len: usize, token: usize) {
    live().insert(start, Entry { len, token });
}

/// Forgets the range that starts at `start`.
pub fn unregister(start: usize) {
    live().remove(&start);
}

/// The token whose range holds `addr`; a zero-length range matches only its
/// exact start.
pub fn lookup(addr: usize) -> Option<usize> {
    let map = live();
    let (start, entry) = map.range(..=addr).next_back()?;
    let inside = addr == *start || addr - start < entry.len;
    inside.then_some(entry.token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_start_and_interior_only() {
        register(0x1000_0000, 100, 7);
        assert_eq!(lookup(0x1000_0000), Some(7));
        assert_eq!(lookup(0x1000_0063), Some(7));
        assert_eq!(lookup(0x1000_0064), None);
        assert_eq!(lookup(0x0fff_ffff), None);
        unregister(0x1000_0000);
        assert_eq!(lookup(0x1000_0000), None);
    }
}
