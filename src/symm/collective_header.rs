//! What a rank posts in the header of its scratch half when a CPU
//! collective starts, and the check, after the first barrier, that every
//! rank posted the same call.
//!
//! Every rank reads the same headers, so a mismatch fails every rank alike
//! (with the same message) before any rank reads a peer's data: gloo
//! aborts on a size or dtype mismatch, and copies garbage on some others;
//! here the call fails and the group stays in step for the next one.

use super::reduce::ReduceOp;
use crate::error::{Error, ErrorKind, Result};

/// Bytes of one half's header (two cache lines).
pub const HEADER_BYTES: usize = 128;
const WORDS: usize = HEADER_BYTES / 8;
/// Bytes of a dtype name kept in the header (PyTorch's longest is 16).
const DTYPE_BYTES: usize = 24;

// Word indices in a header.
const SEQ: usize = 0;
const REFUSED: usize = 1;
const CALL: std::ops::Range<usize> = 2..10;
const KIND: usize = 2;
const NUMEL: usize = 3;
const ITEMSIZE: usize = 4;
const OP: usize = 5;
const ROOT: usize = 6;
const DTYPE: usize = 7;
const IN_PLACE: usize = 10;
const PLACE: usize = 11;

/// Which collective a rank called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    Barrier = 4,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::Barrier => "barrier",
        }
    }

    /// The kind its name spells (`"all_reduce"`, ...).
    pub fn from_name(name: &str) -> Result<Kind> {
        [Kind::AllReduce, Kind::Broadcast, Kind::AllGather, Kind::Barrier].into_iter().find(|k| k.name() == name).ok_or_else(|| {
            Error::new(ErrorKind::InvalidArgument, format!("unknown collective {name:?} (all_reduce, broadcast, all_gather, barrier)"))
        })
    }

    fn from_code(code: u64) -> Option<Kind> {
        [Kind::AllReduce, Kind::Broadcast, Kind::AllGather, Kind::Barrier].into_iter().find(|&k| k as u64 == code)
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Product => 4,
    }
}

fn op_name(code: u64) -> String {
    match code {
        1 => "sum".into(),
        2 => "max".into(),
        3 => "min".into(),
        4 => "product".into(),
        other => format!("op code {other}"),
    }
}

/// What one rank passes to a collective; every rank must pass the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub kind: Kind,
    pub numel: u64,
    pub itemsize: u64,
    pub op: Option<ReduceOp>,
    pub root: Option<u64>,
    dtype: [u8; DTYPE_BYTES],
}

impl Call {
    /// A call moving `numel` elements of `dtype` (a PyTorch dtype name
    /// without `torch.`; longer names are compared on their first 24 bytes).
    pub fn new(kind: Kind, dtype: &str, numel: usize, itemsize: usize) -> Call {
        let mut d = [0u8; DTYPE_BYTES];
        let n = dtype.len().min(DTYPE_BYTES);
        d[..n].copy_from_slice(&dtype.as_bytes()[..n]);
        Call { kind, numel: numel as u64, itemsize: itemsize as u64, op: None, root: None, dtype: d }
    }

    pub fn barrier() -> Call {
        Call::new(Kind::Barrier, "", 0, 0)
    }

    pub fn with_op(self, op: ReduceOp) -> Call {
        Call { op: Some(op), ..self }
    }

    pub fn with_root(self, root: usize) -> Call {
        Call { root: Some(root as u64), ..self }
    }

    fn words(&self) -> [u64; 8] {
        let d = |i: usize| u64::from_ne_bytes(self.dtype[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        [
            self.kind as u64,
            self.numel,
            self.itemsize,
            self.op.map_or(0, op_code),
            self.root.map_or(0, |r| r.wrapping_add(1)),
            d(0),
            d(1),
            d(2),
        ]
    }
}

/// Where a rank's all_gather input lies when peers may read it in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub allocation: u64,
    pub size: u64,
    pub offset: u64,
    pub bytes: u64,
}

impl Placement {
    /// Whether a peer that posted `self` can be read in place by a rank
    /// that posted `mine`.
    pub fn readable_with(&self, mine: &Placement) -> bool {
        (self.allocation, self.size, self.bytes) == (mine.allocation, mine.size, mine.bytes)
            && self.offset.checked_add(self.bytes).is_some_and(|end| end <= self.size)
    }
}

/// One rank's header: its call number, its call, whether it refused its
/// own arguments, and where its all_gather input lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header([u64; WORDS]);

impl Header {
    /// The header of call number `seq` (a rank's count of its calls).
    pub fn new(seq: u64, call: &Call, refused: bool, place: Option<Placement>) -> Header {
        let mut w = [0u64; WORDS];
        // Plus one: a header never written (all zero) matches no call.
        w[SEQ] = seq.wrapping_add(1);
        w[REFUSED] = refused as u64;
        w[CALL].copy_from_slice(&call.words());
        if let Some(p) = place {
            w[IN_PLACE] = 1;
            w[PLACE..PLACE + 4].copy_from_slice(&[p.allocation, p.size, p.offset, p.bytes]);
        }
        Header(w)
    }

