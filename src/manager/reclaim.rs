//! When the manager removes a segment that no connected client holds.
//!
//! A client that goes away without freeing its registrations (killed with
//! -9, say) leaves its references in the segment's header for good: it
//! cannot decrement any more. Those *dead references* are counted here,
//! per name, from the registrations it still had. The header may hold more
//! than that: the reference a sender takes for its receiver before it
//! queues a storage (PyTorch's reduction does, and so does ours), or a
//! mapping of a live process. So a segment nobody connected holds is
//!
//! - removed when its header count is no more than its dead references
//!   and no live process maps it or holds it open (`/proc`, which also
//!   covers segments without a refcount header);
//! - kept, never removed on doubt, when its header or its users cannot be
//!   read (see [`segment_users`](super::segment_users)); it is read again
//!   on the timer;
//! - kept *in flight* while the count is higher: a receiver may still
//!   open it. A receiver registers with the manager named in the handle
//!   before it opens, so it becomes a client then; its close brings the
//!   count back down and its free (or its disconnect) triggers a recheck.
//!   In-flight names are also re-read on a timer, from 200 ms backing off
//!   to 2 s while nothing changes; nothing is re-read when none is pending.
//!
//! A reference in flight whose message is never received would keep its
//! segment for as long as clients are connected (PyTorch's manager keeps
//! everything until then). Once no client is connected, in-flight names
//! are given [`IN_FLIGHT_GRACE`] for a receiver to connect; after that, or
//! when the daemon is stopped, counts are no longer trusted: every name no
//! live process uses is removed and the daemon can exit, leaking nothing.

use super::segment_users::{names_in_use, read_header, shm_path, Header};
use crate::shm::flags::SHAREDMEM;
use crate::shm::map::unlink_name;
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::time::{Duration, Instant};

/// How long in-flight segments wait for a receiver once no client is
/// connected (a receiver connects to register before it opens one).
pub const IN_FLIGHT_GRACE: Duration = Duration::from_secs(10);
/// First re-read of in-flight counts after something changed.
const TICK_MIN: Duration = Duration::from_millis(200);
/// Slowest re-read of in-flight counts, and the interval of `/proc` scans.
const TICK_MAX: Duration = Duration::from_secs(2);

/// Why a watched name is still there.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wait {
    /// Its count holds more than the dead references: a receiver's, or a
    /// live process's.
    InFlight,
    /// Only dead references are counted, but a live process maps it or
    /// holds it open (scanned in `/proc` every [`TICK_MAX`]).
    Mapped,
}

/// What the daemon knows about names beyond who holds them now.
pub struct Reclaimer {
    /// Every name registered and not known to be gone.
    tracked: HashSet<String>,
    /// References left in each header by clients gone without freeing.
    dead_refs: HashMap<String, u64>,
    watch: HashMap<String, Wait>,
    tick: Duration,
    last_scan: Option<Instant>,
    /// Set once in-flight references are given up (grace over, or stop).
    ignore_counts: bool,
    /// Why something was kept unchecked, for the daemon's log.
    doubt: Option<String>,
}

impl Default for Reclaimer {
    fn default() -> Self {
        Reclaimer {
            tracked: HashSet::new(),
            dead_refs: HashMap::new(),
            watch: HashMap::new(),
            tick: TICK_MIN,
            last_scan: None,
            ignore_counts: false,
            doubt: None,
        }
    }
}

impl Reclaimer {
    pub fn track(&mut self, name: &str) {
        self.tracked.insert(name.to_string());
    }

    /// Whether `name` is tracked already (a new registration of it costs
    /// nothing more).
    pub fn is_tracked(&self, name: &str) -> bool {
        self.tracked.contains(name)
    }

    /// How many names are tracked.
    pub fn tracked_count(&self) -> usize {
        self.tracked.len()
    }

    pub fn is_watched(&self, name: &str) -> bool {
        self.watch.contains_key(name)
    }

    pub fn forget(&mut self, name: &str) {
        self.tracked.remove(name);
        self.watch.remove(name);
        self.dead_refs.remove(name);
    }

    /// A client went away still holding `refs` registrations of `name`.
    pub fn abandon(&mut self, name: &str, refs: u32) {
        *self.dead_refs.entry(name.to_string()).or_default() += u64::from(refs);
        self.watch.entry(name.to_string()).or_insert(Wait::InFlight);
        self.tick = TICK_MIN;
    }

