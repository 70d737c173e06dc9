//! The manager daemon: libshm's protocol on a Unix socket in a private 0700
//! folder, and cleanup that does not wait for every client to go.
//!
//! A client that closes its connection while it still has registered
//! segments (it was killed, or it broke the protocol) has *abandoned*
//! them. An abandoned segment is removed once no connected client holds
//! it, its header count is down to the references the gone clients left,
//! and no live process maps or holds it open; a count above that is a
//! reference taken for a receiver, so the segment waits for it (see
//! [`reclaim`](super::reclaim)). Segments freed cleanly are left to their
//! holders' reference count, as libshm does. Once no client is connected,
//! every tracked segment gets the same decision; the daemon exits after
//! 2 s idle once nothing it tracks is still in use or in flight.

use super::limits::Limits;
use super::protocol::{AllocInfo, ALLOC_INFO_SIZE, OK_REPLY};
use super::reclaim::{Reclaimer, IN_FLIGHT_GRACE};
use super::reglog::{recv_with_fds, RegLog, ATTACH_NAME, DRAIN_FLAG, LOG_REPLY};
use super::segment_users::shm_path;
use crate::error::{Error, ErrorKind, Result};
use crate::poller::{Poller, READABLE};
use crate::shm::names::validate_shm_name;
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::io::{ErrorKind as IoKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Idle time after which a daemon with no clients exits (libshm's value).
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_millis(2000);
/// The shortest sleep between timed rechecks, so that none can spin.
const MIN_WAIT: Duration = Duration::from_millis(10);
/// Event tokens: the listener, the stop signal, then session id + FIRST_SESSION.
const LISTENER: u64 = 0;
const STOP: u64 = 1;
const FIRST_SESSION: u64 = 2;
/// A client dropped with more names than this gives its memory back to
/// the system at once (malloc_trim).
const TRIM_AFTER: usize = 4096;

/// The socket folder, created with mkdtemp (mode 0700) under the first of
/// TMPDIR, TMP, TEMP, TEMPDIR that is set, else /tmp.
pub fn make_socket_dir() -> Result<PathBuf> {
    let base = ["TMPDIR", "TMP", "TEMP", "TEMPDIR"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "/tmp".to_string());
    sweep_stale_socket_dirs(Path::new(&base));
    let template = CString::new(format!("{}/{SOCKET_DIR_PREFIX}XXXXXX", base.trim_end_matches('/')))
        .map_err(|_| Error::new(ErrorKind::InvalidArgument, "temporary folder path contains NUL"))?;
    let mut raw = template.into_bytes_with_nul();
    // SAFETY: raw is a writable NUL-terminated template.
    if unsafe { libc::mkdtemp(raw.as_mut_ptr().cast()) }.is_null() {
        return Err(Error::last_os_error(format!("could not create a folder under <{base}>")));
    }
    raw.pop();
    Ok(PathBuf::from(String::from_utf8_lossy(&raw).into_owned()))
}

const SOCKET_DIR_PREFIX: &str = "torch-shm-dir-";
const SOCKET_NAME: &str = "manager.sock";
/// A socket file younger than this is never swept (its daemon may be
/// between bind and listen).
const STALE_AGE: Duration = Duration::from_secs(10);

/// Removes the socket folders of daemons that were killed (a SIGKILL
/// leaves `<base>/torch-shm-dir-XXXXXX/manager.sock` behind, one per
/// killed daemon, for good): folders of this user, mode 0700, holding
/// nothing but a socket that is older than `STALE_AGE` and on which
/// nothing listens (connect is refused). A live daemon, even a stopped
/// one, has a listening socket, so its folder stays. Returns how many went.
pub fn sweep_stale_socket_dirs(base: &Path) -> usize {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(base) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(SOCKET_DIR_PREFIX) && name.len() == SOCKET_DIR_PREFIX.len() + 6) {
            continue;
        }
        let dir = e.path();
        let Ok(meta) = std::fs::symlink_metadata(&dir) else { continue };
        if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o777 != 0o700 {
            continue;
        }
        let Ok(inner) = std::fs::read_dir(&dir) else { continue };
        let inner: Vec<std::ffi::OsString> = inner.flatten().map(|x| x.file_name()).collect();
        if inner.len() != 1 || inner[0] != SOCKET_NAME {
            continue;
        }
        let sock = dir.join(SOCKET_NAME);
        let Ok(sm) = std::fs::symlink_metadata(&sock) else { continue };
        let old = sm.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age >= STALE_AGE);
        if !sm.file_type().is_socket() || sm.uid() != me || !old || !nobody_listens(&sock) {
            continue;
        }
        if std::fs::remove_file(&sock).is_ok() && std::fs::remove_dir(&dir).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Whether connecting to the Unix socket at `path` is refused (nothing
/// listens). Non-blocking: a live daemon with a full backlog is "busy",
/// not refused, and never makes us wait.
fn nobody_listens(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return false;
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: a new socket we close below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return false;
    }
    // SAFETY: addr is a valid sockaddr_un of the size given.
    let rc = unsafe {
        libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t)
    };
    let refused = rc != 0 && crate::error::errno() == libc::ECONNREFUSED;
    // SAFETY: our descriptor.
    unsafe { libc::close(fd) };
    refused
}