    pub fn words(&self) -> &[u64; WORDS] {
        &self.0
    }

    pub fn from_words(w: [u64; WORDS]) -> Header {
        Header(w)
    }

    pub fn place(&self) -> Option<Placement> {
        let w = &self.0;
        (w[IN_PLACE] == 1).then(|| Placement { allocation: w[PLACE], size: w[PLACE + 1], offset: w[PLACE + 2], bytes: w[PLACE + 3] })
    }

    fn kind_name(&self) -> String {
        Kind::from_code(self.0[KIND]).map_or_else(|| format!("an unknown collective (code {})", self.0[KIND]), |k| k.name().into())
    }

    fn dtype(&self) -> String {
        let bytes: Vec<u8> = self.0[DTYPE..DTYPE + 3].iter().flat_map(|w| w.to_ne_bytes()).collect();
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    }

    /// "all_reduce of 4 float32 elements (4 bytes each) with op sum".
    fn describe(&self) -> String {
        let w = &self.0;
        if w[KIND] == Kind::Barrier as u64 {
            return "barrier".into();
        }
        let mut s = format!("{} of {} {} elements ({} bytes each)", self.kind_name(), w[NUMEL], self.dtype(), w[ITEMSIZE]);
        if w[OP] != 0 {
            s += &format!(" with op {}", op_name(w[OP]));
        }
        if w[ROOT] != 0 {
            s += &format!(" from rank {}", w[ROOT] - 1);
        }
        s
    }
}

/// Checks, on rank `me`, that every rank's header (indexed by rank) posts
/// the same call as rank `me`'s. Every rank sees the same headers, so all
/// fail alike; the message names the ranks that differ and what each passed.
pub fn check_agreement(headers: &[Header], me: usize) -> Result<()> {
    let mine = &headers[me];
    let what = mine.kind_name();
    if let Some((p, h)) = headers.iter().enumerate().find(|(_, h)| h.0[SEQ] != mine.0[SEQ]) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "symm {what}: rank {p} is at another collective call (its call #{}, rank {me}'s #{}): the ranks are out of step \
                 (every rank must make the same calls in the same order); this group cannot be used again",
                h.0[SEQ].wrapping_sub(1),
                mine.0[SEQ].wrapping_sub(1)
            ),
        ));
    }
    let refused: Vec<String> =
        headers.iter().enumerate().filter(|(p, h)| *p != me && h.0[REFUSED] != 0).map(|(p, _)| p.to_string()).collect();
    if !refused.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("symm {what}: rank(s) {} refused their own arguments (see their error), so no rank ran the call", summarize(&refused)),
        ));
    }
    let first = &headers[0];
    let differ: Vec<usize> = (1..headers.len()).filter(|&p| headers[p].0[CALL] != first.0[CALL]).collect();
    let Some(&p) = differ.first() else { return Ok(()) };
    let other = &headers[p];
    let sizes_only = first.0[KIND] == other.0[KIND] && first.0[OP] == other.0[OP] && first.0[ROOT] == other.0[ROOT];
    let more = match differ.len() - 1 {
        0 => String::new(),
        n => format!("; {n} more rank(s) differ from rank 0"),
    };
    Err(Error::new(
        if sizes_only { ErrorKind::SizeMismatch } else { ErrorKind::InvalidArgument },
        format!(
            "symm {what}: the ranks passed different arguments, so no rank ran the call: rank 0 passed {} but rank {p} passed {}{more}",
            first.describe(),
            other.describe()
        ),
    ))
}

