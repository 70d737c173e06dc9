//! The first message a producer's server sends a consumer (the hello),
//! with the control block's descriptor and, for the Vmm kind, one
//! descriptor per segment; the manifest follows in chunks.

use crate::error::{Error, ErrorKind, Result};

pub const MAGIC: &[u8; 8] = b"SSPHELO1";
/// magic, status, kind, slot, slots, segments, manifest length.
pub const HELLO_BYTES: usize = 8 + 4 + 4 + 4 + 4 + 4 + 8;
/// Manifest bytes per message after the hello.
pub const CHUNK: usize = 32 << 10;

pub const STATUS_OK: u32 = 0;
/// The pool has no free consumer slot; a text follows the header.
pub const STATUS_FULL: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub status: u32,
    pub kind: u8,
    pub slot: u32,
    pub slots: u32,
    pub segments: u32,
    pub manifest_len: u64,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.status.to_le_bytes());
        b[12] = self.kind;
        b[16..20].copy_from_slice(&self.slot.to_le_bytes());
        b[20..24].copy_from_slice(&self.slots.to_le_bytes());
        b[24..28].copy_from_slice(&self.segments.to_le_bytes());
        b[28..36].copy_from_slice(&self.manifest_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Hello> {
        if b.len() < HELLO_BYTES || &b[..8] != MAGIC {
            return Err(Error::new(ErrorKind::Protocol, format!("the pool's server sent {} bytes that are not a hello", b.len())));
        }
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        Ok(Hello {
            status: u32_at(8),
            kind: b[12],
            slot: u32_at(16),
            slots: u32_at(20),
            segments: u32_at(24),
            manifest_len: u64::from_le_bytes(b[28..36].try_into().expect("8 bytes")),
        })
    }
}