struct Session {
    stream: UnixStream,
    peer_pid: i32,
    pending: Vec<u8>,
    /// Registrations not yet freed, per name.
    held: HashMap<String, u32>,
    /// A reply could not be sent (the client is gone or stopped reading):
    /// no more replies, but what it sent still counts.
    mute: bool,
    /// The client's registration log, once it sent one (see `reglog`).
    log: Option<RegLog>,
    /// Descriptors received and not yet claimed by a message.
    fds: Vec<OwnedFd>,
}

/// The daemon's state: listening socket, sessions, and what it tracks.
pub struct Server {
    dir: PathBuf,
    socket: PathBuf,
    listener: UnixListener,
    sessions: HashMap<u64, Session>,
    next_id: u64,
    /// Sessions with a registration log (drained before each decision).
    with_log: HashSet<u64>,
    /// Open sessions per peer pid.
    per_pid: HashMap<i32, usize>,
    limits: Limits,
    poller: Poller,
    reclaim: Reclaimer,
    /// Since when no client has been connected.
    idle_since: Option<Instant>,
    /// When the timed work (rechecks, idle exit) is due next.
    due: Option<Instant>,
    log: bool,
    /// The only uid whose clients are served (this process's own).
    uid: libc::uid_t,
}

impl Server {
    /// Creates the folder and binds `<dir>/manager.sock`.
    pub fn bind() -> Result<Self> {
        let dir = make_socket_dir()?;
        let socket = dir.join(SOCKET_NAME);
        let listener = match UnixListener::bind(&socket) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("could not bind <{}>", socket.display())));
            }
        };
        let poller = match Poller::new() {
            Ok(p) => p,
            Err(e) => {
                let _ = std::fs::remove_file(&socket);
                let _ = std::fs::remove_dir(&dir);
                return Err(Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), "could not create an epoll instance"));
            }
        };
        // std listens with a backlog of 128 (libshm: 10): many clients may
        // connect at once.
        let server = Server {
            dir,
            socket,
            listener,
            sessions: HashMap::new(),
            next_id: 0,
            with_log: HashSet::new(),
            per_pid: HashMap::new(),
            limits: Limits::from_env(),
            poller,
            reclaim: Reclaimer::default(),
            idle_since: Some(Instant::now()),
            due: None,
            log: std::env::var_os("SS_SHM_MANAGER_LOG").is_some_and(|v| v != "0"),
            // SAFETY: geteuid cannot fail and has no side effects.
            uid: unsafe { libc::geteuid() },
        };
        // On failure dropping `server` removes the socket and its folder.
        server.listener.set_nonblocking(true).map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("could not make <{}> non-blocking", server.socket.display()))
        })?;
        server.poller.add(server.listener.as_raw_fd(), READABLE, LISTENER).map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("could not watch <{}>", server.socket.display()))
        })?;
        Ok(server)
    }

    pub fn socket_path(&self) -> &std::path::Path {
        &self.socket
    }

    fn note(&self, text: impl AsRef<str>) {
        if self.log {
            crate::log::log(crate::log::Level::Info, &format!("ss_shm_manager[{}]: {}", std::process::id(), text.as_ref()));
        }
    }

    /// Serves until idle (or SIGTERM/SIGINT/SIGHUP), then cleans up. One
    /// epoll wait per round: an idle connection costs nothing per event.
    pub fn run(&mut self) -> Result<()> {
        let stop = stop_signal_fd();
        if let Some(f) = &stop {
            // Without it, stop requests end the process instead of a clean stop.
            let _ = self.poller.add(f.as_raw_fd(), READABLE, STOP);
        }
        let mut events: Vec<libc::epoll_event> = Vec::with_capacity(256);
        loop {
            // The earlier of the pending deadline and a new one: events
            // arriving faster than a deadline must not keep pushing it back.
            let now = Instant::now();
            let wake = self.next_wakeup().map(|d| now + d.max(MIN_WAIT));
            self.due = [self.due, wake].into_iter().flatten().min();
            let timeout = self.due.map(|t| t.saturating_duration_since(now));
            if let Err(e) = self.poller.wait(&mut events, timeout) {
                return Err(Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), "epoll_wait failed in the shared memory manager"));
            }
            let ready: Vec<(u64, u32)> = events.iter().map(|ev| (ev.u64, ev.events)).collect();
            if ready.iter().any(|(token, _)| *token == STOP) {
                self.note("stop signal");
                break;
            }
            // What clients wrote to their logs counts before anything is
            // decided below.
            self.drain_all_logs();
            let mut accept = false;
            for (token, bits) in ready {
                if token == LISTENER {
                    accept = true;
                    continue;
                }
                let id = token - FIRST_SESSION;
                if bits & libc::EPOLLIN as u32 != 0 {
                    self.read_session(id);
                } else if bits & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 {
                    self.drop_session(id, "connection error");
                }
            }
            if accept {
                self.accept_all();
            }
            // Checked after the events too, so busy clients cannot starve it.
            if self.due.is_some_and(|t| Instant::now() >= t) {
                self.due = None;
                if self.timed_work() {
                    self.note("idle, exiting");
                    break;
                }
            }
        }
        // Stopping: nobody will tell us about these clients any more, nor
        // can a receiver register, so everything tracked that no live
        // process uses goes now, in flight or not.
        self.drain_all_logs();
        self.sessions.clear();
        self.reclaim.give_up_in_flight();
        let removed = self.reclaim.recheck_all(|_| false);
        self.noted_removals(&removed);
        Ok(())
    }

    /// How long poll may sleep: until the next recheck, the end of the
    /// in-flight grace, or the idle exit, whichever comes first.
    fn next_wakeup(&self) -> Option<Duration> {
        let tick = self.reclaim.next_tick();
        let Some(since) = self.idle_since else { return tick };
        let idle_deadline = if self.reclaim.nothing_watched() {
            Some(SHUTDOWN_TIMEOUT)
        } else if self.reclaim.has_in_flight() {
            Some(IN_FLIGHT_GRACE)
        } else {
            None
        };
        let until = idle_deadline.map(|d| d.saturating_sub(since.elapsed()));
        match (tick, until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Timed rechecks, and with no client: the end of the grace for
    /// segments in flight, and the idle exit. True when the daemon exits.
    fn timed_work(&mut self) -> bool {
        let sessions = &self.sessions;
        let removed = self.reclaim.on_tick(|n| held_by_anyone(sessions, n));
        self.noted_removals(&removed);
        let Some(since) = self.idle_since else { return false };
        if since.elapsed() >= IN_FLIGHT_GRACE && self.reclaim.has_in_flight() {
            self.note("no receiver came for the segments in flight; giving them up");
            self.reclaim.give_up_in_flight();
            let removed = self.reclaim.recheck_all(|_| false);
            self.noted_removals(&removed);
        }
        self.reclaim.nothing_watched() && since.elapsed() >= SHUTDOWN_TIMEOUT
    }

    fn noted_removals(&mut self, names: &[String]) {
        for name in names {
            self.note(format!("removed segment {name}"));
        }
        if let Some(why) = self.reclaim.take_doubt() {
            self.note(format!("kept what it could not check: {why}"));
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let (peer_pid, peer_uid) = peer_credentials(&stream);
                    // The 0700 folder keeps other users out, but not root;
                    // a peer of another uid could free this user's names.
                    if peer_uid != self.uid {
                        self.note(format!(
                            "refused a client of uid {peer_uid} (pid {peer_pid}): this manager serves uid {} only",
                            self.uid
                        ));
                        continue;
                    }
                    let of_pid = self.per_pid.get(&peer_pid).copied().unwrap_or(0);
                    if self.sessions.len() >= self.limits.clients || of_pid >= self.limits.clients_per_pid {
                        self.note(format!(
                            "refused a client (pid {peer_pid}): {} connections open, {of_pid} of them from that pid (limits {} and {} per pid)",
                            self.sessions.len(),
                            self.limits.clients,
                            self.limits.clients_per_pid
                        ));
                        continue;
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    if self.poller.add(stream.as_raw_fd(), READABLE, id + FIRST_SESSION).is_err() {
                        self.note(format!("refused a client (pid {peer_pid}): cannot watch its connection"));
                        continue;
                    }
                    self.note(format!("client {id} connected (pid {peer_pid})"));
                    *self.per_pid.entry(peer_pid).or_default() += 1;
                    self.idle_since = None;
                    self.reclaim.trust_counts();
                    let session =
                        Session { stream, peer_pid, pending: Vec::new(), held: HashMap::new(), mute: false, log: None, fds: Vec::new() };
                    self.sessions.insert(id, session);
                }
                Err(e) if e.kind() == IoKind::WouldBlock => return,
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and the like: keep serving those we have. The
                    // pause keeps a still-readable listener from spinning poll.
                    self.note(format!("accept failed: {e}"));
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    fn read_session(&mut self, id: u64) {
        let mut buf = [0u8; 64 * ALLOC_INFO_SIZE];
        loop {
            let Some(s) = self.sessions.get_mut(&id) else { return };
            match recv_with_fds(s.stream.as_raw_fd(), &mut buf, &mut s.fds) {
                Ok(0) => return self.drop_session(id, "closed"),
                Ok(n) => {
                    keep_only_a_log_candidate(s);
                    s.pending.extend_from_slice(&buf[..n]);
                    if let Err(e) = self.handle_pending(id) {
                        self.drain(id);
                        return self.drop_session(id, e.message());
                    }
                }
                Err(e) if e.kind() == IoKind::WouldBlock => return,
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => return self.drop_session(id, &e.to_string()),
            }
        }
    }

    /// Records every complete message received. A reply that cannot be
    /// sent does not stop the rest: a client killed right after sending
    /// several registrations (its socket closed, so the first reply fails)
    /// has registered them all, and all are abandoned with it.
    fn handle_pending(&mut self, id: u64) -> Result<()> {
        // The log's records were written before this message was sent.
        self.drain_log(id)?;
        let mut reply_failed = None;
        loop {
            let s = self.sessions.get_mut(&id).expect("live session");
            if s.pending.len() < ALLOC_INFO_SIZE {
                return reply_failed.map_or(Ok(()), Err);
            }
            let mut rec = [0u8; ALLOC_INFO_SIZE];
            rec.copy_from_slice(&s.pending[..ALLOC_INFO_SIZE]);
            s.pending.drain(..ALLOC_INFO_SIZE);
            let (has_log, has_fd) = (s.log.is_some(), !s.fds.is_empty());
            if rec[4] == DRAIN_FLAG && has_log {
                self.drain_log(id)?;
                if let Err(e) = self.reply(id, OK_REPLY) {
                    reply_failed.get_or_insert(e);
                }
                continue;
            }
            let msg = checked_message(&rec)?;
            if !msg.free && msg.filename == ATTACH_NAME && !has_log && has_fd {
                let s = self.sessions.get_mut(&id).expect("live session");
                let fd = s.fds.remove(0);
                s.log = Some(RegLog::adopt(&fd)?);
                s.fds.clear();
                self.with_log.insert(id);
                if let Err(e) = self.reply(id, LOG_REPLY) {
                    reply_failed.get_or_insert(e);
                }
                continue;
            }
            // Only the attach carries a descriptor. One comes with the first
            // byte of its message: once every byte received is consumed, none
            // can be for a message still to come, so it is closed now.
            let s = self.sessions.get_mut(&id).expect("live session");
            if s.pending.is_empty() {
                s.fds.clear();
            }
            if msg.free {
                self.on_free(id, &msg.filename);
            } else {
                self.check_room(id, &msg.filename)?;
                if let Err(e) = self.on_register(id, &msg.filename) {
                    reply_failed.get_or_insert(e);
                }
            }
        }
    }

    /// Before a session is dropped for a failed reply: reads and records
    /// what the client still sent (a dead client's last registrations may
    /// be in the socket yet), without replying. Bounded, so a live client
    /// that keeps writing cannot hold the daemon here.
    fn drain(&mut self, id: u64) {
        let mut buf = [0u8; 64 * ALLOC_INFO_SIZE];
        for _ in 0..64 {
            let Some(s) = self.sessions.get_mut(&id) else { return };
            if !s.mute {
                return;
            }
            match s.stream.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    s.pending.extend_from_slice(&buf[..n]);
                    // Malformed input ends it; failed replies cannot happen (muted).
                    if self.handle_pending(id).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }

    /// Reads the records `id` appended to its log since the last time and
    /// counts them as messages (registrations get no reply there). An
    /// invalid record ends it: the session is to be dropped.
    fn drain_log(&mut self, id: u64) -> Result<()> {
        let mut recs = Vec::new();
        match self.sessions.get(&id).and_then(|s| s.log.as_ref()) {
            Some(log) => log.take_new(&mut recs)?,
            None => return Ok(()),
        }
        for rec in recs {
            let msg = checked_message(&rec)?;
            if msg.free {
                self.on_free(id, &msg.filename);
            } else {
                self.check_room(id, &msg.filename)?;
                self.count_registration(id, &msg.filename);
            }
        }
        Ok(())
    }

    /// Whether `id` may register `name`: a name it holds already always
    /// may; a new one must fit its own bound and the daemon's. Over them,
    /// the client is dropped (the error says which bound).
    fn check_room(&self, id: u64, name: &str) -> Result<()> {
        let s = &self.sessions[&id];
        if s.held.contains_key(name) {
            return Ok(());
        }
        if s.held.len() >= self.limits.names_per_client {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("registers more than {} names, the most one client may hold", self.limits.names_per_client),
            ));
        }
        if !self.reclaim.is_tracked(name) && self.reclaim.tracked_count() >= self.limits.names {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("registers a name while the daemon tracks {} names, the most it keeps", self.limits.names),
            ));
        }
        Ok(())
    }

    /// Every session's log; a session whose log is broken is dropped.
    fn drain_all_logs(&mut self) {
        if self.with_log.is_empty() {
            return;
        }
        let ids: Vec<u64> = self.with_log.iter().copied().collect();
        for id in ids {
            if let Err(e) = self.drain_log(id) {
                self.drop_session(id, e.message());
            }
        }
    }

    fn count_registration(&mut self, id: u64, name: &str) {
        self.reclaim.track(name);
        let s = self.sessions.get_mut(&id).expect("live session");
        *s.held.entry(name.to_string()).or_default() += 1;
    }

    fn on_register(&mut self, id: u64, name: &str) -> Result<()> {
        // Recorded before the reply: a client gone before reading it has
        // still registered the name (it may have created it since).
        self.count_registration(id, name);
        self.reply(id, OK_REPLY)
    }

    fn reply(&mut self, id: u64, reply: &[u8; 2]) -> Result<()> {
        let s = self.sessions.get_mut(&id).expect("live session");
        if s.mute {
            return Ok(());
        }
        // The reply is 2 bytes; a client that never reads them fills its
        // socket buffer and is dropped instead of blocking everyone.
        match s.stream.write(reply) {
            Ok(2) => Ok(()),
            Ok(_) | Err(_) => {
                s.mute = true;
                Err(Error::new(ErrorKind::Protocol, "could not send OK (client gone or not reading)"))
            }
        }
    }

    fn on_free(&mut self, id: u64, name: &str) {
        let s = self.sessions.get_mut(&id).expect("live session");
        if let Some(n) = s.held.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                s.held.remove(name);
            }
        }
        if !shm_exists(name) {
            self.reclaim.forget(name);
        } else if self.reclaim.is_watched(name) && !held_by_anyone(&self.sessions, name) {
            let removed = self.reclaim.recheck([name.to_string()], |_| false);
            self.noted_removals(&removed);
        }
    }

    fn drop_session(&mut self, id: u64, why: &str) {
        // Its last records (a client killed right after writing one) count;
        // a broken log ends at its first bad record.
        let _ = self.drain_log(id);
        let Some(s) = self.sessions.remove(&id) else { return };
        self.with_log.remove(&id);
        if let Some(n) = self.per_pid.get_mut(&s.peer_pid) {
            *n -= 1;
            if *n == 0 {
                self.per_pid.remove(&s.peer_pid);
            }
        }
        self.note(format!("client {id} (pid {}) gone: {why}; {} names held", s.peer_pid, s.held.len()));
        let many = s.held.len() > TRIM_AFTER;
        // Its references stay in the headers for good: each name it held
        // is watched until only such references are left in it and no live
        // process uses it, even if other clients hold it now.
        let mut abandoned = Vec::with_capacity(s.held.len());
        for (name, refs) in s.held {
            self.reclaim.abandon(&name, refs);
            abandoned.push(name);
        }
        let sessions = &self.sessions;
        let removed = if sessions.is_empty() {
            // The last client: every tracked name is nobody's now.
            self.idle_since = Some(Instant::now());
            self.reclaim.recheck_all(|_| false)
        } else {
            self.reclaim.recheck(abandoned, |n| held_by_anyone(sessions, n))
        };
        self.noted_removals(&removed);
        if many {
            give_back_memory();
        }
    }
}

