//! Reading storage files that someone else may shrink under us.
//!
//! A mapping of a file faults with SIGBUS when the file is truncated
//! below a page in use, and nothing in the reader can catch that. So a
//! file is mapped only when nobody but this process's user (or root) can
//! truncate it: it is ours and neither its group nor others may write it.
//! Any other file (a store written by another user, or one left
//! group/world-writable) is read with `pread` into memory of our own,
//! where a truncation shows as a short read: an error, never a crash.
//! Parsing a PyTorch-format file reads only its head and tail the same
//! way, never the mapping.

use super::copy_out;
use super::torch_format::{self, image::Image};
use crate::error::{Error, ErrorKind, Result};
use std::fs::{File, Metadata};
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};

/// Bytes read from each end of a PyTorch-format storage file to parse it:
/// every record but the data sits there (torch writes under 2 KiB on
/// each side of it); the end record may follow a comment of up to 64 KiB.
const END_PIECE: usize = 128 << 10;
/// A file whose records do not all sit in its ends is read whole to be
/// parsed, up to this size.
const WHOLE_MAX: usize = 64 << 20;

/// Whether only this process's user (or root) can shrink the file: it is
/// owned by our effective uid and its mode lets neither group nor others
/// write it (an ACL granting write to anyone else shows in the group bits).
pub fn only_we_can_shrink(meta: &Metadata) -> bool {
    meta.uid() == nix::unistd::geteuid().as_raw() && meta.mode() & 0o022 == 0
}

/// Reads `n` bytes at `at`; a short read means the file shrank.
fn read_piece(file: &File, at: usize, n: usize, what: &str) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; n];
    file.read_exact_at(&mut buf, at as u64).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::new(ErrorKind::Corrupt, format!("{what}: the file shrank while being read"))
        } else {
            Error::new(ErrorKind::Io, format!("{what}: unable to read bytes {at}..{}: {e}", at + n))
        }
    })?;
    Ok(buf)
}

/// Where the data lies in a PyTorch-format storage file of `len` bytes,
/// and the CRC-32 its zip record holds (0: none), read with `pread`.
pub fn torch_data_record(file: &File, len: usize, what: &str) -> Result<(Range<usize>, u32)> {
    let parse = |img: &Image| torch_format::storage_data_record_in(img).map_err(|e| e.context(what));
    if len <= 2 * END_PIECE {
        return parse(&Image::from_pieces(len, vec![(0, read_piece(file, 0, len, what)?)]));
    }
    let tail = len - END_PIECE;
    let ends = Image::from_pieces(len, vec![(0, read_piece(file, 0, END_PIECE, what)?), (tail, read_piece(file, tail, END_PIECE, what)?)]);
    match parse(&ends) {
        Ok(found) => Ok(found),
        // An odd but maybe valid layout: parse it whole where that is cheap.
        Err(_) if len <= WHOLE_MAX => parse(&Image::from_pieces(len, vec![(0, read_piece(file, 0, len, what)?)])),
        Err(e) => Err(e),
    }
}

/// Bytes copied out of a file into memory of our own, aligned for any
/// element type (16 bytes).
pub struct CopiedBytes {
    words: Vec<u128>,
    len: usize,
}

impl CopiedBytes {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialized bytes (it was
        // allocated zeroed, `len.div_ceil(16)` words long), and u8 has no
        // alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// Copies `range` of `file` into fresh memory with `pread`, checking the
/// bytes against `crc` (non-zero) on the way.
pub fn copy_range(file: &File, range: Range<usize>, crc: u32, what: &str) -> Result<CopiedBytes> {
    let len = range.len();
    let mut words = Vec::new();
    words
        .try_reserve_exact(len.div_ceil(16))
        .map_err(|_| Error::new(ErrorKind::NoSpace, format!("{what}: unable to allocate {len} bytes to copy it into")))?;
    // Zeroed by calloc: fresh pages cost nothing until the copy fills them.
    words.resize(len.div_ceil(16), 0u128);
    // SAFETY: the vector holds len.div_ceil(16) * 16 >= len initialized bytes.
    let dst = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) };
    copy_out::read_checked(file, range.start as u64, dst, crc, what)?;
    Ok(CopiedBytes { words, len })
}
