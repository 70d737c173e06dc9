//! The server's keys, queues and parked waits, and what each request does to
//! them. Owned by the event loop's one thread: no locks.

use crate::store::tcp::protocol::{self, Request};
use std::collections::{HashMap, VecDeque};
use std::io::Write;

/// A connection, as the event loop numbers it.
pub type ConnId = usize;

struct Waiter {
    conn: ConnId,
    until: Until,
}

/// What a parked request waits for.
enum Until {
    /// `WAIT` (and a blocking queue pop): these keys, each set or a
    /// non-empty queue.
    Present(Vec<Vec<u8>>),
    /// `BARRIER`: the counter at this key reaching `world_size`.
    Count { key: Vec<u8>, world_size: i64 },
}

/// A request the connection must be closed for (as PyTorch's servers do):
/// a `GET` of a missing key, an `ADD` to a value that is not a number, a
/// second `VALIDATE`.
#[derive(Debug)]
pub struct Refused;

#[derive(Default)]
pub struct State {
    data: HashMap<Vec<u8>, Vec<u8>>,
    /// Queues live beside the keys: not counted or listed as keys, but a
    /// non-empty one satisfies `CHECK` and `WAIT` on its name.
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiters: Vec<Waiter>,
}

impl State {
    /// A key is present when it is set or names a non-empty queue.
    fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn counter(&self, key: &[u8]) -> Option<i64> {
        self.data.get(key).and_then(|v| parse_counter(v))
    }

    /// Forgets the parked requests of a closed connection.
    pub fn drop_conn(&mut self, conn: ConnId) {
        if !self.waiters.is_empty() {
            self.waiters.retain(|w| w.conn != conn);
        }
    }

    /// `key` was set (or its queue filled): every waiter now complete is
    /// removed and its connection pushed to `woken` (owed `u8 0`).
    fn wake(&mut self, woken: &mut Vec<ConnId>, key: &[u8]) {
        // Parsed only if a barrier waits on this key (not on every set).
        let mut count: Option<Option<i64>> = None;
        let mut i = 0;
        while i < self.waiters.len() {
            let done = match &mut self.waiters[i].until {
                Until::Present(missing) => {
                    missing.retain(|k| k != key);
                    missing.is_empty()
                }
                Until::Count { key: k, world_size } => {
                    let world_size = *world_size;
                    k == key && count.get_or_insert_with(|| self.counter(key)).is_some_and(|c| c >= world_size)
                }
            };
            if done {
                woken.push(self.waiters.swap_remove(i).conn);
            } else {
                i += 1;
            }
        }
    }

    fn set_key(&mut self, woken: &mut Vec<ConnId>, key: Vec<u8>, value: Vec<u8>) {
        if self.waiters.is_empty() {
            self.data.insert(key, value);
            return;
        }
        let k = key.clone();
        self.data.insert(key, value);
        self.wake(woken, &k);
    }

    /// Adds `delta` to the counter at `key` (a missing key counts as 0);
    /// `None` when the value there is not a number.
    fn add_to_counter(&mut self, woken: &mut Vec<ConnId>, key: Vec<u8>, delta: i64) -> Option<i64> {
        let new = match self.data.get_mut(&key) {
            None => {
                self.set_key(woken, key, delta.to_string().into_bytes());
                return Some(delta);
            }
            Some(v) => {
                let new = parse_counter(v)?.wrapping_add(delta);
                // Rewritten in place: no allocation for a counter.
                v.clear();
                let _ = write!(v, "{new}");
                new
            }
        };
        if !self.waiters.is_empty() {
            self.wake(woken, &key);
        }
        Some(new)
    }

