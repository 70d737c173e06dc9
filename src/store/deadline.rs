//! Deadlines and the timeout error every store returns, so all stores name
//! missing keys the same way.

use super::Timeout;
use crate::error::{Error, ErrorKind};
use std::time::{Duration, Instant};

/// When a wait that started now must give up; `None` never.
pub fn deadline(timeout: Timeout) -> Option<Instant> {
    timeout.map(|t| Instant::now().checked_add(t).unwrap_or_else(far_future))
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

/// Time left until `deadline` (zero once passed); `None` for no deadline.
pub fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// Whether `deadline` has passed.
pub fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// `ErrorKind::Timeout` naming the keys still missing and the store.
pub fn timeout_error(timeout: Timeout, missing: &[&[u8]], store: &str) -> Error {
    let waited = timeout.map_or_else(|| "forever".to_string(), |t| format!("{} ms", t.as_millis()));
    let noun = if missing.len() == 1 { "key" } else { "keys" };
    let list: Vec<String> = missing.iter().map(|k| super::show_key(k)).collect();
    Error::new(ErrorKind::Timeout, format!("timed out after {waited} waiting for {noun} {} in {store}", list.join(", ")))
}

/// Grows a polling interval: doubles from `start` up to `cap`, and never
/// sleeps past the deadline.
pub struct Backoff {
    next: Duration,
    cap: Duration,
}

impl Backoff {
    pub fn new(start: Duration, cap: Duration) -> Backoff {
        Backoff { next: start, cap }
    }

    /// Sleeps for the current interval (cut to the deadline) and grows it.
    pub fn sleep(&mut self, deadline: Option<Instant>) {
        let mut d = self.next;
        if let Some(left) = remaining(deadline) {
            d = d.min(left);
        }
        std::thread::sleep(d);
        self.next = (self.next * 2).min(self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_message_names_keys_and_store() {
        let e = timeout_error(Some(Duration::from_millis(250)), &[b"a/0".as_slice(), b"b"], "file store </tmp/x>");
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert_eq!(e.message(), "timed out after 250 ms waiting for keys \"a/0\", \"b\" in file store </tmp/x>");
        let e = timeout_error(Some(Duration::from_millis(1)), &[b"k".as_slice()], "s");
        assert!(e.message().contains("for key \"k\" in s"), "{}", e.message());
    }

    #[test]
    fn huge_timeout_does_not_overflow() {
        let d = deadline(Some(Duration::MAX)).unwrap();
        assert!(!expired(Some(d)));
        assert!(deadline(None).is_none());
    }
}
