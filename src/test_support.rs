//! Helpers shared by the library's unit tests.

use std::time::{Duration, Instant};

/// Whether `cond` holds within `limit`, looking every 5 ms. For states that
/// a child forked by another test thread delays for a moment: until it
/// execs, it holds copies of this process's descriptors and mappings.
pub fn soon(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !cond() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}