    /// Whether some watched name waits for a receiver.
    pub fn has_in_flight(&self) -> bool {
        self.watch.values().any(|w| *w == Wait::InFlight)
    }

    pub fn nothing_watched(&self) -> bool {
        self.watch.is_empty()
    }

    /// A client connected: it may be a receiver, so counts matter again.
    pub fn trust_counts(&mut self) {
        self.ignore_counts = false;
    }

    /// From now on only live users keep a name (see the module doc).
    pub fn give_up_in_flight(&mut self) {
        self.ignore_counts = true;
        for w in self.watch.values_mut() {
            *w = Wait::Mapped;
        }
    }

    /// How long until the next timed recheck; None when nothing is watched.
    pub fn next_tick(&self) -> Option<Duration> {
        if self.has_in_flight() {
            Some(self.tick)
        } else if !self.watch.is_empty() {
            Some(TICK_MAX)
        } else {
            None
        }
    }

    /// The timed recheck: in-flight counts every tick, mapped names once a
    /// scan interval has passed. Returns the names removed.
    pub fn on_tick(&mut self, held: impl Fn(&str) -> bool) -> Vec<String> {
        let scan_due = self.last_scan.map_or(true, |t| t.elapsed() >= TICK_MAX);
        let due: Vec<String> = self.watch.iter().filter(|(_, w)| scan_due || **w == Wait::InFlight).map(|(n, _)| n.clone()).collect();
        let removed = self.recheck(due, held);
        // Frees and disconnects recheck at once; the timer only catches a
        // decrement by a process that is not our client, so it backs off.
        self.tick = if removed.is_empty() { (self.tick * 2).min(TICK_MAX) } else { TICK_MIN };
        removed
    }

    /// Every tracked name, as when no client is connected any more.
    pub fn recheck_all(&mut self, held: impl Fn(&str) -> bool) -> Vec<String> {
        let all: Vec<String> = self.tracked.iter().cloned().collect();
        self.recheck(all, held)
    }

    /// Decides each of `names` that no connected client holds (`held`):
    /// removes it, or watches it. Names held stay as they are: their
    /// holder's free or disconnect brings them back here. A name whose
    /// header or users cannot be read is kept and watched: nothing is
    /// removed on doubt. Returns the names removed.
    pub fn recheck(&mut self, names: impl IntoIterator<Item = String>, held: impl Fn(&str) -> bool) -> Vec<String> {
        let mut candidates = HashSet::new();
        for name in names {
            if held(&name) {
                continue;
            }
            match std::fs::symlink_metadata(shm_path(&name)) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.forget(&name);
                    continue;
                }
                Err(e) => {
                    self.doubt = Some(format!("cannot look up <{}>: {e}", shm_path(&name)));
                    self.watch.insert(name, Wait::InFlight);
                    continue;
                }
            }
            let dead = self.dead_refs.get(&name).copied().unwrap_or(0);
            let header = if self.ignore_counts { Header::NoCount } else { read_header(&name) };
            match header {
                Header::Gone => self.forget(&name),
                Header::Count(c) if i64::from(c) > dead as i64 => {
                    self.watch.insert(name, Wait::InFlight);
                }
                Header::Unreadable(why) => {
                    self.doubt = Some(why);
                    self.watch.insert(name, Wait::InFlight);
                }
                Header::Count(_) | Header::NoCount => {
                    candidates.insert(name);
                }
            }
        }
        if candidates.is_empty() {
            return Vec::new();
        }
        self.last_scan = Some(Instant::now());
        let users = names_in_use(&candidates, None);
        if let Some(why) = &users.doubt {
            self.doubt = Some(format!("kept {} segment(s) unchecked: {why}", candidates.len()));
        }
        let mut removed = Vec::new();
        for name in candidates {
            if users.may_use(&name) {
                self.watch.insert(name, Wait::Mapped);
                continue;
            }
            if let Ok(c) = CString::new(name.as_str()) {
                if unlink_name(&c, &name, SHAREDMEM).is_ok() {
                    removed.push(name.clone());
                }
            }
            self.forget(&name);
        }
        removed
    }

    /// Why the last decisions kept something they could not check, once.
    pub fn take_doubt(&mut self) -> Option<String> {
        self.doubt.take()
    }
}
