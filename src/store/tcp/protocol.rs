//! The wire format of PyTorch's c10d `TCPStore` (see
//! docs/tcpstore-protocol.md for every fact and how it was checked):
//! requests and replies as bytes, with no I/O, so the parser can be fuzzed.
//!
//! A request is one query-type byte followed by its fields; integers are
//! little-endian, a string or byte field is a `u64` length then the bytes,
//! a key list is a `u64` count then that many strings.

use crate::error::{Error, ErrorKind, Result};

/// The number a client sends with `VALIDATE` right after connecting.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// What PyTorch's client puts before every user key.
pub const KEY_PREFIX: &str = "/";
/// The counter every rank adds 1 to when it joins (no key prefix).
pub const INIT_KEY: &str = "init/";
/// Longest field of a reply our client accepts (a bound, so a bad length
/// cannot make it wait for or allocate terabytes; PyTorch's classic server
/// sends values of any length).
pub const MAX_FIELD: u64 = 1 << 31;
/// Longest key in a request (8 KiB, PyTorch's libuv server's limit): a
/// longer one makes our server close the connection, as PyTorch's does.
pub const MAX_KEY_LEN: u64 = 8 << 10;
/// Longest value in a request (8 MiB, PyTorch's libuv server's limit):
/// `SET`, `APPEND`, `QUEUE_PUSH`, both values of `COMPARE_SET`, and each
/// value of `MULTI_SET`.
pub const MAX_VALUE_LEN: u64 = 8 << 20;
/// Most keys (or key-value pairs) in one request (128 Ki, PyTorch's libuv
/// server's limit).
pub const MAX_KEYS: u64 = 128 << 10;

