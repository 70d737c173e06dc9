//! A c10d `TCPStore` server: what a master rank runs so plain C/Go ranks
//! need no Python, and PyTorch clients can join it. One thread serves every
//! connection from an epoll loop (`event_loop`), as PyTorch's libuv server
//! does; waits are parked in the state (`state`) and answered by whichever
//! request sets their last key.

mod event_loop;
mod limits;
mod state;

pub use limits::{ServerLimits, SMALL_REQUEST};

use crate::error::{Error, ErrorKind, Result};
use crate::poller::Bell;
use event_loop::EventLoop;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;

/// A running server; stops (closing every connection) when dropped.
pub struct TcpServer {
    bell: Arc<Bell>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl TcpServer {
    /// Listens on `host:port` (port 0: any free port, see [`Self::port`])
    /// with the default [`ServerLimits`]. A port already in use is
    /// `ErrorKind::Busy`.
    pub fn start(host: &str, port: u16) -> Result<TcpServer> {
        TcpServer::start_with_limits(host, port, ServerLimits::default())
    }

    /// [`start`](Self::start) with other bounds on connections and on the
    /// bytes of unfinished requests.
    pub fn start_with_limits(host: &str, port: u16, limits: ServerLimits) -> Result<TcpServer> {
        let name = format!("{host}:{port}");
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("cannot resolve TCPStore host {name}: {e}")))?
            .collect();
        let mut last = None;
        let mut listener = None;
        for a in &addrs {
            match TcpListener::bind(a) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let listener = listener.ok_or_else(|| match last {
            Some(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {
                Error::new(ErrorKind::Busy, format!("cannot serve a TCPStore on {name}: the port is in use by another server"))
            }
            Some(e) => {
                let kind = e.raw_os_error().map_or(ErrorKind::Io, crate::error::kind_of_errno);
                Error::new(kind, format!("cannot serve a TCPStore on {name}: {e}"))
            }
            None => Error::new(ErrorKind::InvalidArgument, format!("TCPStore host {name} resolves to no address")),
        })?;
        let addr = listener.local_addr().map_err(|e| Error::new(ErrorKind::Io, format!("{name}: {e}")))?;
        let io = |e: std::io::Error| Error::new(ErrorKind::Io, format!("cannot start the TCPStore server on {name}: {e}"));
        let bell = Arc::new(Bell::new().map_err(io)?);
        let event_loop = EventLoop::new(listener, bell.clone(), limits).map_err(io)?;
        let thread = std::thread::Builder::new()
            .name("ss-tcpstore".into())
            .spawn(move || event_loop.run())
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start the TCPStore server thread: {e}")))?;
        Ok(TcpServer { bell, addr, thread: Some(thread) })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.bell.ring();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