/// Returns freed heap memory to the system (glibc keeps it otherwise, and
/// a client dropped with many names would leave the daemon that big).
fn give_back_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Closes every descriptor a client sent except the one its registration
/// log may come with: none once it has a log, else the first received. A
/// client sending descriptors with ordinary messages (up to 28 a message)
/// must not fill our descriptor table: out of descriptors we could not
/// read `/proc` or a header, nor accept clients.
fn keep_only_a_log_candidate(s: &mut Session) {
    if s.log.is_some() {
        s.fds.clear();
    } else {
        s.fds.truncate(1);
    }
}

fn held_by_anyone(sessions: &HashMap<u64, Session>, name: &str) -> bool {
    sessions.values().any(|s| s.held.contains_key(name))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn shm_exists(name: &str) -> bool {
    std::fs::symlink_metadata(shm_path(name)).is_ok()
}

/// The peer's pid and uid as the kernel saw them at connect time; uid
/// `u32::MAX` (never a real one) when the kernel will not tell.
fn peer_credentials(stream: &UnixStream) -> (i32, libc::uid_t) {
    // SAFETY: ucred is plain data; getsockopt writes at most `len` bytes.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc == 0 {
        (cred.pid, cred.uid)
    } else {
        (-1, libc::uid_t::MAX)
    }
}

