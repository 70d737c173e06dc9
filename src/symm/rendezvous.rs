//! Rendezvous of one block over one group (ATEN_COMPAT 9.4): all-gather the
//! request through the store, check every rank's sizes against rank 0's,
//! bind the descriptor socket, pass the block descriptors round the ring,
//! map the peers, and meet once more through the store before the sockets go.

use super::backend::{Collective, SymmBlock};
use super::exchange;
use super::group::GroupInfo;
use super::handle::SymmetricMemory;
use super::ipc_channel::IpcChannel;
use super::request::RendezvousRequest;
use crate::error::{Error, ErrorKind, Result};
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
    let gathered = exchange::all_gather(group, &prefix, &mine.to_bytes(), timeout)?;
    let requests = gathered
        .iter()
        .enumerate()
        .map(|(r, b)| RendezvousRequest::from_bytes(b, r))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| e.context(format!("rendezvous of group {}", group.name)))?;
    check_requests(&requests, group)?;
    block.check_requests(&requests, &group.name)?;

    // Bound only now, after the long wait for the peers: a rank killed
    // while it waits leaves no socket file behind. A peer that sends
    // before we are bound retries (see `IpcChannel::send`).
    let channel = IpcChannel::new(&group.name, deadline)?;

    let own = block.export()?;
    let pids: Vec<i32> = requests.iter().map(|r| r.pid).collect();
    let fds = channel
        .all_gather(own.as_raw_fd(), group.rank, &pids, deadline)
        .map_err(|e| e.context(format!("rendezvous of group {} on rank {}", group.name, group.rank)))?;
    let coll = RendezvousCollective { channel: &channel, group, prefix: &prefix, pids: &pids, deadline };
    let peers = block.import(group.rank, fds, &requests, &coll)?;
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    exchange::barrier(group, &prefix, left)?;
    drop(channel);
    Ok(SymmetricMemory::new(group.rank, group.world_size, layout, &group.name, peers))
}

/// The rendezvous's store and descriptor socket, for a backend's further
/// collective steps.
struct RendezvousCollective<'a> {
    channel: &'a IpcChannel,
    group: &'a GroupInfo,
    prefix: &'a str,
    pids: &'a [i32],
    deadline: Option<Instant>,
}

impl Collective for RendezvousCollective<'_> {
    fn broadcast_fd(&self, src: usize, fd: Option<RawFd>) -> Result<Option<OwnedFd>> {
        self.channel
            .broadcast(fd, src, self.group.rank, self.pids, self.deadline)
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
                    group.name, req.buffer_size, req.block_size, req.buffer_offset, first.buffer_size, first.block_size,
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
