//! What one peer, and all peers together, may hold in the TCPStore server:
//! connections, and bytes of requests that have not fully arrived. The
//! server lives in the master rank's process, so a peer that opened
//! connections without end would take that process's descriptors, and
//! unfinished requests its memory.

/// The bounds a server enforces (see [`super::TcpServer::start_with_limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections from one peer address (all local ranks share one).
    pub connections_per_peer: usize,
    /// Connections in all. Never more than half of the process's soft
    /// descriptor limit either, so the rank keeps descriptors of its own.
    pub connections: usize,
    /// Bytes of one connection's unfinished request.
    pub request_bytes_per_connection: usize,
    /// Bytes of unfinished requests in all; past it, a connection whose
    /// unfinished request is over [`SMALL_REQUEST`] is closed.
    pub request_bytes: usize,
}

/// Unfinished requests up to this size are always taken in (a key, a
/// small value): a flood of big ones cannot stop the job's own traffic.
pub const SMALL_REQUEST: usize = 64 << 10;

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits { connections_per_peer: 4096, connections: 16_384, request_bytes_per_connection: 32 << 20, request_bytes: 256 << 20 }
    }
}

impl ServerLimits {
    /// The connection bound now: the configured one, or half the soft
    /// descriptor limit if that is lower.
    pub fn connections_now(&self) -> usize {
        // SAFETY: rlimit is plain data getrlimit fills in.
        let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer.
        let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 { r.rlim_cur } else { libc::RLIM_INFINITY };
        let half = if soft == libc::RLIM_INFINITY { usize::MAX } else { (soft / 2) as usize };
        self.connections.min(half)
    }
}
