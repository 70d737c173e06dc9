//! Process-wide index of live mappings by address range, so a data pointer
//! (or a pointer into the data) leads back to the object that owns it:
//! ATen's `fromDataPtr`, extended to interior pointers.

use once_cell::sync::Lazy;
use std::collections::BTreeMap;
use std::sync::Mutex;

struct Entry {
    len: usize,
    token: usize,
}

static LIVE: Lazy<Mutex<BTreeMap<usize, Entry>>> = Lazy::new(|| Mutex::new(BTreeMap::new()));

fn live() -> std::sync::MutexGuard<'static, BTreeMap<usize, Entry>> {
    // A panic while holding the lock cannot leave the map half-updated
    // (every update is one insert or remove), so poisoning is ignored.
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
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
