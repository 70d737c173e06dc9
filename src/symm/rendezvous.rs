//! Rendezvous of one block over one group (docs/pytorch-compat.md): open the
//! descriptor socket, all-gather the request (with this library's pad size
//! and socket name beside it) through the store, check every rank's pad and
//! sizes against rank 0's, pass the block descriptors round the ring, map
//! the peers, and meet once more through the store before the sockets go.

use super::backend::{Collective, SymmBlock};
use super::exchange;
use super::group::GroupInfo;
use super::handle::SymmetricMemory;
use super::ipc_channel::{IpcChannel, PeerSocket};
use super::request::RendezvousRequest;
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::abstract_socket;
use crate::store::Timeout;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Instant;

/// Runs the rendezvous of `block` (made by backend `backend`) in `group`.
pub fn run(block: &dyn SymmBlock, backend: &str, group: &GroupInfo, timeout: Timeout) -> Result<SymmetricMemory> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let layout = block.layout();
    let prefix = exchange::prefix(group, backend);
    let mut mine = RendezvousRequest::new(block.device_idx(), &layout);
    mine.has_multicast_support = block.multicast_capable();
    // Listening before the peers learn the name: whoever connects to it
    // reaches this process. The socket vanishes with the process, so a
    // rank killed while it waits for the others leaves nothing behind.
    let channel = IpcChannel::open()?;
    let side = SideInfo {
        signal_pad_size: layout.signal_pad_size as u64,
        start: crate::proc_identity::me().1,
        socket: channel.name().to_string(),
    };
    let (gathered, sides) = exchange::all_gather_with_side(group, &prefix, &mine.to_bytes(), &side.to_bytes(), timeout)?;
    let context = |e: Error| e.context(format!("rendezvous of group {}", group.name));
    let requests =
        gathered.iter().enumerate().map(|(r, b)| RendezvousRequest::from_bytes(b, r)).collect::<Result<Vec<_>>>().map_err(context)?;
    let sides = sides.iter().enumerate().map(|(r, b)| SideInfo::from_bytes(b, r)).collect::<Result<Vec<_>>>().map_err(context)?;
    check_pads(&sides, group)?;
    check_requests(&requests, group)?;
    block.check_requests(&requests, &group.name)?;

    let own = block.export()?;
    let peers: Vec<PeerSocket> =
        requests.iter().zip(sides).map(|(r, s)| PeerSocket { pid: r.pid, start: s.start, name: s.socket }).collect();
    let fds = channel
        .all_gather(own.as_raw_fd(), group.rank, &peers, deadline)
        .map_err(|e| e.context(format!("rendezvous of group {} on rank {}", group.name, group.rank)))?;
    let coll = RendezvousCollective { channel: &channel, group, prefix: &prefix, peers: &peers, deadline };
    let peer_access = block.import(group.rank, fds, &requests, &coll)?;
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    exchange::barrier(group, &prefix, left)?;
    drop(channel);
    Ok(SymmetricMemory::new(group.rank, group.world_size, layout, &group.name, peer_access))
}

/// What this library's ranks publish next to PyTorch's request: the
/// signal pad size (which the request does not carry: pads of 9216 and
/// 12288 bytes give blocks of one size), the rank's process start time
/// (the request has its pid, which another process may get once the rank
/// exits) and the name of the descriptor socket. Bytes: the pad size and
/// the start time as little-endian u64s, then the name.
struct SideInfo {
    signal_pad_size: u64,
    start: u64,
    socket: String,
}

impl SideInfo {
    fn to_bytes(&self) -> Vec<u8> {
        let mut b = self.signal_pad_size.to_le_bytes().to_vec();
        b.extend_from_slice(&self.start.to_le_bytes());
        b.extend_from_slice(self.socket.as_bytes());
        b
    }

    fn from_bytes(b: &[u8], rank: usize) -> Result<SideInfo> {
        let bad = |why: &str| Error::new(ErrorKind::Protocol, format!("rendezvous details of rank {rank}: {why}"));
        if b.len() <= 16 || b.len() > 16 + abstract_socket::MAX_NAME {
            return Err(bad(&format!("{} bytes, expected 17 to {}", b.len(), 16 + abstract_socket::MAX_NAME)));
        }
        let signal_pad_size = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let start = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let socket = std::str::from_utf8(&b[16..])
            .ok()
            .filter(|n| n.starts_with("symm_mem-") && n.bytes().all(|c| c.is_ascii_graphic()))
            .ok_or_else(|| bad("the socket name is not symm_mem-<...> in plain ASCII"))?;
        Ok(SideInfo { signal_pad_size, start, socket: socket.to_string() })
    }
}

/// Every rank must have rank 0's signal pad size: a signal put into a
/// larger pad than the waiter's lands where nobody waits for it.
fn check_pads(sides: &[SideInfo], group: &GroupInfo) -> Result<()> {
    let first = sides[0].signal_pad_size;
    match sides.iter().enumerate().find(|(_, s)| s.signal_pad_size != first) {
        None => Ok(()),
        Some((r, s)) => Err(Error::new(
            ErrorKind::SizeMismatch,
            format!(
                "rendezvous of group {}: rank {r} has a signal pad of {} bytes but rank 0 has {first} bytes; \
                 every rank must set the same signal pad size (ss_symm_set_signal_pad_size)",
                group.name, s.signal_pad_size
            ),
        )),
    }
}

/// The rendezvous's store and descriptor socket, for a backend's further
/// collective steps.
struct RendezvousCollective<'a> {
    channel: &'a IpcChannel,
    group: &'a GroupInfo,
    prefix: &'a str,
    peers: &'a [PeerSocket],
    deadline: Option<Instant>,
}

impl Collective for RendezvousCollective<'_> {
    fn broadcast_fd(&self, src: usize, fd: Option<RawFd>) -> Result<Option<OwnedFd>> {
        self.channel
            .broadcast(fd, src, self.group.rank, self.peers, self.deadline)
            .map_err(|e| e.context(format!("rendezvous of group {} on rank {}", self.group.name, self.group.rank)))
    }

    fn all_gather(&self, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let left = self.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        exchange::all_gather(self.group, self.prefix, value, left)
    }
}

/// Every rank must have the layout of rank 0 and be on rank 0's host. Each
/// rank sees all requests, so a mismatch fails on every rank alike.
fn check_requests(requests: &[RendezvousRequest], group: &GroupInfo) -> Result<()> {
    let first = &requests[0];
    for (r, req) in requests.iter().enumerate().skip(1) {
        if (req.block_size, req.buffer_size, req.buffer_offset) != (first.block_size, first.buffer_size, first.buffer_offset) {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!(
                    "rendezvous of group {}: rank {r} allocated {} bytes (block {}, buffer offset {}) but rank 0 \
                     allocated {} bytes (block {}, buffer offset {}); every rank must allocate the same size",
                    group.name,
                    req.buffer_size,
                    req.block_size,
                    req.buffer_offset,
                    first.buffer_size,
                    first.block_size,
                    first.buffer_offset
                ),
            ));
        }
        if req.hostname != first.hostname {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "rendezvous of group {}: rank {r} runs on host {} but rank 0 on {}; symmetric memory needs every rank on one host",
                    group.name,
                    req.host(),
                    first.host()
                ),
            ));
        }
    }
    Ok(())
}
