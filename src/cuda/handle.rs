//! What a producer sends for one CUDA storage: PyTorch's 8-field tuple,
//! with the memory handle in PyTorch's byte format (docs/pytorch-compat.md, "CUDA IPC").

use crate::error::{Error, ErrorKind, Result};

/// Bytes of a `cudaIpcMemHandle_t` / `CUipcMemHandle` and of an event handle.
pub const IPC_HANDLE_SIZE: usize = 64;
/// Version byte we write before the handle type (PyTorch's
/// `SHAREABLE_HANDLE_VERSION`).
pub const SHAREABLE_HANDLE_VERSION: u8 = 2;
/// Type byte of a handle to a whole `cudaMalloc` segment.
pub const HANDLE_TYPE_SEGMENT: u8 = b'c';
/// Type byte of an expandable-segment handle (not supported here).
pub const HANDLE_TYPE_EXPANDABLE: u8 = b'e';
/// Length of the memory-handle bytes we write: version, type, handle.
pub const MEM_HANDLE_LEN: usize = 2 + IPC_HANDLE_SIZE;

/// PyTorch's memory-handle bytes for a segment: version, 'c', raw handle.
pub fn encode_mem_handle(raw: &[u8; IPC_HANDLE_SIZE]) -> [u8; MEM_HANDLE_LEN] {
    let mut out = [0u8; MEM_HANDLE_LEN];
    out[0] = SHAREABLE_HANDLE_VERSION;
    out[1] = HANDLE_TYPE_SEGMENT;
    out[2..].copy_from_slice(raw);
    out
}

/// The raw 64-byte handle inside memory-handle bytes, accepting what a
/// PyTorch receiver accepts: exactly 64 bytes (the legacy raw form) or
/// version ≤ ours followed by 'c' and 64 bytes.
pub fn decode_mem_handle(bytes: &[u8]) -> Result<[u8; IPC_HANDLE_SIZE]> {
    if bytes.len() == IPC_HANDLE_SIZE {
        return Ok(bytes.try_into().expect("length checked"));
    }
    let bad = |why: &str| Error::new(ErrorKind::InvalidArgument, format!("unexpected or illformed shareable handle type: {why}"));
    if bytes.len() < 2 {
        return Err(bad(&format!("{} bytes", bytes.len())));
    }
    if bytes[0] > SHAREABLE_HANDLE_VERSION {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "received sharable handle from a future version of torch that this version does not know how to handle (version byte {}, we know up to {SHAREABLE_HANDLE_VERSION})",
                bytes[0]
            ),
        ));
    }
    match bytes[1] {
        HANDLE_TYPE_SEGMENT if bytes.len() == MEM_HANDLE_LEN => Ok(bytes[2..].try_into().expect("length checked")),
        HANDLE_TYPE_SEGMENT => Err(bad(&format!("'c' handle of {} bytes, expected {MEM_HANDLE_LEN}", bytes.len()))),
        HANDLE_TYPE_EXPANDABLE => Err(Error::new(
            ErrorKind::Unsupported,
            "expandable-segment handles ('e') are not supported: share memory from a cudaMalloc segment",
        )),
        t => Err(bad(&format!("type byte 0x{t:02x}"))),
    }
}

/// The eight fields of PyTorch's `_share_cuda_()` tuple, in its order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    /// Device ordinal of the memory.
    pub device: i32,
    /// Memory-handle bytes (see [`encode_mem_handle`]); empty for a storage
    /// without data.
    pub mem_handle: Vec<u8>,
    /// Bytes of the shared storage.
    pub size_bytes: u64,
    /// Bytes from the segment base to the storage's data.
    pub offset_bytes: u64,
    /// Name of the ref-counter file; empty for a storage without data.
    pub ref_counter_handle: String,
    /// Slot index in the ref-counter file.
    pub ref_counter_offset: u64,
    /// Interprocess event handle (zeros when no event was recorded).
    pub event_handle: [u8; IPC_HANDLE_SIZE],
    /// Whether the consumer must wait on the event before using the data.
    pub event_sync_required: bool,
}

impl IpcHandle {
    /// Whether the storage has no data (PyTorch sends `None` handles then).
    pub fn is_null(&self) -> bool {
        self.mem_handle.is_empty()
    }

    /// A one-line text form for passing a tuple through argv, pipes or a
    /// Python peer: the eight fields separated by spaces, byte strings in
    /// lowercase hex, `-` for an empty byte string, the flag as 0/1.
    pub fn to_text(&self) -> String {
        let or_dash = |s: String| if s.is_empty() { "-".to_string() } else { s };
        format!(
            "{} {} {} {} {} {} {} {}",
            self.device,
            or_dash(hex(&self.mem_handle)),
            self.size_bytes,
            self.offset_bytes,
            or_dash(self.ref_counter_handle.clone()),
            self.ref_counter_offset,
            hex(&self.event_handle),
            u8::from(self.event_sync_required)
        )
    }

