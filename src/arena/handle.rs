//! What a receiver needs to open a shared block: which segment (producer
//! pid + start time + segment id, and its name when shared by name), where
//! the block is in it, and which hold slot carries the share.

use super::segment::SegmentKey;
use crate::error::{Error, ErrorKind, Result};

/// How segments travel to other processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Strategy {
    /// Anonymous memfd segments, sent once per peer by SCM_RIGHTS.
    Fd = 1,
    /// Named POSIX shm objects (`/dev/shm/ss_arena_*`), opened by name.
    Name = 2,
}

impl Strategy {
    pub fn from_u32(v: u32) -> Result<Strategy> {
        match v {
            1 => Ok(Strategy::Fd),
            2 => Ok(Strategy::Name),
            v => Err(Error::new(ErrorKind::InvalidArgument, format!("unknown arena strategy {v} (1 = by fd, 2 = by name)"))),
        }
    }
}

/// Longest segment name a handle carries, without the NUL.
pub const MAX_NAME_LEN: usize = 47;

/// A shared block. Each handle carries one hold: it opens once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaHandle {
    pub strategy: Strategy,
    pub key: SegmentKey,
    /// Bytes of data in the segment (the trailer follows them).
    pub segment_data_size: u64,
    pub offset: u64,
    pub size: u64,
    pub slot: u32,
    pub generation: u32,
    /// The segment's name (by name), empty by fd.
    pub name: String,
}

/// Bytes of a handle on the wire ([`ArenaHandle::encode`]).
pub const WIRE_SIZE: usize = 4 + 4 + 4 + 4 + 8 + 8 + 8 + 8 + 8 + 4 + 4 + (MAX_NAME_LEN + 1);
const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"SSAH");

impl ArenaHandle {
    /// A fixed-size little-endian encoding (for sockets and files).
    pub fn encode(&self) -> [u8; WIRE_SIZE] {
        let mut b = [0u8; WIRE_SIZE];
        let mut w = Writer { b: &mut b, at: 0 };
        w.put(&WIRE_MAGIC.to_le_bytes());
        w.put(&(self.strategy as u32).to_le_bytes());
        w.put(&self.key.producer_pid.to_le_bytes());
        w.put(&0u32.to_le_bytes());
        w.put(&self.key.producer_start.to_le_bytes());
        w.put(&self.key.segment_id.to_le_bytes());
        w.put(&self.segment_data_size.to_le_bytes());
        w.put(&self.offset.to_le_bytes());
        w.put(&self.size.to_le_bytes());
        w.put(&self.slot.to_le_bytes());
        w.put(&self.generation.to_le_bytes());
        let n = self.name.len().min(MAX_NAME_LEN);
        w.put(&self.name.as_bytes()[..n]);
        b
    }

    pub fn decode(b: &[u8]) -> Result<ArenaHandle> {
        if b.len() != WIRE_SIZE {
            return Err(Error::new(ErrorKind::SizeMismatch, format!("an arena handle is {WIRE_SIZE} bytes, got {}", b.len())));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if u32_at(0) != WIRE_MAGIC {
            return Err(Error::new(ErrorKind::Corrupt, "not an arena handle (bad magic)"));
        }
        let name_bytes = &b[64..];
        let len = name_bytes.iter().position(|c| *c == 0).unwrap_or(name_bytes.len());
        let name = std::str::from_utf8(&name_bytes[..len])
            .map_err(|_| Error::new(ErrorKind::Corrupt, "arena handle: segment name is not UTF-8"))?
            .to_string();
        let h = ArenaHandle {
            strategy: Strategy::from_u32(u32_at(4))?,
            key: SegmentKey { producer_pid: u32_at(8) as i32, producer_start: u64_at(16), segment_id: u64_at(24) },
            segment_data_size: u64_at(32),
            offset: u64_at(40),
            size: u64_at(48),
            slot: u32_at(56),
            generation: u32_at(60),
            name,
        };
        h.validate()?;
        Ok(h)
    }

    /// Checks what can be checked without the segment.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::new(ErrorKind::InvalidArgument, format!("bad arena handle: {why}")));
        if self.key.producer_pid <= 0 {
            return bad(format!("producer pid {}", self.key.producer_pid));
        }
        if self.size == 0 {
            return bad("block size 0".into());
        }
        if self.offset.checked_add(self.size).map_or(true, |end| end > self.segment_data_size) {
            return bad(format!(
                "block [{}, +{}) past the {} data bytes of its segment",
                self.offset, self.size, self.segment_data_size
            ));
        }
        match self.strategy {
            Strategy::Name if !self.name.starts_with("/ss_arena_") || self.name.len() > MAX_NAME_LEN => {
                bad(format!("segment name <{}> is not an arena segment name", self.name))
            }
            Strategy::Fd if !self.name.is_empty() => bad("a by-fd handle carries no name".into()),
            _ => Ok(()),
        }
    }
}

struct Writer<'a> {
    b: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, v: &[u8]) {
        self.b[self.at..self.at + v.len()].copy_from_slice(v);
        self.at += v.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_roundtrip_and_rejects() {
        let h = ArenaHandle {
            strategy: Strategy::Name,
            key: SegmentKey { producer_pid: 42, producer_start: 77, segment_id: 3 },
            segment_data_size: 1 << 20,
            offset: 4096,
            size: 100,
            slot: 5,
            generation: 9,
            name: "/ss_arena_42_3_0000abcd".into(),
        };
        assert_eq!(ArenaHandle::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] ^= 1;
        assert_eq!(ArenaHandle::decode(&b).unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(ArenaHandle::decode(&b[..10]).unwrap_err().kind(), ErrorKind::SizeMismatch);
        let past = ArenaHandle { offset: 1 << 20, ..h.clone() };
        assert_eq!(ArenaHandle::decode(&past.encode()).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let other = ArenaHandle { name: "/torch_1_2_3".into(), ..h };
        assert_eq!(other.validate().unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