/// A signalfd that becomes readable on SIGTERM, SIGINT or SIGHUP (blocked
/// for normal delivery), so a stop request is one more fd in the poll set
/// and the daemon cleans up instead of dying. SIGPIPE is ignored: a write
/// to a gone client is an error return.
fn stop_signal_fd() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: sigset operations on a local set; the daemon is single-threaded,
    // so blocking with sigprocmask covers the whole process.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return None;
        }
        let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
        (fd >= 0).then(|| std::os::fd::OwnedFd::from_raw_fd(fd))
    }
}

/// The daemon's main: what `ss_shm_manager` (and torch_shm_manager) do when
/// run with no arguments. Prints the socket path (or `ERROR: ...`) and a
/// newline on stdout, then serves until idle. Returns the exit code.
pub fn daemon_main() -> i32 {
    // Leave the spawner's session so its terminal signals do not reach us.
    // SAFETY: setsid has no memory effects; failure (already a leader) is fine.
    unsafe { libc::setsid() };
    close_inherited_fds();
    raise_fd_limit();
    let mut server = match Server::bind() {
        Ok(s) => s,
        Err(e) => {
            println!("ERROR: {e}");
            return 1;
        }
    };
    {
        let mut out = std::io::stdout().lock();
        if writeln!(out, "{}", server.socket_path().display()).and_then(|_| out.flush()).is_err() {
            return 1;
        }
    }
    // Nothing more goes to stdout, nor to stderr unless logging: point them
    // at /dev/null so the spawner's pipes close now (a caller capturing
    // its output does not wait for us) and a later print cannot SIGPIPE us.
    redirect_to_null(1);
    if !server.log {
        redirect_to_null(2);
    }
    match server.run() {
        Ok(()) => 0,
        Err(e) => {
            crate::log::warn(&format!("ss_shm_manager: {e}"));
            1
        }
    }
}

