//! The handle a producer gives out: a few dozen bytes naming the socket
//! its server listens on, its pid and start time (checked with
//! `SO_PEERCRED` and /proc on connect, so a process that got the pid after
//! the producer exited is refused), the device and the kind. It holds no memory handle itself, so it is
//! safe to pickle, log or send through any channel; a forged one can only
//! point at a socket whose owner is then checked.

use super::options::{PoolDevice, PoolKind};
use crate::error::{Error, ErrorKind, Result};
use crate::fdpass::abstract_socket::MAX_NAME;

const MAGIC: &[u8; 4] = b"SSPH";
/// 2: the producer's start time follows its pid.
const FORMAT: u8 = 2;
/// magic, format, kind, device type, device, pid, start time, name length.
const FIXED: usize = 4 + 1 + 1 + 4 + 4 + 4 + 8 + 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolHandle {
    pub socket_name: String,
    pub producer_pid: i32,
    /// The producer's start time, clock ticks since boot (`proc_identity`).
    pub producer_start: u64,
    pub device: PoolDevice,
    pub kind: PoolKind,
}

fn bad(msg: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, format!("not a pool handle: {msg}"))
}

/// Socket names are ours: printable ASCII without spaces.
fn check_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!("socket name of {} bytes (1 to {MAX_NAME})", name.len()));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
        return Err(format!("socket name {name:?} has characters other than letters, digits, '-', '_' and '.'"));
    }
    Ok(())
}

impl PoolHandle {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + self.socket_name.len());
        out.extend_from_slice(MAGIC);
        out.push(FORMAT);
        out.push(self.kind.code());
        let (device_type, device) = self.device.code();
        out.extend_from_slice(&device_type.to_le_bytes());
        out.extend_from_slice(&device.to_le_bytes());
        out.extend_from_slice(&self.producer_pid.to_le_bytes());
        out.extend_from_slice(&self.producer_start.to_le_bytes());
        out.push(self.socket_name.len() as u8);
        out.extend_from_slice(self.socket_name.as_bytes());
        out
    }

    /// Parses and checks handle bytes; an `InvalidArgument` error says
    /// what is wrong with them.
    pub fn from_bytes(b: &[u8]) -> Result<PoolHandle> {
        if b.len() < FIXED {
            return Err(bad(format!("{} bytes, at least {FIXED} expected (truncated?)", b.len())));
        }
        if &b[..4] != MAGIC {
            return Err(bad("wrong magic bytes".into()));
        }
        if b[4] != FORMAT {
            return Err(bad(format!("format {} (this library reads format {FORMAT})", b[4])));
        }
        let kind = PoolKind::from_code(b[5]).map_err(|e| bad(e.to_string()))?;
        let int = |at: usize| i32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let device = PoolDevice::from_code(int(6), int(10)).map_err(|e| bad(e.to_string()))?;
        let producer_pid = int(14);
        if producer_pid <= 0 {
            return Err(bad(format!("producer pid {producer_pid}")));
        }
        let producer_start = u64::from_le_bytes(b[18..26].try_into().expect("8 bytes"));
        let len = b[26] as usize;
        if b.len() != FIXED + len {
            return Err(bad(format!("{} bytes, but its socket name says {}", b.len(), FIXED + len)));
        }
        let socket_name = std::str::from_utf8(&b[FIXED..]).map_err(|_| bad("socket name is not UTF-8".into()))?.to_string();
        check_name(&socket_name).map_err(bad)?;
        Ok(PoolHandle { socket_name, producer_pid, producer_start, device, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_forgeries() {
        let h = PoolHandle {
            socket_name: "ss_pool-12-00ff".into(),
            producer_pid: 12,
            producer_start: 7,
            device: PoolDevice::Host,
            kind: PoolKind::Legacy,
        };
        let b = h.to_bytes();
        assert_eq!(PoolHandle::from_bytes(&b).unwrap(), h);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b[..5].to_vec(), "truncated"),
            ([b"XXXX", &b[4..]].concat(), "magic"),
            (
                {
                    let mut x = b.clone();
                    x[4] = 9;
                    x
                },
                "format 9",
            ),
            (
                {
                    let mut x = b.clone();
                    x[5] = 9;
                    x
                },
                "unknown pool kind",
            ),
            (
                {
                    let mut x = b.clone();
                    x[6] = 7;
                    x
                },
                "device type",
            ),
            (
                {
                    let mut x = b.clone();
                    x[14..18].copy_from_slice(&0i32.to_le_bytes());
                    x
                },
                "producer pid 0",
            ),
            (
                {
                    let mut x = b.clone();
                    x.push(b'a');
                    x
                },
                "socket name says",
            ),
            (
                {
                    let mut x = b.clone();
                    let n = x.len();
                    x[n - 1] = b' ';
                    x
                },
                "characters other than",
            ),
        ];
        for (bytes, what) in cases {
            let e = PoolHandle::from_bytes(&bytes).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert!(e.message().contains(what), "{what:?} not in {e}");
        }
    }
}
