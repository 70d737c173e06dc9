//! The request every rank all-gathers at rendezvous: PyTorch's newest
//! `RendezvousRequest` (docs/pytorch-compat.md), sent as the raw bytes of a C
//! struct, native-endian, padding zeroed.

use super::backend::Layout;
use crate::error::{Error, ErrorKind, Result};

/// `HOST_NAME_MAX + 1` on Linux.
pub const HOSTNAME_LEN: usize = 65;

/// `{int device_idx; int pid; size_t block_size; size_t buffer_size;
/// size_t buffer_offset; bool has_multicast_support; int clique_id;
/// char hostname[HOST_NAME_MAX+1]}` with C's alignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousRequest {
    pub device_idx: i32,
    pub pid: i32,
    pub block_size: u64,
    pub buffer_size: u64,
    pub buffer_offset: u64,
    pub has_multicast_support: bool,
    pub clique_id: i32,
    pub hostname: [u8; HOSTNAME_LEN],
}

const OFF_DEVICE: usize = 0;
const OFF_PID: usize = 4;
const OFF_BLOCK: usize = 8;
const OFF_BUFFER: usize = 16;
const OFF_OFFSET: usize = 24;
const OFF_MULTICAST: usize = 32;
const OFF_CLIQUE: usize = 36;
const OFF_HOST: usize = 40;
/// 40 + 65 = 105, rounded up to the struct's 8-byte alignment.
pub const REQUEST_SIZE: usize = 112;

impl RendezvousRequest {
    /// This process's request for a block with `layout` on `device_idx`.
    pub fn new(device_idx: i32, layout: &Layout) -> Self {
        RendezvousRequest {
            device_idx,
            pid: std::process::id() as i32,
            block_size: layout.block_size as u64,
            buffer_size: layout.buffer_size as u64,
            buffer_offset: layout.buffer_offset as u64,
            has_multicast_support: false,
            clique_id: 0,
            hostname: this_hostname(),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; REQUEST_SIZE];
        b[OFF_DEVICE..OFF_DEVICE + 4].copy_from_slice(&self.device_idx.to_ne_bytes());
        b[OFF_PID..OFF_PID + 4].copy_from_slice(&self.pid.to_ne_bytes());
        b[OFF_BLOCK..OFF_BLOCK + 8].copy_from_slice(&self.block_size.to_ne_bytes());
        b[OFF_BUFFER..OFF_BUFFER + 8].copy_from_slice(&self.buffer_size.to_ne_bytes());
        b[OFF_OFFSET..OFF_OFFSET + 8].copy_from_slice(&self.buffer_offset.to_ne_bytes());
        b[OFF_MULTICAST] = self.has_multicast_support as u8;
        b[OFF_CLIQUE..OFF_CLIQUE + 4].copy_from_slice(&self.clique_id.to_ne_bytes());
        b[OFF_HOST..OFF_HOST + HOSTNAME_LEN].copy_from_slice(&self.hostname);
        b
    }