/// Closes every descriptor above stderr that the spawner leaked to us
/// (anything it did not mark close-on-exec): holding, say, one end of its
/// socketpair would keep its peer from ever seeing EOF.
fn close_inherited_fds() {
    // SAFETY: close_range only closes descriptors; nothing else is open yet.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if rc == 0 {
        return;
    }
    // Kernels before 5.9: walk /proc/self/fd instead.
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    for fd in fds.into_iter().filter(|fd| *fd > 2) {
        // SAFETY: as above; the directory's own fd may already be gone (EBADF).
        unsafe { libc::close(fd) };
    }
}

/// One descriptor per client: take the whole hard limit.
fn raise_fd_limit() {
    // SAFETY: rlimit is plain data; get/setrlimit only touch our limits.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn redirect_to_null(target: libc::c_int) {
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2 onto a standard descriptor, which we own as the process.
        unsafe { libc::dup2(null.as_raw_fd(), target) };
    }
}

/// A record from a client, decoded, its name checked as a segment name
/// (the same check on the socket and in the registration log).
fn checked_message(rec: &[u8; ALLOC_INFO_SIZE]) -> Result<AllocInfo> {
    let msg = AllocInfo::decode(rec)?;
    validate_shm_name(&msg.filename).map_err(|e| Error::new(ErrorKind::Protocol, e.message().to_string()))?;
    Ok(msg)
}