/// `CHECK` replies.
pub const CHECK_READY: u8 = 0;
pub const CHECK_NOT_READY: u8 = 1;
/// `WAIT` / `CANCEL_WAIT` replies.
pub const WAIT_STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// The query-type byte of each request.
pub mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// One request, keys as raw bytes (prefix included, as on the wire).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Validate(u32),
    Set {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    CompareSet {
        key: Vec<u8>,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Get(Vec<u8>),
    Add {
        key: Vec<u8>,
        delta: i64,
    },
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    GetNumKeys,
    DeleteKey(Vec<u8>),
    Append {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    /// Appends `value` to the queue `key` (no reply).
    QueuePush {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// Takes the oldest value of queue `key`: replies the queue's length
    /// before the pop (`u64`), then the value when that length is not 0.
    QueuePop(Vec<u8>),
    /// Replies the queue's length (`i64`; 0 for a missing queue).
    QueueLen(Vec<u8>),
    /// Replies every key (not the queues): a `u64` count, then the keys.
    ListKeys,
    /// Adds 1 to the counter `key`; replies `u8 0` once it reaches
    /// `world_size` (at once if it already has).
    Barrier {
        key: Vec<u8>,
        world_size: i64,
    },
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u64(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_keys(out: &mut Vec<u8>, keys: &[Vec<u8>]) {
    put_u64(out, keys.len() as u64);
    for k in keys {
        put_bytes(out, k);
    }
}

impl Request {
    /// Appends the request's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        use query::*;
        match self {
            Request::Validate(m) => {
                out.push(VALIDATE);
                out.extend_from_slice(&m.to_le_bytes());
            }
            Request::Set { key, value } => {
                out.push(SET);
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                out.push(COMPARE_SET);
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get(key) => {
                out.push(GET);
                put_bytes(out, key);
            }
            Request::Add { key, delta } => {
                out.push(ADD);
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check(keys) => {
                out.push(CHECK);
                put_keys(out, keys);
            }
            Request::Wait(keys) => {
                out.push(WAIT);
                put_keys(out, keys);
            }
            Request::GetNumKeys => out.push(GETNUMKEYS),
            Request::DeleteKey(key) => {
                out.push(DELETE_KEY);
                put_bytes(out, key);
            }
            Request::Append { key, value } => {
                out.push(APPEND);
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::MultiGet(keys) => {
                out.push(MULTI_GET);
                put_keys(out, keys);
            }
            Request::MultiSet(pairs) => {
                out.push(MULTI_SET);
                put_u64(out, pairs.len() as u64);
                for (k, v) in pairs {
                    put_bytes(out, k);
                    put_bytes(out, v);
                }
            }
            Request::CancelWait => out.push(CANCEL_WAIT),
            Request::Ping(n) => {
                out.push(PING);
                out.extend_from_slice(&n.to_le_bytes());
            }
            Request::QueuePush { key, value } => {
                out.push(QUEUE_PUSH);
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::QueuePop(key) => {
                out.push(QUEUE_POP);
                put_bytes(out, key);
            }
            Request::QueueLen(key) => {
                out.push(QUEUE_LEN);
                put_bytes(out, key);
            }
            Request::ListKeys => out.push(LIST_KEYS),
            Request::Barrier { key, world_size } => {
                out.push(BARRIER);
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
        }
    }

    /// The request's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// What a length-prefixed field of a request holds, for its limit.
#[derive(Clone, Copy, Debug)]
enum Field {
    Key,
    Value,
}

impl Field {
    fn limit(self) -> u64 {
        match self {
            Field::Key => MAX_KEY_LEN,
            Field::Value => MAX_VALUE_LEN,
        }
    }

    /// A `Protocol` error for a length over the field's limit.
    fn check(self, len: u64, what: &str) -> Result<()> {
        let limit = self.limit();
        if len > limit {
            return Err(bad(format!("{what} length {len} is over the limit of {limit} bytes")));
        }
        Ok(())
    }
}

const NO_FIELDS: &[Field] = &[];
const KEY: &[Field] = &[Field::Key];
const KEY_VALUE: &[Field] = &[Field::Key, Field::Value];
const KEY_TWO_VALUES: &[Field] = &[Field::Key, Field::Value, Field::Value];

/// Reads fields from a buffer that may end early: `Ok(None)` means "wait
/// for more bytes", an error means the bytes can never become a request.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Protocol, what.to_string())
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.buf.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }

    fn bytes(&mut self, field: Field, what: &str) -> Result<Option<Vec<u8>>> {
        let Some(len) = self.u64() else { return Ok(None) };
        field.check(len, what)?;
        Ok(self.take(len as usize).map(<[u8]>::to_vec))
    }

    fn key(&mut self, what: &str) -> Result<Option<Vec<u8>>> {
        self.bytes(Field::Key, what)
    }

    fn value(&mut self, what: &str) -> Result<Option<Vec<u8>>> {
        self.bytes(Field::Value, what)
    }

    fn count(&mut self, what: &str) -> Result<Option<u64>> {
        let Some(n) = self.u64() else { return Ok(None) };
        if n > MAX_KEYS {
            return Err(bad(format!("{what} count {n} is over the limit of {MAX_KEYS}")));
        }
        Ok(Some(n))
    }

    fn keys(&mut self) -> Result<Option<Vec<Vec<u8>>>> {
        let Some(n) = self.count("key")? else { return Ok(None) };
        let mut keys = Vec::new();
        for _ in 0..n {
            let Some(k) = self.key("key")? else { return Ok(None) };
            keys.push(k);
        }
        Ok(Some(keys))
    }
}

/// Parses the request at the start of `buf`: `Ok(Some((request, bytes
/// used)))`, `Ok(None)` when `buf` holds only part of one, or a
/// `Protocol` error for an unknown query type or an over-long field.
pub fn parse_request(buf: &[u8]) -> Result<Option<(Request, usize)>> {
    let mut c = Cursor { buf, at: 0 };
    let req = match parse_fields(&mut c)? {
        Some(r) => r,
        None => return Ok(None),
    };
    Ok(Some((req, c.at)))
}

fn parse_fields(c: &mut Cursor<'_>) -> Result<Option<Request>> {
    use query::*;
    macro_rules! get {
        ($e:expr) => {
            match $e {
                Some(v) => v,
                None => return Ok(None),
            }
        };
    }
    let Some(kind) = c.u8() else { return Ok(None) };
    let req = match kind {
        VALIDATE => Request::Validate(get!(c.u32())),
        SET => Request::Set { key: get!(c.key("key")?), value: get!(c.value("value")?) },
        COMPARE_SET => Request::CompareSet {
            key: get!(c.key("key")?),
            expected: get!(c.value("expected value")?),
            desired: get!(c.value("desired value")?),
        },
        GET => Request::Get(get!(c.key("key")?)),
        ADD => {
            let key = get!(c.key("key")?);
            Request::Add { key, delta: get!(c.u64()) as i64 }
        }
        CHECK => Request::Check(get!(c.keys()?)),
        WAIT => Request::Wait(get!(c.keys()?)),
        GETNUMKEYS => Request::GetNumKeys,
        DELETE_KEY => Request::DeleteKey(get!(c.key("key")?)),
        APPEND => Request::Append { key: get!(c.key("key")?), value: get!(c.value("value")?) },
        MULTI_GET => Request::MultiGet(get!(c.keys()?)),
        MULTI_SET => {
            let n = get!(c.count("key-value pair")?);
            let mut pairs = Vec::new();
            for _ in 0..n {
                let k = get!(c.key("key")?);
                pairs.push((k, get!(c.value("value")?)));
            }
            Request::MultiSet(pairs)
        }
        CANCEL_WAIT => Request::CancelWait,
        PING => Request::Ping(get!(c.u32())),
        QUEUE_PUSH => Request::QueuePush { key: get!(c.key("queue key")?), value: get!(c.value("value")?) },
        QUEUE_POP => Request::QueuePop(get!(c.key("queue key")?)),
        QUEUE_LEN => Request::QueueLen(get!(c.key("queue key")?)),
        LIST_KEYS => Request::ListKeys,
        BARRIER => {
            let key = get!(c.key("barrier key")?);
            Request::Barrier { key, world_size: get!(c.u64()) as i64 }
        }
        other => return Err(bad(format!("unknown or unsupported query type {other}"))),
    };
    Ok(Some(req))
}

/// Finds where the request at the start of a growing buffer ends, without
/// building it and without reading any byte twice: the server calls
/// [`RequestScanner::scan`] after every read, then [`parse_request`] once
/// on the whole request. (Re-parsing from the start after every read
/// would let a client that sends a big key list a few bytes at a time
/// make the server do work quadratic in the list's length.)
#[derive(Clone, Debug, Default)]
pub struct RequestScanner {
    /// Bytes of the request already checked.
    at: usize,
    phase: Phase,
}

#[derive(Clone, Copy, Debug, Default)]
enum Phase {
    /// Nothing read yet.
    #[default]
    Start,
    /// A count comes next; each counted item is the fields `item`.
    Count { item: &'static [Field], what: &'static str },
    /// `total` length-prefixed fields (their kinds `kinds`, repeated), of
    /// which `done` are checked, then `tail` fixed bytes.
    Fields { kinds: &'static [Field], done: u64, total: u64, tail: usize },
}

impl Phase {
    fn fields(kinds: &'static [Field], tail: usize) -> Phase {
        Phase::Fields { kinds, done: 0, total: kinds.len() as u64, tail }
    }
}

impl RequestScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// `Ok(Some(n))`: the first `n` bytes of `buf` are one whole request
    /// (the scanner is then reset for the next one); `Ok(None)`: more bytes
    /// are needed; an error: the bytes can never be a request (the same
    /// cases as [`parse_request`]: an unknown type, a count or a length over
    /// its limit, found as soon as the count or length has arrived). `buf`
    /// must start with the same bytes on every call until a request is
    /// complete (it may only grow).
    pub fn scan(&mut self, buf: &[u8]) -> Result<Option<usize>> {
        use query::*;
        loop {
            match self.phase {
                Phase::Start => {
                    let Some(&kind) = buf.first() else { return Ok(None) };
                    self.at = 1;
                    self.phase = match kind {
                        VALIDATE | PING => Phase::fields(NO_FIELDS, 4),
                        GETNUMKEYS | CANCEL_WAIT | LIST_KEYS => Phase::fields(NO_FIELDS, 0),
                        GET | DELETE_KEY | QUEUE_POP | QUEUE_LEN => Phase::fields(KEY, 0),
                        SET | APPEND | QUEUE_PUSH => Phase::fields(KEY_VALUE, 0),
                        COMPARE_SET => Phase::fields(KEY_TWO_VALUES, 0),
                        ADD | BARRIER => Phase::fields(KEY, 8),
                        CHECK | WAIT | MULTI_GET => Phase::Count { item: KEY, what: "key" },
                        MULTI_SET => Phase::Count { item: KEY_VALUE, what: "key-value pair" },
                        other => {
                            self.phase = Phase::Start;
                            return Err(bad(format!("unknown or unsupported query type {other}")));
                        }
                    };
                }
                Phase::Count { item, what } => {
                    let Some(n) = read_u64(buf, self.at) else { return Ok(None) };
                    if n > MAX_KEYS {
                        self.phase = Phase::Start;
                        return Err(bad(format!("{what} count {n} is over the limit of {MAX_KEYS}")));
                    }
                    self.at += 8;
                    self.phase = Phase::Fields { kinds: item, done: 0, total: n * item.len() as u64, tail: 0 };
                }
                Phase::Fields { done, total, tail, .. } if done == total => {
                    let end = self.at + tail;
                    if buf.len() < end {
                        return Ok(None);
                    }
                    *self = Self::default();
                    return Ok(Some(end));
                }
                Phase::Fields { kinds, done, total, tail } => {
                    let Some(len) = read_u64(buf, self.at) else { return Ok(None) };
                    let field = kinds[(done % kinds.len() as u64) as usize];
                    if let Err(e) = field.check(len, if matches!(field, Field::Key) { "key" } else { "value" }) {
                        self.phase = Phase::Start;
                        return Err(e);
                    }
                    let end = self.at + 8 + len as usize;
                    if buf.len() < end {
                        return Ok(None);
                    }
                    self.at = end;
                    self.phase = Phase::Fields { kinds, done: done + 1, total, tail };
                }
            }
        }
    }
}

fn read_u64(buf: &[u8], at: usize) -> Option<u64> {
    buf.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
}

/// A reply holding bytes: `u64` length then the bytes.
pub fn encode_bytes_reply(out: &mut Vec<u8>, b: &[u8]) {
    put_bytes(out, b);
}

/// The value an `ADD` stores, parsed as C++ `std::stoll` does (leading
/// spaces, a sign, then digits; anything after them ignored). `None` when
/// there are no digits or the number does not fit.
pub fn parse_counter(bytes: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(bytes).ok()?;
    let t = text.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (sign, rest) = match t.as_bytes().first() {
        Some(b'-') => ("-", &t[1..]),
        Some(b'+') => ("", &t[1..]),
        _ => ("", t),
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    format!("{sign}{}", &rest[..digits]).parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_match_a_captured_pytorch_exchange() {
        // Captured from torch 2.15's client (docs/tcpstore-protocol.md).
        let set = Request::Set { key: b"/k".to_vec(), value: b"v".to_vec() };
        assert_eq!(set.to_bytes(), b"\x01\x02\0\0\0\0\0\0\0/k\x01\0\0\0\0\0\0\0v");
        let wait = Request::Wait(vec![b"/k".to_vec()]);
        assert_eq!(wait.to_bytes(), b"\x06\x01\0\0\0\0\0\0\0\x02\0\0\0\0\0\0\0/k");
        let add = Request::Add { key: b"/n".to_vec(), delta: -2 };
        assert_eq!(add.to_bytes(), b"\x04\x02\0\0\0\0\0\0\0/n\xfe\xff\xff\xff\xff\xff\xff\xff");
        let hello = [Request::Validate(VALIDATION_MAGIC).to_bytes(), Request::Ping(0x2e22).to_bytes()].concat();
        assert_eq!(hello, b"\x00\xce\xf7\x85\x3c\x0d\x22\x2e\x00\x00");
    }

    #[test]
    fn partial_input_waits_and_bad_input_fails() {
        let bytes = Request::MultiSet(vec![(b"/a".to_vec(), b"1".to_vec()), (b"/b".to_vec(), vec![])]).to_bytes();
        for cut in 0..bytes.len() {
            assert_eq!(parse_request(&bytes[..cut]).unwrap(), None, "cut at {cut}");
        }
        let (req, used) = parse_request(&bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len());
        assert!(matches!(req, Request::MultiSet(p) if p.len() == 2));
        assert_eq!(parse_request(&[0x7f]).unwrap_err().kind(), ErrorKind::Protocol);
        let mut huge = vec![query::GET];
        huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = parse_request(&huge).unwrap_err();
        assert!(e.message().contains("over the limit"), "{}", e.message());
    }

    #[test]
    fn counters_parse_like_stoll() {
        assert_eq!(parse_counter(b"12"), Some(12));
        assert_eq!(parse_counter(b" -7"), Some(-7));
        assert_eq!(parse_counter(b"12x"), Some(12));
        assert_eq!(parse_counter(b"+3"), Some(3));
        assert_eq!(parse_counter(b"x"), None);
        assert_eq!(parse_counter(b""), None);
        assert_eq!(parse_counter(b"99999999999999999999"), None);
    }
}
