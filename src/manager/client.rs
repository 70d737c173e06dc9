//! The managed allocator's side of libshm: one connection per manager
//! socket per process, registrations answered by `OK`, frees that are not.
//!
//! Registrations are pipelined: `register` sends the record and returns;
//! the `OK` is collected at the start of the next call on the connection
//! (or by [`Client::sync`]), and at most [`MAX_OWED_REPLIES`] may be
//! outstanding before a call waits. The guarantee libshm wants from
//! "register before mapping" still holds: the record is in the manager's
//! socket before we map, and the manager reads it even if we die right
//! after (a dead sender's queued bytes stay readable). A manager that is
//! gone fails the send at once; one that answers anything but `OK`, or
//! does not answer within the time-out once replies are awaited, breaks
//! the connection with a `Protocol` or `Timeout` error, and the next use
//! reconnects. A break found while sending a free (closing a segment, with
//! nobody to tell) is kept and returned once by the next call on that
//! manager, so the user learns that earlier messages may be lost. This
//! saves one round trip to the manager per open.
//!
//! A free of a name that is gone already (this process closed the last
//! reference and removed it) is not sent at once: it waits in the
//! connection's outbox and goes out in the same write as the next message
//! (at most [`MAX_DEFERRED_FREES`] wait), so the manager is woken once for
//! both. Nothing can leak meanwhile: the name no longer exists, and a
//! manager that never gets the free (this process died) finds it gone.
//! Frees of names that still exist are sent at once, as the manager counts
//! a holder's references from its registrations and frees.
//!
//! Unlike libshm, a connection inherited across fork() is not reused by the
//! child (replies would go to whichever process reads first): each process
//! opens its own.

use super::protocol::{AllocInfo, ALLOC_INFO_SIZE, OK_REPLY};
use super::reglog::{RegLog, ATTACH_NAME, DRAIN_FLAG, LOG_REPLY};
use super::spawn;
use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a call waits for the manager's `OK` once it must.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Registrations that may await their `OK` before `register` waits.
pub const MAX_OWED_REPLIES: usize = 64;
/// Frees of gone names that may wait for the next message.
pub const MAX_DEFERRED_FREES: usize = 32;

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    /// Registrations whose `OK` has not been read yet.
    owed: usize,
    /// Bytes of a reply read so far (a reply may arrive split).
    partial: Vec<u8>,
    /// Set once the connection broke; every later call fails with it.
    broken: Option<Error>,
    /// The break was found by a `free`, whose caller cannot report it: the
    /// next call on this manager returns it (see [`client_for`]).
    unreported: bool,
    /// Deferred frees of gone names, then the message being sent: one
    /// write (the buffer is kept between calls).
    outbox: Vec<u8>,
    /// The registration log offered at connect, until the first reply says
    /// whether the manager took it (ours: `LG`; libshm's: `OK`).
    offered_log: Option<RegLog>,
    /// The log the manager took: registrations and frees go there once no
    /// socket registration awaits its reply (see `use_log`).
    log: Option<RegLog>,
}

/// A connection to one manager.
#[derive(Debug)]
pub struct Client {
    path: String,
    pid: u32,
    conn: Mutex<Conn>,
    timeout: Duration,
}

impl Client {
    /// Connects to the manager listening at `path`.
    pub fn connect(path: &str) -> Result<Self> {
        Self::connect_with_timeout(path, REPLY_TIMEOUT)
    }

