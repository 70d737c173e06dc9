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

    /// The inverse of [`encode`](Self::encode), strict: every byte of the
    /// 112 has one allowed value per handle, so a handle has exactly one
    /// spelling (the reserved word is 0, the name field is the name, its
    /// NUL, then NULs only) and whatever decodes re-encodes to the same bytes.
    pub fn decode(b: &[u8]) -> Result<ArenaHandle> {
        if b.len() != WIRE_SIZE {
            return Err(Error::new(ErrorKind::SizeMismatch, format!("an arena handle is {WIRE_SIZE} bytes, got {}", b.len())));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if u32_at(0) != WIRE_MAGIC {
            return Err(Error::new(ErrorKind::Corrupt, "not an arena handle (bad magic)"));
        }
        let strategy = Strategy::from_u32(u32_at(4)).map_err(|e| e.context("bad arena handle"))?;
        if u32_at(12) != 0 {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("arena handle: reserved word (bytes 12..16) is {:#010x}, must be 0", u32_at(12)),
            ));
        }
        let name = name_from_field(&b[NAME_AT..]).map_err(|why| Error::new(ErrorKind::Corrupt, format!("arena handle: {why}")))?;
        let h = ArenaHandle {
            strategy,
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
            return bad(format!("block [{}, +{}) past the {} data bytes of its segment", self.offset, self.size, self.segment_data_size));
        }
        match self.strategy {
            Strategy::Name if self.name.len() > MAX_NAME_LEN || !is_segment_name(&self.name) => bad(format!(
                "segment name {:?} is not an arena segment name (/ss_arena_<pid>_<id>_<8 hex digits>, at most {MAX_NAME_LEN} bytes)",
                self.name
            )),
            Strategy::Fd if !self.name.is_empty() => bad("a by-fd handle carries no name".into()),
            _ => Ok(()),
        }
    }
}

/// Where the name field starts in the wire form.
const NAME_AT: usize = WIRE_SIZE - (MAX_NAME_LEN + 1);

/// Reads a segment-name field of `MAX_NAME_LEN + 1` bytes in the one form
/// [`ArenaHandle::encode`] and `ss_arena_share` write: the name, its NUL,
/// then NULs only. Any other byte after the NUL would make a second
/// spelling of the same handle. The error says what is wrong.
pub fn name_from_field(field: &[u8]) -> std::result::Result<String, String> {
    let len =
        field.iter().position(|c| *c == 0).ok_or_else(|| format!("the segment name field has no NUL in its {} bytes", field.len()))?;
    if let Some(i) = field[len..].iter().position(|c| *c != 0) {
        return Err(format!(
            "byte {} of the segment name field, after the name's NUL at {len}, is {:#04x}, must be 0",
            len + i,
            field[len + i]
        ));
    }
    std::str::from_utf8(&field[..len]).map(str::to_string).map_err(|_| "the segment name is not UTF-8".to_string())
}

/// `/ss_arena_<pid>_<id>_<8 lowercase hex digits>`, numbers in decimal with
/// no leading zero: the names `Segment::create` makes, and only those.
pub fn is_segment_name(name: &str) -> bool {
    let decimal = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()) && (s.len() == 1 || !s.starts_with('0'));
    let Some(rest) = name.strip_prefix("/ss_arena_") else { return false };
    let parts: Vec<&str> = rest.split('_').collect();
    parts.len() == 3
        && decimal(parts[0])
        && decimal(parts[1])
        && parts[2].len() == 8
        && parts[2].bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
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

    /// A by-name handle of segment 3 of producer 42.
    fn by_name() -> ArenaHandle {
        ArenaHandle {
            strategy: Strategy::Name,
            key: SegmentKey { producer_pid: 42, producer_start: 77, segment_id: 3 },
            segment_data_size: 1 << 20,
            offset: 0,
            size: 1,
            slot: 0,
            generation: 1,
            name: "/ss_arena_42_3_0000abcd".into(),
        }
    }

    #[test]
    fn encode_decode_roundtrip_and_rejects() {
        let h = ArenaHandle { offset: 4096, size: 100, slot: 5, generation: 9, ..by_name() };
        assert_eq!(ArenaHandle::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] ^= 1;
        assert_eq!(ArenaHandle::decode(&b).unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(ArenaHandle::decode(&b[..10]).unwrap_err().kind(), ErrorKind::SizeMismatch);
        let past = ArenaHandle { offset: 1 << 20, ..h.clone() };
        assert_eq!(ArenaHandle::decode(&past.encode()).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let other = ArenaHandle { name: "/torch_1_2_3".into(), ..h.clone() };
        assert_eq!(other.validate().unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn one_spelling_per_handle() {
        let h = ArenaHandle { offset: 0, size: 1, slot: 0, generation: 1, ..by_name() };
        let good = h.encode();
        let mut b = good;
        b[13] = 1;
        let e = ArenaHandle::decode(&b).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.message().contains("reserved word"), "{}", e.message());
        let mut b = good;
        b[WIRE_SIZE - 1] = b'x';
        let e = ArenaHandle::decode(&b).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.message().contains("after the name's NUL"), "{}", e.message());
        for name in [
            "/ss_arena_42_3_0000ABCD",
            "/ss_arena_042_3_0000abcd",
            "/ss_arena_42_3_abcd",
            "/ss_arena_/_3_0000abcd",
            "/ss_arena_42_3_0000abcd_",
        ] {
            let other = ArenaHandle { name: name.into(), ..h.clone() };
            assert_eq!(other.validate().unwrap_err().kind(), ErrorKind::InvalidArgument, "{name}");
        }
        assert!(is_segment_name("/ss_arena_1_0_00000000"));
        assert_eq!(name_from_field(b"/ss_arena_\0\0"), Ok("/ss_arena_".to_string()));
        assert!(name_from_field(b"abc").unwrap_err().contains("no NUL"));
    }
}
