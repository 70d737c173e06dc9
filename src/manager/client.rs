//! The managed allocator's side of libshm: one connection per manager
//! socket per process, registrations that wait for `OK`, frees that do not.
//!
//! Unlike libshm, a connection inherited across fork() is not reused by the
//! child (replies would go to whichever process reads first): each process
//! opens its own.

use super::protocol::{AllocInfo, ALLOC_INFO_SIZE, OK_REPLY};
use super::spawn;
use crate::error::{Error, ErrorKind, Result};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::io::{ErrorKind as IoKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a registration waits for the manager's `OK`.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to one manager.
#[derive(Debug)]
pub struct Client {
    path: String,
    pid: u32,
    stream: Mutex<UnixStream>,
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
            Error::from_errno(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("could not connect to the shared memory manager at <{path}>"),
            )
        })?;
        Ok(Client { path: path.to_string(), pid: std::process::id(), stream: Mutex::new(stream), timeout })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    fn stream(&self) -> std::sync::MutexGuard<'_, UnixStream> {
        // Every use writes or reads whole messages under the lock; a panic
        // in between cannot happen (no user code runs there).
        self.stream.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tells the manager this process maps `filename` and waits for `OK`.
    pub fn register(&self, filename: &str) -> Result<()> {
        let msg = AllocInfo::new(std::process::id() as i32, false, filename)?.encode();
        let mut s = self.stream();
        self.send(&mut s, &msg)?;
        let mut reply = [0u8; 2];
        self.recv_exact(&mut s, &mut reply)?;
        if &reply != OK_REPLY {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("Shared memory manager didn't respond with an OK (manager <{}>, got {:?})", self.path, reply),
            ));
        }
        Ok(())
    }

    /// Tells the manager this process unmapped `filename`; no reply comes.
    pub fn free(&self, filename: &str) -> Result<()> {
        let msg = AllocInfo::new(std::process::id() as i32, true, filename)?.encode();
        let mut s = self.stream();
        self.send(&mut s, &msg)
    }

    fn send(&self, s: &mut UnixStream, msg: &[u8; ALLOC_INFO_SIZE]) -> Result<()> {
        // MSG_NOSIGNAL: a dead manager must be an error, not SIGPIPE.
        let mut sent = 0;
        while sent < msg.len() {
            // SAFETY: the buffer range is valid for reading.
            let n = unsafe {
                libc::send(s.as_raw_fd(), msg[sent..].as_ptr().cast(), msg.len() - sent, libc::MSG_NOSIGNAL)
            };
            if n < 0 {
                let errno = crate::error::errno();
                if errno == libc::EINTR {
                    continue;
                }
                return Err(Error::from_errno(errno, format!("could not send to the shared memory manager at <{}>", self.path)));
            }
            sent += n as usize;
        }
        Ok(())
    }

    fn recv_exact(&self, s: &mut UnixStream, buf: &mut [u8]) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("Shared memory manager connection has timed out (manager <{}>, {} ms)", self.path, self.timeout.as_millis()),
                ));
            }
            s.set_read_timeout(Some(left)).map_err(|e| io_error(e, &self.path))?;
            match s.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(Error::new(
                        ErrorKind::PeerGone,
                        format!("Other end has closed the connection (shared memory manager <{}>)", self.path),
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {}
                Err(e) => return Err(io_error(e, &self.path)),
            }
        }
        Ok(())
    }
}

fn io_error(e: std::io::Error, path: &str) -> Error {
    Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), format!("shared memory manager <{path}>"))
}

struct Connections {
    by_path: HashMap<String, Arc<Client>>,
    /// The manager this process spawned (or adopted) for handle-less use.
    default: Option<String>,
}

static CONNECTIONS: Lazy<Mutex<Connections>> =
    Lazy::new(|| Mutex::new(Connections { by_path: HashMap::new(), default: None }));

fn connections() -> std::sync::MutexGuard<'static, Connections> {
    CONNECTIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// This process's connection to the manager at `path`, opened on first use.
pub fn client_for(path: &str) -> Result<Arc<Client>> {
    let me = std::process::id();
    let mut c = connections();
    if let Some(client) = c.by_path.get(path) {
        if client.pid == me {
            return Ok(client.clone());
        }
    }
    let client = Arc::new(Client::connect(path)?);
    c.by_path.insert(path.to_string(), client.clone());
    Ok(client)
}

/// The connection used when no handle is given: an existing one of this
/// process (as libshm), else a manager spawned now.
pub fn default_client() -> Result<Arc<Client>> {
    let me = std::process::id();
    let path = {
        let c = connections();
        c.default.clone().or_else(|| c.by_path.values().find(|cl| cl.pid == me).map(|cl| cl.path.clone()))
    };
    if let Some(path) = path {
        // A forked child reconnects to the same manager by path.
        if let Ok(client) = client_for(&path) {
            connections().default = Some(path);
            return Ok(client);
        }
    }
    let path = spawn::spawn_manager()?;
    let client = client_for(&path)?;
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