    pub fn connect_with_timeout(path: &str, timeout: Duration) -> Result<Self> {
        if path.is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, "empty shared memory manager handle"));
        }
        // sun_path holds 108 bytes with the NUL.
        if path.len() >= 108 {
            return Err(Error::new(
                ErrorKind::NameTooLong,
                format!("shared memory manager socket path <{path}> has {} bytes, at most 107 fit", path.len()),
            ));
        }
        let stream = UnixStream::connect(path).map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("could not connect to the shared memory manager at <{path}>"))
        })?;
        let conn = Conn {
            stream,
            owed: 0,
            partial: Vec::with_capacity(2),
            broken: None,
            unreported: false,
            outbox: Vec::with_capacity((MAX_DEFERRED_FREES + 1) * ALLOC_INFO_SIZE),
            offered_log: None,
            log: None,
        };
        let client = Client { path: path.to_string(), pid: std::process::id(), conn: Mutex::new(conn), timeout };
        client.offer_log();
        Ok(client)
    }

    /// Sends a registration log's descriptor with the attach registration;
    /// its reply is collected with the others. Without a log (memfd
    /// refused, say) everything goes over the socket, as with libshm.
    fn offer_log(&self) {
        let Ok((log, fd)) = RegLog::create() else { return };
        let Ok(msg) = AllocInfo::new(self.pid as i32, false, ATTACH_NAME) else { return };
        let mut c = self.conn();
        let sock = c.stream.as_raw_fd();
        match crate::fdpass::send_fds(sock, &msg.encode(), &[fd.as_raw_fd()]) {
            Ok(n) if n == ALLOC_INFO_SIZE => {
                c.owed += 1;
                c.offered_log = Some(log);
            }
            Ok(n) => {
                // The rest of the record must still go, or the stream is cut.
                let rest = msg.encode()[n..].to_vec();
                if self.send(&mut c, &rest).is_ok() {
                    c.owed += 1;
                    c.offered_log = Some(log);
                }
            }
            Err(e) => c.broken = Some(e),
        }
    }

    /// Whether a message may go to the log: the manager took it and every
    /// socket registration has its reply, so the manager has read all that
    /// was sent on the socket before (a log record read before an earlier
    /// socket registration of the same name would undo the order).
    fn use_log(c: &Conn) -> bool {
        c.log.is_some() && c.owed == 0 && c.broken.is_none()
    }

    /// Appends `msg` to the log (after any deferred frees), first asking
    /// the manager to read a full log and waiting for its `OK`.
    fn append_to_log(&self, c: &mut Conn, msg: Option<&[u8; ALLOC_INFO_SIZE]>) -> Result<()> {
        // Taken out and given back: no allocation on this path.
        let mut outbox = std::mem::take(&mut c.outbox);
        let result = outbox.chunks_exact(ALLOC_INFO_SIZE).chain(msg.map(|m| &m[..])).try_for_each(|rec| self.append_one(c, rec));
        outbox.clear();
        c.outbox = outbox;
        result
    }

    /// Appends one record, asking the manager to read a full log first.
    fn append_one(&self, c: &mut Conn, rec: &[u8]) -> Result<()> {
        let rec: &[u8; ALLOC_INFO_SIZE] = rec.try_into().expect("whole records");
        if c.log.as_ref().expect("log in use").append(rec) {
            return Ok(());
        }
        self.drain_log(c)?;
        if c.log.as_ref().expect("log in use").append(rec) {
            return Ok(());
        }
        let e = Error::new(ErrorKind::Protocol, format!("the shared memory manager <{}> did not read the registration log", self.path));
        c.broken = Some(e.clone());
        Err(e)
    }

    /// Asks the manager to read the log now and waits for its `OK`.
    fn drain_log(&self, c: &mut Conn) -> Result<()> {
        let mut drain = [0u8; ALLOC_INFO_SIZE];
        drain[..4].copy_from_slice(&(self.pid as i32).to_ne_bytes());
        drain[4] = DRAIN_FLAG;
        self.send(c, &drain)?;
        c.owed += 1;
        self.collect(c, 0)
    }

    /// Finds a manager that closed the connection without a system call
    /// that could wake it: a peek that does not wait.
    fn check_alive(&self, c: &mut Conn) -> Result<()> {
        let mut b = 0u8;
        // SAFETY: reading at most one byte into `b`, without consuming it.
        let n = unsafe { libc::recv(c.stream.as_raw_fd(), (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        let e = if n == 0 {
            Error::new(ErrorKind::PeerGone, format!("Other end has closed the connection (shared memory manager <{}>)", self.path))
        } else if n < 0 && !matches!(crate::error::errno(), libc::EAGAIN | libc::EINTR) {
            Error::from_errno(crate::error::errno(), self.what())
        } else {
            return Ok(());
        };
        c.broken = Some(e.clone());
        Err(e)
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Conn> {
        // Every update under the lock leaves Conn consistent (no user code
        // runs there), so a poisoned lock still holds valid data.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether registrations and frees go to the registration log now
    /// (our manager took it, and no socket registration awaits a reply).
    pub fn uses_registration_log(&self) -> bool {
        Self::use_log(&self.conn())
    }

    /// Whether the connection broke (a later `client_for` reconnects).
    pub fn is_broken(&self) -> bool {
        self.conn().broken.is_some()
    }

    /// Neither broken nor holding an error for the next caller.
    fn in_order(&self) -> bool {
        let c = self.conn();
        c.broken.is_none() && !c.unreported
    }

    /// The error a `free` met and could not report, once.
    fn take_unreported(&self) -> Option<Error> {
        let mut c = self.conn();
        if !c.unreported {
            return None;
        }
        c.unreported = false;
        c.broken.clone()
    }

    /// A connection inherited across fork() belongs to the parent: the
    /// child must not use it (nor wait on its lock, which a thread of the
    /// parent may have held at the fork).
    fn check_owner(&self) -> Result<u32> {
        let me = std::process::id();
        if self.pid != me {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "the connection to the shared memory manager <{}> belongs to process {}, not to this forked child",
                    self.path, self.pid
                ),
            ));
        }
        Ok(me)
    }

    /// Tells the manager this process maps (or is about to map) `filename`.
    /// The `OK` is checked later (see the module comment); call
    /// [`Client::sync`] to wait for it now.
    pub fn register(&self, filename: &str) -> Result<()> {
        let me = self.check_owner()?;
        let msg = AllocInfo::new(me as i32, false, filename)?.encode();
        let mut c = self.conn();
        // The caller gets any error: it is reported.
        c.unreported = false;
        // The log's offer does not count against the limit.
        let limit = MAX_OWED_REPLIES - 1 + usize::from(c.offered_log.is_some());
        self.collect(&mut c, limit)?;
        if Self::use_log(&c) {
            self.check_alive(&mut c)?;
            return self.append_to_log(&mut c, Some(&msg));
        }
        self.send(&mut c, &msg)?;
        c.owed += 1;
        Ok(())
    }

    /// Tells the manager this process unmapped `filename`; no reply comes.
    /// Callers close segments and usually cannot report a failure here, so
    /// a connection that breaks in this call also keeps the error for the
    /// next call on this manager (see [`client_for`]). In a forked child,
    /// a connection of the parent is left alone: nothing is sent.
    pub fn free(&self, filename: &str) -> Result<()> {
        self.free_message(filename, false)
    }

    /// [`Client::free`] for a name this process has just removed (it closed
    /// the last reference): sent with the next message on this connection
    /// (see the module comment), or now once enough wait.
    pub fn free_gone(&self, filename: &str) -> Result<()> {
        self.free_message(filename, true)
    }

    fn free_message(&self, filename: &str, gone: bool) -> Result<()> {
        let me = std::process::id();
        if self.pid != me {
            return Ok(());
        }
        let msg = AllocInfo::new(me as i32, true, filename)?.encode();
        let mut c = self.conn();
        if c.broken.is_none() && c.owed > 0 {
            // Replies that are there already may allow the log.
            if let Err(e) = self.collect(&mut c, usize::MAX) {
                c.unreported = true;
                return Err(e);
            }
        }
        if Self::use_log(&c) {
            let result = self.append_to_log(&mut c, Some(&msg));
            if result.is_err() {
                c.unreported = true;
            }
            return result;
        }
        if gone && c.broken.is_none() && c.outbox.len() < MAX_DEFERRED_FREES * ALLOC_INFO_SIZE {
            c.outbox.extend_from_slice(&msg);
            return Ok(());
        }
        let was_broken = c.broken.is_some();
        let result = self.collect(&mut c, usize::MAX).and_then(|()| self.send(&mut c, &msg));
        if result.is_err() && !was_broken {
            c.unreported = true;
        }
        result
    }

    /// Sends the deferred frees, then waits until every registration sent
    /// so far has its `OK` (with a registration log: until the manager has
    /// read the log).
    pub fn sync(&self) -> Result<()> {
        self.check_owner()?;
        let mut c = self.conn();
        c.unreported = false;
        self.collect(&mut c, 0)?;
        if Self::use_log(&c) {
            // Everything in the log is read once the manager answers.
            self.append_to_log(&mut c, None)?;
            return self.drain_log(&mut c);
        }
        if !c.outbox.is_empty() {
            self.collect(&mut c, usize::MAX).and_then(|()| self.send(&mut c, &[]))?;
        }
        self.collect(&mut c, 0)
    }

    /// Reads the replies that are there, and waits (up to the time-out)
    /// until at most `max_owed` are outstanding.
    fn collect(&self, c: &mut Conn, max_owed: usize) -> Result<()> {
        if let Some(e) = &c.broken {
            return Err(e.clone());
        }
        if c.owed == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        while c.owed > 0 {
            let must_wait = c.owed > max_owed;
            match self.read_replies(c, must_wait, deadline) {
                // One read takes every reply there is: no second try that
                // would only find the socket empty.
                Ok(_) if !must_wait => return Ok(()),
                Ok(_) => {}
                Err(e) => {
                    c.broken = Some(e.clone());
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// One read of replies; returns how many `OK`s it consumed.
    fn read_replies(&self, c: &mut Conn, wait: bool, deadline: Instant) -> Result<usize> {
        let fd = c.stream.as_raw_fd();
        if wait {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as libc::c_int) };
            if n == 0 {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("Shared memory manager connection has timed out (manager <{}>, {} ms)", self.path, self.timeout.as_millis()),
                ));
            }
            if n < 0 {
                let errno = crate::error::errno();
                return if errno == libc::EINTR { Ok(0) } else { Err(Error::from_errno(errno, self.what())) };
            }
        }
        let mut buf = [0u8; 2 * MAX_OWED_REPLIES];
        let want = (2 * c.owed - c.partial.len()).min(buf.len());
        // SAFETY: reading at most `want` bytes into our buffer.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), want, libc::MSG_DONTWAIT) };
        if n < 0 {
            let errno = crate::error::errno();
            return match errno {
                libc::EAGAIN | libc::EINTR => Ok(0),
                _ => Err(Error::from_errno(errno, self.what())),
            };
        }
        if n == 0 {
            return Err(Error::new(
                ErrorKind::PeerGone,
                format!("Other end has closed the connection (shared memory manager <{}>)", self.path),
            ));
        }
        c.partial.extend_from_slice(&buf[..n as usize]);
        let mut got = 0;
        while c.partial.len() >= 2 {
            let reply = [c.partial[0], c.partial[1]];
            let valid = match c.offered_log.take() {
                // The first reply answers the log's offer.
                Some(log) if &reply == LOG_REPLY => {
                    c.log = Some(log);
                    true
                }
                // libshm's manager took it as a registration of a name
                // that never exists (it unlinks it, harmlessly, once we go).
                _ => &reply == OK_REPLY,
            };
            if !valid {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("Shared memory manager didn't respond with an OK (manager <{}>, got {:?})", self.path, &c.partial[..2]),
                ));
            }
            c.partial.drain(..2);
            c.owed -= 1;
            got += 1;
        }
        Ok(got)
    }

    fn what(&self) -> String {
        format!("shared memory manager <{}>", self.path)
    }

    /// Writes the deferred frees and then `msg` (may be empty) in one go.
    fn send(&self, c: &mut Conn, msg: &[u8]) -> Result<()> {
        c.outbox.extend_from_slice(msg);
        let fd = c.stream.as_raw_fd();
        let out = &c.outbox;
        // MSG_NOSIGNAL: a dead manager must be an error, not SIGPIPE.
        let mut sent = 0;
        let mut failed = None;
        while sent < out.len() {
            // SAFETY: the buffer range is valid for reading.
            let n = unsafe { libc::send(fd, out[sent..].as_ptr().cast(), out.len() - sent, libc::MSG_NOSIGNAL) };
            if n < 0 {
                let errno = crate::error::errno();
                if errno == libc::EINTR {
                    continue;
                }
                failed = Some(Error::from_errno(errno, format!("could not send to the shared memory manager at <{}>", self.path)));
                break;
            }
            sent += n as usize;
        }
        c.outbox.clear();
        if let Some(e) = failed {
            c.broken = Some(e.clone());
            return Err(e);
        }
        Ok(())
    }
}