    /// Parses [`IpcHandle::to_text`]'s form.
    pub fn from_text(line: &str) -> Result<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let bad = |why: String| Error::new(ErrorKind::InvalidArgument, format!("CUDA IPC handle text {line:?}: {why}"));
        if fields.len() != 8 {
            return Err(bad(format!("{} fields, expected 8", fields.len())));
        }
        let int = |i: usize, what: &str| fields[i].parse::<u64>().map_err(|_| bad(format!("{what} {:?} is not an integer", fields[i])));
        let bytes = |i: usize, what: &str| {
            if fields[i] == "-" {
                Ok(Vec::new())
            } else {
                unhex(fields[i]).ok_or_else(|| bad(format!("{what} is not hex")))
            }
        };
        let event: [u8; IPC_HANDLE_SIZE] = bytes(6, "event handle")?
            .try_into()
            .map_err(|v: Vec<u8>| bad(format!("event handle has {} bytes, expected {IPC_HANDLE_SIZE}", v.len())))?;
        Ok(IpcHandle {
            device: fields[0].parse().map_err(|_| bad(format!("device {:?} is not an integer", fields[0])))?,
            mem_handle: bytes(1, "memory handle")?,
            size_bytes: int(2, "size")?,
            offset_bytes: int(3, "offset")?,
            ref_counter_handle: if fields[4] == "-" { String::new() } else { fields[4].to_string() },
            ref_counter_offset: int(5, "counter slot")?,
            event_handle: event,
            event_sync_required: match fields[7] {
                "0" => false,
                "1" => true,
                f => return Err(bad(format!("sync flag {f:?} is not 0 or 1"))),
            },
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    // Hex digits only: u8::from_str_radix alone would take a sign ("+c").
    if text.len() % 2 != 0 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_handle_bytes_follow_pytorch() {
        let raw = [7u8; 64];
        let enc = encode_mem_handle(&raw);
        assert_eq!(enc.len(), 66);
        assert_eq!(&enc[..2], &[2, b'c']);
        assert_eq!(decode_mem_handle(&enc).unwrap(), raw);
        assert_eq!(decode_mem_handle(&raw).unwrap(), raw, "legacy raw 64-byte form");
        let mut old = enc;
        old[0] = 1;
        assert_eq!(decode_mem_handle(&old).unwrap(), raw);
        let mut future = enc;
        future[0] = 3;
        let e = decode_mem_handle(&future).unwrap_err();
        assert!(e.message().contains("future version of torch"), "{e}");
        let mut expandable = enc.to_vec();
        expandable[1] = b'e';
        assert_eq!(decode_mem_handle(&expandable).unwrap_err().kind(), ErrorKind::Unsupported);
        let mut weird = enc;
        weird[1] = b'x';
        assert!(decode_mem_handle(&weird).unwrap_err().message().contains("illformed"));
        assert!(decode_mem_handle(&enc[..10]).unwrap_err().message().contains("illformed"));
        assert!(decode_mem_handle(&[]).is_err());
    }

    #[test]
    fn text_form_round_trips_and_rejects_garbage() {
        let h = IpcHandle {
            device: 1,
            mem_handle: encode_mem_handle(&[0xab; 64]).to_vec(),
            size_bytes: 4096,
            offset_bytes: 512,
            ref_counter_handle: "/torch_1_2_3".into(),
            ref_counter_offset: 9999,
            event_handle: [0x11; 64],
            event_sync_required: true,
        };
        assert_eq!(IpcHandle::from_text(&h.to_text()).unwrap(), h);
        let null = IpcHandle { mem_handle: vec![], ref_counter_handle: String::new(), event_sync_required: false, ..h.clone() };
        assert!(null.to_text().contains(" - "));
        assert_eq!(IpcHandle::from_text(&null.to_text()).unwrap(), null);
        for bad in ["", "1 2 3", "x ab 1 1 /n 1 00 1", "1 zz 1 1 /n 1 00 1", "1 abc 1 1 /n 1 00 1", "1 +c 1 1 /n 1 00 1"] {
            assert_eq!(IpcHandle::from_text(bad).unwrap_err().kind(), ErrorKind::InvalidArgument, "{bad:?}");
        }
        let short_event = h.to_text().replace(&"11".repeat(64), "11");
        assert!(IpcHandle::from_text(&short_event).unwrap_err().message().contains("event handle has 1 bytes"));
        let bad_flag = format!("{} 2", h.to_text().rsplit_once(' ').unwrap().0);
        assert!(IpcHandle::from_text(&bad_flag).unwrap_err().message().contains("sync flag"));
    }
}
