//! Where the library's own messages go: warnings about resources left
//! behind, and the manager daemon's log. By default they go to stderr, as
//! they always did; a host can install a sink of its own (the C API's
//! `ss_log_set_callback`) to route them into its logging, or silence them.
//!
//! A sink is called from whichever thread logs, possibly during process
//! exit, so it must be thread-safe and must not call back into the library.

use crate::fork_safe::ForkSafeMutex;
use std::sync::Arc;

/// How much a message matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Level {
    /// Something the host should act on (say, memory still held by peers).
    Warning = 1,
    /// What the manager daemon does, when its log is on.
    Info = 2,
}

/// A function that receives every message.
pub type Sink = Arc<dyn Fn(Level, &str) + Send + Sync>;

/// `None`: the default sink, stderr. Fork-safe: a child forked while
/// another thread swaps the sink can still log.
static SINK: ForkSafeMutex<Option<Sink>> = ForkSafeMutex::new(None);

/// Sends the library's messages to `sink` from now on; `None` restores the
/// default (stderr).
pub fn set_sink(sink: Option<Sink>) {
    *SINK.lock_static() = sink;
}

/// Logs `message` at `level`: to the installed sink, else to stderr.
pub fn log(level: Level, message: &str) {
    // Called outside the lock, so a slow sink holds nobody up.
    let sink = SINK.lock_static().clone();
    match sink {
        Some(sink) => sink(level, message),
        None => eprintln!("{message}"),
    }
}

/// Logs a [`Level::Warning`].
pub fn warn(message: &str) {
    log(Level::Warning, message);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn installed_sink_receives_messages_until_removed() {
        let got: Arc<Mutex<Vec<(Level, String)>>> = Arc::default();
        let seen = got.clone();
        set_sink(Some(Arc::new(move |level, text: &str| {
            if text.contains("log-sink-unit-test") {
                seen.lock().unwrap().push((level, text.to_string()));
            }
        })));
        warn("log-sink-unit-test one");
        log(Level::Info, "log-sink-unit-test two");
        set_sink(None);
        warn("log-sink-unit-test after removal (goes to stderr)");
        let got = got.lock().unwrap();
        assert_eq!(*got, vec![(Level::Warning, "log-sink-unit-test one".into()), (Level::Info, "log-sink-unit-test two".into())]);
    }
}