struct Connections {
    by_path: BTreeMap<String, Arc<Client>>,
    /// The manager this process spawned (or adopted) for handle-less use.
    default: Option<String>,
}

/// Fork-safe (see `fork_safe`); each connection's own lock is never taken
/// by a forked child (connections of the parent are left alone there).
static CONNECTIONS: ForkSafeMutex<Connections> = ForkSafeMutex::new(Connections { by_path: BTreeMap::new(), default: None });

fn connections() -> std::sync::MutexGuard<'static, Connections> {
    CONNECTIONS.lock_static()
}

/// If this process's connection to `path` broke inside a `free` and no
/// caller has seen the error yet, forgets the connection (the next call
/// reconnects) and returns the error to report now.
fn take_unreported(c: &mut Connections, path: &str, me: u32) -> Option<Error> {
    let client = c.by_path.get(path).filter(|cl| cl.pid == me)?;
    let e = client.take_unreported()?;
    c.by_path.remove(path);
    Some(e.context(format!(
        "the connection to the shared memory manager <{path}> broke while a segment was being freed, so registrations and frees sent before may not have reached it"
    )))
}

/// This process's connection to the manager at `path`, opened on first use.
/// A break found inside an earlier `free` on it (which had no caller to
/// tell) is returned here once; the call after that reconnects.
pub fn client_for(path: &str) -> Result<Arc<Client>> {
    client_in(&mut connections(), path, std::process::id())
}