/// The first ranks of a list and how many more.
fn summarize(ranks: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = ranks[..ranks.len().min(SHOWN)].join(", ");
    if ranks.len() > SHOWN {
        s += &format!(" and {} more", ranks.len() - SHOWN);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce_call(numel: usize, dtype: &str, itemsize: usize) -> Call {
        Call::new(Kind::AllReduce, dtype, numel, itemsize).with_op(ReduceOp::Sum)
    }

    fn headers(calls: &[Call]) -> Vec<Header> {
        calls.iter().map(|c| Header::new(7, c, false, None)).collect()
    }

    #[test]
    fn equal_calls_agree() {
        let h = headers(&[reduce_call(4, "float32", 4); 3]);
        for me in 0..3 {
            check_agreement(&h, me).unwrap();
        }
    }

    #[test]
    fn a_size_mismatch_names_both_ranks_alike_on_every_rank() {
        let h = headers(&[reduce_call(4, "float32", 4), reduce_call(6, "float32", 4)]);
        let (a, b) = (check_agreement(&h, 0).unwrap_err(), check_agreement(&h, 1).unwrap_err());
        assert_eq!(a, b);
        assert_eq!(a.kind(), ErrorKind::SizeMismatch);
        assert!(
            a.message().contains(
                "rank 0 passed all_reduce of 4 float32 elements (4 bytes each) with op sum but rank 1 passed all_reduce of 6 float32"
            ),
            "{}",
            a.message()
        );
    }

    #[test]
    fn dtype_op_root_and_kind_mismatches_are_named() {
        let h = headers(&[reduce_call(4, "float32", 4), reduce_call(4, "float64", 8)]);
        assert!(check_agreement(&h, 0).unwrap_err().message().contains("rank 1 passed all_reduce of 4 float64 elements (8 bytes each)"));
        let h = headers(&[reduce_call(4, "float32", 4), reduce_call(4, "float32", 4).with_op(ReduceOp::Max)]);
        let e = check_agreement(&h, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("with op max"), "{}", e.message());
        let b = Call::new(Kind::Broadcast, "int64", 3, 8);
        let e = check_agreement(&headers(&[b.with_root(0), b.with_root(1)]), 0).unwrap_err();
        assert!(
            e.message().contains("from rank 0 but rank 1 passed broadcast of 3 int64 elements (8 bytes each) from rank 1"),
            "{}",
            e.message()
        );
        let e = check_agreement(&headers(&[Call::barrier(), reduce_call(1, "int8", 1), Call::barrier()]), 2).unwrap_err();
        assert!(e.message().contains("rank 0 passed barrier but rank 1 passed all_reduce"), "{}", e.message());
    }

    #[test]
    fn refusals_and_calls_out_of_step_fail() {
        let c = reduce_call(4, "float32", 4);
        let h = vec![Header::new(3, &c, false, None), Header::new(3, &c, true, None)];
        assert!(check_agreement(&h, 0).unwrap_err().message().contains("rank(s) 1 refused their own arguments"));
        let h = vec![Header::new(3, &c, false, None), Header::new(2, &c, false, None)];
        assert!(check_agreement(&h, 0).unwrap_err().message().contains("rank 1 is at another collective call (its call #2, rank 0's #3)"));
        let h = vec![Header::new(0, &c, false, None), Header::from_words([0; WORDS])];
        assert!(check_agreement(&h, 0).is_err(), "a header never written matches no call");
    }

    #[test]
    fn garbage_in_a_peer_header_is_named_without_a_panic() {
        let c = reduce_call(4, "float32", 4);
        let mut w = *Header::new(1, &c, false, None).words();
        w[KIND] = 99;
        w[OP] = u64::MAX;
        w[ROOT] = u64::MAX;
        w[DTYPE] = u64::MAX;
        let e = check_agreement(&[Header::new(1, &c, false, None), Header::from_words(w)], 0).unwrap_err();
        assert!(e.message().contains("an unknown collective (code 99)"), "{}", e.message());
    }

    #[test]
    fn placements_round_trip() {
        let p = Placement { allocation: 3, size: 100, offset: 8, bytes: 16 };
        let h = Header::new(0, &Call::new(Kind::AllGather, "uint8", 16, 1), false, Some(p));
        assert_eq!(h.place(), Some(p));
        assert!(p.readable_with(&p));
        assert!(!Placement { offset: 90, ..p }.readable_with(&p));
    }
}
