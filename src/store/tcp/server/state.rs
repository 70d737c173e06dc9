//! The server's keys, queues and parked waits, and what each request does to
//! them. Owned by the event loop's one thread: no locks.

use crate::store::tcp::protocol::{self, Request};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::sync::Arc;

/// A connection, as the event loop numbers it.
pub type ConnId = usize;

/// A parked request, numbered in the order it was parked.
type WaiterId = u64;

/// A key as the waiter index holds it: one allocation shared by the index
/// and every waiter of the key.
type SharedKey = Arc<[u8]>;

struct Waiter {
    conn: ConnId,
    until: Until,
}

/// What a parked request waits for.
enum Until {
    /// `WAIT` (and a blocking queue pop): `missing` of these distinct keys
    /// are still unset (no non-empty queue either).
    Present { keys: Vec<SharedKey>, missing: usize },
    /// `BARRIER`: the counter at this key reaching `world_size`.
    Count { key: SharedKey, world_size: i64 },
}

impl Until {
    fn keys(&self) -> &[SharedKey] {
        match self {
            Until::Present { keys, .. } => keys,
            Until::Count { key, .. } => std::slice::from_ref(key),
        }
    }
}

/// A request the connection must be closed for (as PyTorch's servers do):
/// a `GET` of a missing key, an `ADD` to a value that is not a number, a
/// second `VALIDATE`.
#[derive(Debug)]
pub struct Refused;

/// The waiters of one key, in the order they were parked. A waiter that
/// went away (cancelled, its connection closed) may stay listed when many
/// wait on the key: it is skipped, and the list is compacted once such
/// entries are half of it, so dropping N waiters of one key costs O(N).
#[derive(Default)]
struct KeyWaiters {
    ids: Vec<WaiterId>,
    gone: usize,
}

/// Up to this many waiters of a key, one that goes away is unlisted at once.
const UNLIST_NOW: usize = 8;

/// Parked requests, indexed by the keys they wait on and by connection, so
/// a `SET` or `ADD` touches only the waiters of its own key (never a scan
/// of every parked key), and a closed connection only its own.
#[derive(Default)]
struct Waiters {
    by_id: HashMap<WaiterId, Waiter>,
    by_key: HashMap<SharedKey, KeyWaiters>,
    by_conn: HashMap<ConnId, HashSet<WaiterId>>,
    next: WaiterId,
}

impl Waiters {
    /// The index's copy of `key` (made on first use).
    fn shared(&mut self, key: &[u8]) -> SharedKey {
        match self.by_key.get_key_value(key) {
            Some((k, _)) => k.clone(),
            None => {
                let k: SharedKey = key.into();
                self.by_key.insert(k.clone(), KeyWaiters::default());
                k
            }
        }
    }

    /// Parks a request on `keys` (distinct; for a barrier, its one key).
    fn park(&mut self, conn: ConnId, keys: Vec<Vec<u8>>, barrier: Option<i64>) {
        let id = self.next;
        self.next += 1;
        let mut shared = Vec::with_capacity(keys.len());
        for k in keys {
            let k = self.shared(&k);
            self.by_key.get_mut(&k).expect("made by shared").ids.push(id);
            shared.push(k);
        }
        let until = match barrier {
            Some(world_size) => Until::Count { key: shared.pop().expect("a barrier waits on its key"), world_size },
            None => {
                let missing = shared.len();
                Until::Present { keys: shared, missing }
            }
        };
        self.by_conn.entry(conn).or_default().insert(id);
        self.by_id.insert(id, Waiter { conn, until });
    }

    /// Removes a waiter (unlisting it from its keys); its connection.
    fn remove(&mut self, id: WaiterId) -> Option<ConnId> {
        let w = self.by_id.remove(&id)?;
        for k in w.until.keys() {
            let Some(list) = self.by_key.get_mut(k) else { continue };
            if list.ids.len() <= UNLIST_NOW {
                list.ids.retain(|&i| i != id);
            } else {
                list.gone += 1;
                if list.gone * 2 >= list.ids.len() {
                    let by_id = &self.by_id;
                    list.ids.retain(|i| by_id.contains_key(i));
                    list.gone = 0;
                }
            }
            if list.ids.is_empty() {
                self.by_key.remove(k);
            }
        }
        if let Some(ids) = self.by_conn.get_mut(&w.conn) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_conn.remove(&w.conn);
            }
        }
        Some(w.conn)
    }

    /// Forgets every request `conn` parked.
    fn drop_conn(&mut self, conn: ConnId) {
        let Some(ids) = self.by_conn.remove(&conn) else { return };
        for id in ids {
            self.remove(id);
        }
    }
}

#[derive(Default)]
pub struct State {
    data: HashMap<Vec<u8>, Vec<u8>>,
    /// Queues live beside the keys: not counted or listed as keys, but a
    /// non-empty one satisfies `CHECK` and `WAIT` on its name.
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiters: Waiters,
    /// Waiters looked at by `wake` (what the index saves, for tests).
    #[cfg(test)]
    examined: usize,
}

impl State {
    /// A key is present when it is set or names a non-empty queue.
    fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Entries of the waiter tables: waiters, keys and connections indexed.
    #[cfg(test)]
    fn parked(&self) -> usize {
        self.waiters.by_id.len() + self.waiters.by_key.len() + self.waiters.by_conn.len()
    }

    /// Forgets the parked requests of a closed connection.
    pub fn drop_conn(&mut self, conn: ConnId) {
        self.waiters.drop_conn(conn);
    }