fn client_in(c: &mut Connections, path: &str, me: u32) -> Result<Arc<Client>> {
    if let Some(e) = take_unreported(c, path, me) {
        return Err(e);
    }
    if let Some(client) = c.by_path.get(path) {
        if client.pid == me && !client.is_broken() {
            return Ok(client.clone());
        }
    }
    let client = Arc::new(Client::connect(path)?);
    c.by_path.insert(path.to_string(), client.clone());
    Ok(client)
}

/// Registers `name` with [`default_client`] before the name exists, so
/// the manager removes it once no live process maps it, even after a
/// kill -9; the client to tell (with [`tell_freed`]) when it goes.
pub fn register_with_default(name: &str) -> Result<Arc<Client>> {
    default_client().and_then(|client| client.register(name).map(|()| client))
}

/// Tells `manager`, where `name` was registered, that it is gone. No reply
/// is waited for; a manager that is gone is not an error.
pub fn tell_freed(manager: &Option<Arc<Client>>, name: &str) {
    if let Some(c) = manager {
        let _ = c.free(name);
    }
}

/// The connection used when no handle is given: an existing one of this
/// process (as libshm), else a manager spawned now.
pub fn default_client() -> Result<Arc<Client>> {
    let me = std::process::id();
    {
        let mut c = connections();
        // The common case, without copying the path: the default
        // connection is this process's and in order.
        if let Some(client) = c.default.as_ref().and_then(|d| c.by_path.get(d)) {
            if client.pid == me && client.in_order() {
                return Ok(client.clone());
            }
        }
        let path = c.default.clone().or_else(|| c.by_path.values().find(|cl| cl.pid == me).map(|cl| cl.path.clone()));
        if let Some(path) = path {
            if let Some(e) = take_unreported(&mut c, &path, me) {
                return Err(e);
            }
            // A forked child reconnects to the same manager by path.
            if let Ok(client) = client_in(&mut c, &path, me) {
                c.default = Some(path);
                return Ok(client);
            }
        }
    }
    // A daemon we cannot connect to is stopped again (see spawn).
    let binary = spawn::find_manager_binary()?;
    let (path, client) = spawn::spawn_manager_then(&binary, client_for)?;
    connections().default = Some(path);
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_handles() {
        assert_eq!(Client::connect("").unwrap_err().kind(), ErrorKind::InvalidArgument);
        let long = format!("/tmp/{}", "x".repeat(120));
        assert_eq!(Client::connect(&long).unwrap_err().kind(), ErrorKind::NameTooLong);
        let e = Client::connect("/nonexistent-dir/manager.sock").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.message().contains("/nonexistent-dir/manager.sock"), "{e}");
    }
}