    /// Applies one request from `conn`: its reply is appended to `reply`,
    /// and the connections of waits it completed to `woken`.
    pub fn apply(&mut self, req: Request, conn: ConnId, reply: &mut Vec<u8>, woken: &mut Vec<ConnId>) -> Result<(), Refused> {
        match req {
            Request::Validate(_) => return Err(Refused),
            Request::Ping(n) => reply.extend_from_slice(&n.to_le_bytes()),
            Request::Set { key, value } => self.set_key(woken, key, value),
            Request::CompareSet { key, expected, desired } => match self.data.get(&key) {
                None if expected.is_empty() => {
                    protocol::encode_bytes_reply(reply, &desired);
                    self.set_key(woken, key, desired);
                }
                None => protocol::encode_bytes_reply(reply, &expected),
                Some(cur) if *cur == expected => {
                    protocol::encode_bytes_reply(reply, &desired);
                    self.set_key(woken, key, desired);
                }
                Some(cur) => protocol::encode_bytes_reply(reply, cur),
            },
            // A missing key: PyTorch's libuv server answers an empty value,
            // its classic one closes the connection; clients WAIT first.
            Request::Get(key) => protocol::encode_bytes_reply(reply, self.data.get(&key).ok_or(Refused)?),
            Request::Add { key, delta } => {
                let new = self.add_to_counter(woken, key, delta).ok_or(Refused)?;
                reply.extend_from_slice(&new.to_le_bytes());
            }
            Request::Check(keys) => {
                let ready = keys.iter().all(|k| self.present(k));
                reply.push(if ready { protocol::CHECK_READY } else { protocol::CHECK_NOT_READY });
            }
            Request::Wait(keys) => {
                if keys.iter().all(|k| self.present(k)) {
                    reply.push(protocol::WAIT_STOP_WAITING);
                } else {
                    let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.present(k)).collect();
                    self.waiters.push(Waiter { conn, until: Until::Present(missing) });
                }
            }
            Request::CancelWait => {
                self.drop_conn(conn);
                reply.push(protocol::WAIT_CANCELED);
            }
            Request::GetNumKeys => reply.extend_from_slice(&(self.data.len() as i64).to_le_bytes()),
            Request::DeleteKey(key) => {
                let n: i64 = self.data.remove(&key).is_some().into();
                reply.extend_from_slice(&n.to_le_bytes());
            }
            Request::Append { key, value } => {
                let mut cur = self.data.remove(&key).unwrap_or_default();
                cur.extend_from_slice(&value);
                self.set_key(woken, key, cur);
            }
            Request::MultiGet(keys) => {
                for k in &keys {
                    protocol::encode_bytes_reply(reply, self.data.get(k).ok_or(Refused)?);
                }
            }
            Request::MultiSet(pairs) => {
                for (k, v) in pairs {
                    self.set_key(woken, k, v);
                }
            }
            Request::QueuePush { key, value } => {
                self.queues.entry(key.clone()).or_default().push_back(value);
                self.wake(woken, &key);
            }
            // PyTorch's client WAITs on the queue's name before a blocking pop.
            Request::QueuePop(key) => {
                let queue = self.queues.get_mut(&key);
                let len = queue.as_ref().map_or(0, |q| q.len());
                reply.extend_from_slice(&(len as u64).to_le_bytes());
                if let Some(value) = queue.and_then(|q| q.pop_front()) {
                    protocol::encode_bytes_reply(reply, &value);
                }
                if self.queues.get(&key).is_some_and(|q| q.is_empty()) {
                    self.queues.remove(&key);
                }
            }
            Request::QueueLen(key) => {
                let len = self.queues.get(&key).map_or(0, |q| q.len()) as i64;
                reply.extend_from_slice(&len.to_le_bytes());
            }
            // Sorted, so the answer does not depend on the map's order.
            Request::ListKeys => {
                let mut keys: Vec<&Vec<u8>> = self.data.keys().collect();
                keys.sort();
                reply.extend_from_slice(&(keys.len() as u64).to_le_bytes());
                for k in keys {
                    protocol::encode_bytes_reply(reply, k);
                }
            }
            Request::Barrier { key, world_size } => {
                let count = self.add_to_counter(woken, key.clone(), 1).ok_or(Refused)?;
                if count >= world_size {
                    reply.push(protocol::WAIT_STOP_WAITING);
                } else {
                    self.waiters.push(Waiter { conn, until: Until::Count { key, world_size } });
                }
            }
        }
        Ok(())
    }
}

/// [`protocol::parse_counter`], with a fast path for the plain decimal
/// text that `ADD` itself stores.
fn parse_counter(bytes: &[u8]) -> Option<i64> {
    let digits = bytes.strip_prefix(b"-").unwrap_or(bytes);
    if !digits.is_empty() && digits.len() <= 18 && digits.iter().all(u8::is_ascii_digit) {
        let n = digits.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
        return Some(if digits.len() < bytes.len() { -n } else { n });
    }
    protocol::parse_counter(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn counter_fast_path_agrees_with_stoll() {
        for text in [
            "0",
            "-0",
            "12",
            "-7",
            "999999999999999999",
            "-999999999999999999",
            "9223372036854775807",
            "-9223372036854775808",
            "12x",
            " 7",
            "+3",
            "-",
            "",
            "x",
        ] {
            assert_eq!(super::parse_counter(text.as_bytes()), crate::store::tcp::protocol::parse_counter(text.as_bytes()), "{text:?}");
        }
    }
}
