//! All-gather through a group's store, as PyTorch's `StoreExchange`: rank r
//! sets `<prefix>/<seq>/<r>`, then waits for and reads every peer's key.
//! `seq` comes from the group, so ranks must run the same exchanges in the
//! same order; keys are never deleted (as in PyTorch).

use super::group::GroupInfo;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::time::{Duration, Instant};

/// The key prefix of `group`'s exchanges for `backend` ("CPU" gives
/// `symmetric_memory-<group>/CPUSymmetricMemory`): the group name keeps
/// two groups apart when they share one store.
pub fn prefix(group: &GroupInfo, backend: &str) -> String {
    format!("symmetric_memory-{}/{backend}SymmetricMemory", group.name)
}

/// Every rank's `value`, indexed by rank. A rank that does not arrive in
/// time gives a `Timeout` naming the missing ranks.
pub fn all_gather(group: &GroupInfo, prefix: &str, value: &[u8], timeout: Timeout) -> Result<Vec<Vec<u8>>> {
    let seq = group.next_seq();
    let key = |r: usize| format!("{prefix}/{seq}/{r}");
    let deadline = timeout.map(|t| Instant::now() + t);
    group.store.set(key(group.rank).as_bytes(), value)?;
    let peers: Vec<usize> = (0..group.world_size).filter(|&r| r != group.rank).collect();
    let keys: Vec<String> = peers.iter().map(|&r| key(r)).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(String::as_bytes).collect();
    if let Err(e) = group.store.wait(&key_refs, timeout) {
        if e.kind() != ErrorKind::Timeout {
            return Err(e.context(format!("exchange {seq} of group {}", group.name)));
        }
        return Err(missing_ranks_error(group, &peers, &keys, seq, timeout));
    }
    let mut out = Vec::with_capacity(group.world_size);
    for r in 0..group.world_size {
        if r == group.rank {
            out.push(value.to_vec());
            continue;
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
        out.push(group.store.get(key(r).as_bytes(), left)?);
    }
    Ok(out)
}

/// A barrier of the group: an all-gather of the int 0, as in PyTorch.
pub fn barrier(group: &GroupInfo, prefix: &str, timeout: Timeout) -> Result<()> {
    all_gather(group, prefix, &0i32.to_ne_bytes(), timeout).map(|_| ())
}

fn missing_ranks_error(group: &GroupInfo, peers: &[usize], keys: &[String], seq: u64, timeout: Timeout) -> Error {
    let missing: Vec<String> = peers
        .iter()
        .zip(keys)
        .filter(|(_, k)| group.store.wait(&[k.as_bytes()], Some(Duration::ZERO)).is_err())
        .map(|(r, _)| r.to_string())
        .collect();
    let waited = timeout.map_or("ever".to_string(), |t| format!("{} ms", t.as_millis()));
    Error::new(
        ErrorKind::Timeout,
        format!(
            "rendezvous of group {} timed out after {waited} on rank {}: rank(s) {} never arrived \
             (exchange {seq}, store {})",
            group.name,
            group.rank,
            if missing.is_empty() { "?".to_string() } else { missing.join(", ") },
            group.store.describe()
        ),
    )
}