    /// Parses rank `rank`'s value. Strict wherever PyTorch's bytes are
    /// defined: the exact size, `has_multicast_support` 0 or 1 (a C++
    /// `bool`), the host name NUL-terminated with only NULs after it (the
    /// struct is value-initialised before `gethostname`), a positive pid, a
    /// device index >= 0 and a buffer inside its block. The 10 padding bytes
    /// (33..36 and 105..112) are not read: C++ leaves the padding of an
    /// aggregate-initialised struct unspecified, so a PyTorch rank may send
    /// anything there. Every other byte re-encodes as it came.
    pub fn from_bytes(b: &[u8], rank: usize) -> Result<Self> {
        let bad = |why: String| Err(Error::new(ErrorKind::Protocol, format!("rendezvous request of rank {rank}: {why}")));
        if b.len() != REQUEST_SIZE {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("rendezvous request of rank {rank} has {} bytes, expected {REQUEST_SIZE}", b.len()),
            ));
        }
        let i32_at = |o: usize| i32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
        let has_multicast_support = match b[OFF_MULTICAST] {
            0 => false,
            1 => true,
            v => return bad(format!("has_multicast_support (byte {OFF_MULTICAST}) is {v}, a bool must be 0 or 1")),
        };
        let hostname: [u8; HOSTNAME_LEN] = b[OFF_HOST..OFF_HOST + HOSTNAME_LEN].try_into().unwrap();
        let Some(nul) = hostname.iter().position(|&c| c == 0) else {
            return bad(format!("hostname (bytes {OFF_HOST}..{}) has no NUL", OFF_HOST + HOSTNAME_LEN));
        };
        if let Some(i) = hostname[nul..].iter().position(|&c| c != 0) {
            return bad(format!("byte {} of hostname, after its NUL at {nul}, is {:#04x}, must be 0", nul + i, hostname[nul + i]));
        }
        let req = RendezvousRequest {
            device_idx: i32_at(OFF_DEVICE),
            pid: i32_at(OFF_PID),
            block_size: u64_at(OFF_BLOCK),
            buffer_size: u64_at(OFF_BUFFER),
            buffer_offset: u64_at(OFF_OFFSET),
            has_multicast_support,
            clique_id: i32_at(OFF_CLIQUE),
            hostname,
        };
        if req.pid <= 0 {
            return bad(format!("pid {}", req.pid));
        }
        if req.device_idx < 0 {
            return bad(format!("device index {}", req.device_idx));
        }
        if req.buffer_offset.checked_add(req.buffer_size).map_or(true, |end| end > req.block_size) {
            return bad(format!(
                "buffer of {} bytes at offset {} does not fit its block of {} bytes",
                req.buffer_size, req.buffer_offset, req.block_size
            ));
        }
        Ok(req)
    }

    /// Where `to_bytes` writes padding: never read by `from_bytes`.
    pub const PADDING: [std::ops::Range<usize>; 2] = [OFF_MULTICAST + 1..OFF_CLIQUE, OFF_HOST + HOSTNAME_LEN..REQUEST_SIZE];

    /// The host name as text (up to its NUL).
    pub fn host(&self) -> String {
        let end = self.hostname.iter().position(|&c| c == 0).unwrap_or(HOSTNAME_LEN);
        String::from_utf8_lossy(&self.hostname[..end]).into_owned()
    }
}

fn this_hostname() -> [u8; HOSTNAME_LEN] {
    let mut buf = [0u8; HOSTNAME_LEN];
    // SAFETY: gethostname writes at most len bytes into our buffer.
    unsafe { libc::gethostname(buf.as_mut_ptr().cast(), HOSTNAME_LEN - 1) };
    buf[HOSTNAME_LEN - 1] = 0;
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_size_check() {
        let layout = Layout { block_size: 20480, buffer_size: 100, buffer_offset: 12288, signal_pad_size: 9216 };
        let r = RendezvousRequest::new(0, &layout);
        let bytes = r.to_bytes();
        assert_eq!(bytes.len(), REQUEST_SIZE);
        assert_eq!(RendezvousRequest::from_bytes(&bytes, 3).unwrap(), r);
        assert_eq!(u64::from_ne_bytes(bytes[8..16].try_into().unwrap()), 20480);
        let e = RendezvousRequest::from_bytes(&bytes[..40], 3).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol);
        assert!(e.message().contains("rank 3"), "{}", e.message());
    }

    #[test]
    fn strict_where_pytorch_bytes_are_defined() {
        let layout = Layout { block_size: 20480, buffer_size: 100, buffer_offset: 12288, signal_pad_size: 9216 };
        let good = RendezvousRequest::new(0, &layout).to_bytes();
        let refused = |at: usize, v: u8, what: &str| {
            let mut b = good.clone();
            b[at] = v;
            let e = RendezvousRequest::from_bytes(&b, 1).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol);
            assert!(e.message().contains(what), "{}", e.message());
        };
        refused(OFF_MULTICAST, 2, "has_multicast_support");
        refused(REQUEST_SIZE - 8, b'x', "after its NUL");
        let base = RendezvousRequest::new(0, &layout);
        for (r, what) in [
            (RendezvousRequest { pid: 0, ..base.clone() }, "pid 0"),
            (RendezvousRequest { device_idx: -1, ..base.clone() }, "device index -1"),
            (RendezvousRequest { buffer_offset: u64::MAX, ..base.clone() }, "does not fit"),
            (RendezvousRequest { buffer_size: 8193, ..base.clone() }, "does not fit"),
        ] {
            let e = RendezvousRequest::from_bytes(&r.to_bytes(), 1).unwrap_err();
            assert!(e.message().contains(what), "{}", e.message());
        }
        let mut b = good.clone();
        b[OFF_HOST..OFF_HOST + HOSTNAME_LEN].fill(b'a');
        assert!(RendezvousRequest::from_bytes(&b, 1).unwrap_err().message().contains("no NUL"));
        // Padding is PyTorch's to leave unset: ignored.
        let mut b = good.clone();
        for r in RendezvousRequest::PADDING {
            b[r].fill(0xa5);
        }
        let r = RendezvousRequest::from_bytes(&b, 1).unwrap();
        assert_eq!(r.to_bytes(), good);
    }
}
