//! libshm's wire format, byte for byte: a 68-byte `AllocInfo` record per
//! message (native-endian pid, a free flag, a 60-byte NUL-terminated name,
//! 3 pad bytes) and the 2-byte `OK` reply to a registration.

use crate::error::{Error, ErrorKind, Result};

/// Size of one `AllocInfo` record on the wire.
pub const ALLOC_INFO_SIZE: usize = 68;
/// Bytes of the filename field, the terminating NUL included.
pub const FILENAME_FIELD: usize = 60;
/// The manager's answer to a registration.
pub const OK_REPLY: &[u8; 2] = b"OK";

const PID_AT: usize = 0;
const FREE_AT: usize = 4;
const NAME_AT: usize = 5;

/// One message: "process `pid` maps `filename`" (free = false) or "process
/// `pid` unmapped it" (free = true).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocInfo {
    pub pid: i32,
    pub free: bool,
    pub filename: String,
}

impl AllocInfo {
    pub fn new(pid: i32, free: bool, filename: &str) -> Result<Self> {
        check_filename(filename)?;
        Ok(AllocInfo { pid, free, filename: filename.to_string() })
    }

    /// The 68 wire bytes; unused bytes are zero, as libshm's zeroed struct.
    pub fn encode(&self) -> [u8; ALLOC_INFO_SIZE] {
        let mut b = [0u8; ALLOC_INFO_SIZE];
        b[PID_AT..PID_AT + 4].copy_from_slice(&self.pid.to_ne_bytes());
        b[FREE_AT] = self.free as u8;
        b[NAME_AT..NAME_AT + self.filename.len()].copy_from_slice(self.filename.as_bytes());
        b
    }

    /// Parses a record. libshm treats any non-zero free byte as a free; so
    /// do we. A name that is not NUL-terminated inside its field, is empty,
    /// or is not valid UTF-8 is a protocol error.
    pub fn decode(b: &[u8; ALLOC_INFO_SIZE]) -> Result<Self> {
        let pid = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        let field = &b[NAME_AT..NAME_AT + FILENAME_FIELD];
        let len = field.iter().position(|c| *c == 0).ok_or_else(|| {
            Error::new(ErrorKind::Protocol, format!("AllocInfo from pid {pid}: filename field has no NUL in its {FILENAME_FIELD} bytes"))
        })?;
        if len == 0 {
            return Err(Error::new(ErrorKind::Protocol, format!("AllocInfo from pid {pid}: empty filename")));
        }
        let filename = std::str::from_utf8(&field[..len])
            .map_err(|_| Error::new(ErrorKind::Protocol, format!("AllocInfo from pid {pid}: filename is not UTF-8")))?;
        Ok(AllocInfo { pid, free: b[FREE_AT] != 0, filename: filename.to_string() })
    }
}

/// A name fits the field when it is shorter than 60 bytes (the NUL needs
/// the last one) and has no NUL of its own.
pub fn check_filename(filename: &str) -> Result<()> {
    if filename.len() >= FILENAME_FIELD {
        return Err(Error::new(
            ErrorKind::NameTooLong,
            format!(
                "MapAllocatorContext_filename too long: <{filename}> has {} bytes, the manager protocol allows {}",
                filename.len(),
                FILENAME_FIELD - 1
            ),
        ));
    }
    if filename.is_empty() || filename.contains('\0') {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("segment name <{filename}> is empty or contains NUL")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_libshm() {
        let m = AllocInfo::new(0x01020304, true, "/torch_1_2_3").unwrap();
        let b = m.encode();
        assert_eq!(b.len(), 68);
        assert_eq!(&b[0..4], &0x01020304i32.to_ne_bytes());
        assert_eq!(b[4], 1);
        assert_eq!(&b[5..17], b"/torch_1_2_3");
        assert!(b[17..].iter().all(|c| *c == 0));
        assert_eq!(AllocInfo::decode(&b).unwrap(), m);
    }

    #[test]
    fn names_and_garbage() {
        let long = format!("/{}", "a".repeat(59));
        assert_eq!(AllocInfo::new(1, false, &long).unwrap_err().kind(), ErrorKind::NameTooLong);
        AllocInfo::new(1, false, &long[..59]).unwrap();
        let mut b = [0xffu8; 68];
        assert_eq!(AllocInfo::decode(&b).unwrap_err().kind(), ErrorKind::Protocol);
        b = [0u8; 68];
        assert_eq!(AllocInfo::decode(&b).unwrap_err().kind(), ErrorKind::Protocol);
        b[5] = b'/';
        b[6] = 0xfe;
        assert_eq!(AllocInfo::decode(&b).unwrap_err().kind(), ErrorKind::Protocol);
        b[6] = b'x';
        b[4] = 7;
        assert!(AllocInfo::decode(&b).unwrap().free);
    }
}
