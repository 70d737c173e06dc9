//! Copying a stored storage's bytes out of its file into the caller's
//! memory: read with `pread` in pieces (one copy, done by the kernel,
//! and no page faults on a mapping of the file), each piece's CRC-32
//! computed while it is still in cache, the whole checked against the
//! CRC the file's zip record holds.

use crate::error::{Error, ErrorKind, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Bytes read per `pread`: small enough that the CRC pass after it finds
/// them in cache, big enough that the calls cost nothing.
const PIECE: usize = 512 << 10;

/// Reads `dst.len()` bytes at `offset` of `file` into `dst`; with
/// `crc` (non-zero), checks them against it. `what` names the storage
/// in errors.
pub fn read_checked(file: &File, offset: u64, dst: &mut [u8], crc: u32, what: &str) -> Result<()> {
    let mut hasher = crc32fast::Hasher::new();
    let mut done = 0usize;
    while done < dst.len() {
        let end = dst.len().min(done + PIECE);
        let piece = &mut dst[done..end];
        file.read_exact_at(piece, offset + done as u64).map_err(|e| {
            let kind = if e.kind() == std::io::ErrorKind::UnexpectedEof { ErrorKind::Corrupt } else { ErrorKind::Io };
            Error::new(kind, format!("{what}: unable to read bytes {done}..{end} of its data: {e}"))
        })?;
        if crc != 0 {
            hasher.update(piece);
        }
        done = end;
    }
    if crc != 0 {
        let got = hasher.finalize();
        if got != crc {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("{what}: its bytes' CRC-32 is {got:#010x}, not the {crc:#010x} its zip record holds (the file is damaged)"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_with(bytes: &[u8]) -> File {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor
        // it returns is owned by the File from here on.
        let fd = unsafe { libc::memfd_create(c"copy_out".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fd is a fresh descriptor nothing else owns.
        let mut f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn reads_across_pieces_and_checks_the_crc() {
        let data: Vec<u8> = (0..PIECE * 2 + 13).map(|i| (i * 7 + i / 977) as u8).collect();
        let mut file_bytes = vec![0xAA; 5];
        file_bytes.extend_from_slice(&data);
        let f = file_with(&file_bytes);
        let mut dst = vec![0; data.len()];
        read_checked(&f, 5, &mut dst, crc32fast::hash(&data), "s").unwrap();
        assert_eq!(dst, data);
        let e = read_checked(&f, 5, &mut dst, crc32fast::hash(&data) ^ 1, "s").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.message().contains("CRC-32"), "{}", e.message());
        // No CRC stored: nothing to check.
        read_checked(&f, 5, &mut dst, 0, "s").unwrap();
    }

    #[test]
    fn a_short_file_is_corrupt() {
        let f = file_with(&[1, 2, 3]);
        let mut dst = vec![0; 8];
        let e = read_checked(&f, 0, &mut dst, 0, "storage x").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.message().starts_with("storage x"), "{}", e.message());
    }
}
