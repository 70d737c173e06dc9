//! All-gather through a group's store, as PyTorch's `StoreExchange`: rank r
//! sets `<prefix>/<seq>/<r>`, then waits for and reads every peer's key.
//! `seq` comes from the group, so ranks must run the same exchanges in the
//! same order; keys are never deleted (as in PyTorch).

use super::group::GroupInfo;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;
use std::time::{Duration, Instant};

/// How many missing ranks a timeout names; the rest are counted.
const NAMED_MISSING: usize = 8;

/// The key prefix of `group`'s exchanges for `backend` ("CPU" gives
/// `symmetric_memory-<group>/CPUSymmetricMemory`): the group name keeps
/// two groups apart when they share one store.
pub fn prefix(group: &GroupInfo, backend: &str) -> String {
    format!("symmetric_memory-{}/{backend}SymmetricMemory", group.name)
}

/// Every rank's bytes, indexed by rank.
pub type PerRank = Vec<Vec<u8>>;

/// An empty vector with room for `n` items, or `NoSpace` instead of an
/// abort when `n` (which callers derive from their input) cannot be had.
pub fn vec_for<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::new(ErrorKind::NoSpace, format!("out of memory for {n} entries of {what}")))?;
    Ok(v)
}

/// Every rank's `value`, indexed by rank. A rank that does not arrive in
/// time gives a `Timeout` naming the missing ranks.
pub fn all_gather(group: &GroupInfo, prefix: &str, value: &[u8], timeout: Timeout) -> Result<Vec<Vec<u8>>> {
    let seq = group.next_seq();
    gather(group, prefix, seq, value, timeout, timeout.map(|t| Instant::now() + t))
}

/// Every rank's `value` and `side`, indexed by rank. `value` travels under
/// the key PyTorch uses, exactly as given; `side` (this library's own
/// rendezvous details) under `<key>/side`, set first, so that a rank whose
/// value is there has its side there too. A rank that published a value
/// but no side (another implementation) gives a `Timeout` naming it.
pub fn all_gather_with_side(group: &GroupInfo, prefix: &str, value: &[u8], side: &[u8], timeout: Timeout) -> Result<(PerRank, PerRank)> {
    let seq = group.next_seq();
    let deadline = timeout.map(|t| Instant::now() + t);
    let side_key = |r: usize| format!("{prefix}/{seq}/{r}/side");
    group.store.set(side_key(group.rank).as_bytes(), side)?;
    let values = gather(group, prefix, seq, value, timeout, deadline)?;
    let mut sides = vec_for(group.world_size, "rendezvous entries")?;
    for r in 0..group.world_size {
        if r == group.rank {
            sides.push(side.to_vec());
            continue;
        }
        let key = side_key(r);
        let got = group.store.get(key.as_bytes(), left(deadline)).map_err(|e| {
            if e.kind() != ErrorKind::Timeout {
                return e.context(format!("exchange {seq} of group {}", group.name));
            }
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "rendezvous of group {} on rank {}: rank {r} published its request but not {key} \
                     (its pad size and descriptor socket): is it run by another implementation?",
                    group.name, group.rank
                ),
            )
        })?;
        sides.push(got);
    }
    Ok((values, sides))
}

/// What is left until `deadline`, at least 1 ms (a store reads 0 as "now").
fn left(deadline: Option<Instant>) -> Timeout {
    deadline.map(|d| d.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))
}

/// Exchange `seq`: `timeout` is the caller's (for the message), `deadline`
/// when it ends.
fn gather(group: &GroupInfo, prefix: &str, seq: u64, value: &[u8], timeout: Timeout, deadline: Option<Instant>) -> Result<Vec<Vec<u8>>> {
    let key = |r: usize| format!("{prefix}/{seq}/{r}");
    group.store.set(key(group.rank).as_bytes(), value)?;
    let mut peers = vec_for(group.world_size, "rendezvous peers")?;
    peers.extend((0..group.world_size).filter(|&r| r != group.rank));
    let mut keys = vec_for(peers.len(), "rendezvous keys")?;
    keys.extend(peers.iter().map(|&r| key(r)));
    let key_refs: Vec<&[u8]> = keys.iter().map(String::as_bytes).collect();
    let wait_for = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    if let Err(e) = group.store.wait(&key_refs, wait_for) {
        if e.kind() != ErrorKind::Timeout {
            return Err(e.context(format!("exchange {seq} of group {}", group.name)));
        }
        return Err(missing_ranks_error(group, &peers, &keys, seq, timeout));
    }
    let mut out = vec_for(group.world_size, "rendezvous values")?;
    for r in 0..group.world_size {
        if r == group.rank {
            out.push(value.to_vec());
            continue;
        }
        out.push(group.store.get(key(r).as_bytes(), left(deadline))?);
    }
    Ok(out)
}

/// A barrier of the group: an all-gather of the int 0, as in PyTorch.
pub fn barrier(group: &GroupInfo, prefix: &str, timeout: Timeout) -> Result<()> {
    all_gather(group, prefix, &0i32.to_ne_bytes(), timeout).map(|_| ())
}

/// The timeout of an exchange, naming the first few missing ranks and
/// counting the others (a world of thousands must not give a message of
/// thousands of numbers).
fn missing_ranks_error(group: &GroupInfo, peers: &[usize], keys: &[String], seq: u64, timeout: Timeout) -> Error {
    let mut named = Vec::with_capacity(NAMED_MISSING);
    let mut more = 0usize;
    for (r, k) in peers.iter().zip(keys) {
        if group.store.wait(&[k.as_bytes()], Some(Duration::ZERO)).is_ok() {
            continue;
        }
        if named.len() < NAMED_MISSING {
            named.push(r.to_string());
        } else {
            more += 1;
        }
    }
    let who = match (named.is_empty(), more) {
        (true, _) => "?".to_string(),
        (false, 0) => named.join(", "),
        (false, n) => format!("{} and {n} more", named.join(", ")),
    };
    let waited = timeout.map_or("ever".to_string(), |t| format!("{} ms", t.as_millis()));
    Error::new(
        ErrorKind::Timeout,
        format!(
            "rendezvous of group {} timed out after {waited} on rank {}: rank(s) {who} never arrived \
             (exchange {seq}, store {})",
            group.name,
            group.rank,
            group.store.describe()
        ),
    )
}