    /// `key` was set (or its queue filled): every waiter of that key now
    /// complete is removed and its connection pushed to `woken` (owed
    /// `u8 0`), in the order they were parked. Costs one lookup when
    /// nobody waits on `key`, however many other keys are waited on.
    fn wake(&mut self, woken: &mut Vec<ConnId>, key: &[u8]) {
        let Some((shared, list)) = self.waiters.by_key.remove_entry(key) else { return };
        #[cfg(test)]
        {
            self.examined += list.ids.len();
        }
        // Parsed only if a barrier waits on this key.
        let mut count: Option<Option<i64>> = None;
        let mut still = Vec::new();
        for id in list.ids {
            let Some(w) = self.waiters.by_id.get_mut(&id) else { continue };
            let complete = match &mut w.until {
                Until::Present { missing, .. } => {
                    *missing -= 1;
                    *missing == 0
                }
                Until::Count { world_size, .. } => {
                    let world_size = *world_size;
                    let reached =
                        count.get_or_insert_with(|| self.data.get(key).and_then(|v| parse_counter(v))).is_some_and(|c| c >= world_size);
                    if !reached {
                        // A barrier short of its count still waits on the key.
                        still.push(id);
                    }
                    reached
                }
            };
            if complete {
                if let Some(conn) = self.waiters.remove(id) {
                    woken.push(conn);
                }
            }
        }
        if !still.is_empty() {
            self.waiters.by_key.insert(shared, KeyWaiters { ids: still, gone: 0 });
        }
    }

    fn set_key(&mut self, woken: &mut Vec<ConnId>, key: Vec<u8>, value: Vec<u8>) {
        if !self.waiters.by_key.contains_key(key.as_slice()) {
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
        self.wake(woken, &key);
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
                    let mut keys: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.present(k)).collect();
                    // Each key counts once: `WAIT [k, k]` ends when k is set.
                    keys.sort_unstable();
                    keys.dedup();
                    self.waiters.park(conn, keys, None);
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
                    self.waiters.park(conn, vec![key], Some(world_size));
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
    use super::*;

    fn apply(state: &mut State, conn: ConnId, req: Request) -> (Vec<u8>, Vec<ConnId>) {
        let (mut reply, mut woken) = (Vec::new(), Vec::new());
        state.apply(req, conn, &mut reply, &mut woken).unwrap();
        (reply, woken)
    }

    fn set(k: &str) -> Request {
        Request::Set { key: k.into(), value: b"v".to_vec() }
    }

    /// Guards against a client that parks many WAIT keys slowing everyone
    /// down: a write looks only at the waiters of its own key (not at every
    /// parked waiter), and wakes exactly those that are complete.
    #[test]
    fn a_write_looks_only_at_the_waiters_of_its_key() {
        let mut st = State::default();
        let parked: Vec<Vec<u8>> = (0..10_000).map(|i| format!("/park/{i}").into_bytes()).collect();
        assert_eq!(apply(&mut st, 1, Request::Wait(parked.clone())), (vec![], vec![]));
        apply(&mut st, 2, Request::Wait(vec![b"x".to_vec()]));
        apply(&mut st, 3, Request::Wait(vec![b"y".to_vec(), b"z".to_vec(), b"y".to_vec()]));
        assert_eq!(apply(&mut st, 4, Request::Barrier { key: b"b".to_vec(), world_size: 3 }), (vec![], vec![]));
        assert_eq!(st.examined, 0);

        assert_eq!(apply(&mut st, 9, set("unwaited")).1, Vec::<ConnId>::new());
        assert_eq!(st.examined, 0, "a key nobody waits on looks at no waiter");
        assert_eq!(apply(&mut st, 9, Request::Add { key: b"x".to_vec(), delta: 1 }).1, vec![2]);
        assert_eq!(st.examined, 1);
        assert_eq!(apply(&mut st, 9, set("y")).1, Vec::<ConnId>::new(), "z is still missing");
        assert_eq!(apply(&mut st, 9, set("y")).1, Vec::<ConnId>::new());
        assert_eq!(apply(&mut st, 9, set("z")).1, vec![3]);
        assert_eq!(apply(&mut st, 9, Request::Add { key: b"b".to_vec(), delta: 1 }).1, Vec::<ConnId>::new(), "2 of 3");
        assert_eq!(apply(&mut st, 9, Request::Add { key: b"b".to_vec(), delta: 1 }).1, vec![4]);
        assert_eq!(st.examined, 5);

        // The big waiter completes with its last key, and only then.
        for k in &parked[..parked.len() - 1] {
            assert_eq!(apply(&mut st, 9, Request::Set { key: k.clone(), value: vec![] }).1, Vec::<ConnId>::new());
        }
        assert_eq!(apply(&mut st, 9, Request::Set { key: parked[parked.len() - 1].clone(), value: vec![] }).1, vec![1]);
        assert_eq!(st.examined, 5 + parked.len());
        assert_eq!(st.parked(), 0, "nothing left parked or indexed");
    }

    #[test]
    fn cancelled_and_closed_waiters_leave_no_trace() {
        let mut st = State::default();
        apply(&mut st, 1, Request::Wait(vec![b"a".to_vec(), b"b".to_vec()]));
        // Many waiters of one key from one connection (pipelined), then it
        // closes: unlisted in one pass, not one scan per waiter.
        for _ in 0..1000 {
            apply(&mut st, 2, Request::Wait(vec![b"k".to_vec()]));
        }
        apply(&mut st, 3, Request::Wait(vec![b"k".to_vec()]));
        assert_eq!(apply(&mut st, 1, Request::CancelWait).0, vec![protocol::WAIT_CANCELED]);
        st.drop_conn(2);
        assert_eq!(apply(&mut st, 9, set("a")).1, Vec::<ConnId>::new());
        assert_eq!(apply(&mut st, 9, set("k")).1, vec![3], "only the waiter still there");
        assert_eq!(st.parked(), 0, "nothing left parked or indexed");
    }

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
