//! Reading a store file that another local process may have grown, cut or
//! holed, without ever asking for more memory than the bytes that are
//! really there: reads go through a buffer of at most [`CHUNK`] bytes, a
//! longer field is allocated with `try_reserve` only after the file system
//! says it holds data (no hole) all along it, and a file that shrinks
//! under us is an error, not a short value.
//!
//! Every read is a `pread`: the file offset is left to appends
//! (`O_APPEND`), so this reader may share a descriptor with a writer.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Largest read made at once, and the length from which a field gets its
/// own allocation (checked for holes first).
pub const CHUNK: usize = 1 << 20;

/// Why a read stopped.
#[derive(Debug)]
pub enum ReadError {
    /// The operating system failed the read; `UnexpectedEof` when the file
    /// ended before the size seen when reading began (it shrank).
    Io(std::io::Error),
    /// The range runs into a hole at this offset: the file was grown by
    /// `truncate`, never by writes (stores only ever write whole values).
    Hole(u64),
    /// This process cannot allocate the bytes.
    NoMemory,
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// The first hole of `file` in `[from, to)`, when the file system reports
/// holes (one that does not reports none, and we go on reading).
pub fn first_hole(file: &File, from: u64, to: u64) -> Option<u64> {
    if from >= to {
        return None;
    }
    let start = libc::off_t::try_from(from).ok()?;
    // SAFETY: lseek on a descriptor we hold; it only moves the file offset,
    // which no read here (pread) and no append (O_APPEND) depends on.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), start, libc::SEEK_HOLE) };
    // Below 0: ENXIO (the file shrank below `from`) or EINVAL (no support).
    let hole = u64::try_from(hole).ok()?;
    (hole < to).then_some(hole)
}

/// A forward reader of `file` from an offset up to a fixed end (the size
/// seen when reading began).
pub struct Forward<'a> {
    file: &'a File,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    base: u64,
    /// Bytes of `buf` already handed out.
    used: usize,
    end: u64,
}

impl<'a> Forward<'a> {
    pub fn new(file: &'a File, from: u64, end: u64) -> Self {
        Forward { file, buf: Vec::new(), base: from, used: 0, end }
    }

    /// The offset of the next byte.
    pub fn pos(&self) -> u64 {
        self.base + self.used as u64
    }

    /// Bytes left before the end.
    pub fn left(&self) -> u64 {
        self.end.saturating_sub(self.pos())
    }

    /// The next 4 bytes as a host-order `u32` (the caller checked `left`).
    pub fn u32_ne(&mut self) -> Result<u32, ReadError> {
        self.fill(4)?;
        let bytes: [u8; 4] = self.buf[self.used..self.used + 4].try_into().expect("4 bytes buffered");
        self.used += 4;
        Ok(u32::from_ne_bytes(bytes))
    }

    /// The next `n` bytes (the caller checked `n <= left`).
    pub fn take(&mut self, n: u64) -> Result<Vec<u8>, ReadError> {
        if n <= CHUNK as u64 {
            let n = n as usize;
            self.fill(n)?;
            let out = self.buf[self.used..self.used + n].to_vec();
            self.used += n;
            return Ok(out);
        }
        let start = self.pos();
        if let Some(hole) = first_hole(self.file, start, start + n) {
            return Err(ReadError::Hole(hole));
        }
        let len = usize::try_from(n).map_err(|_| ReadError::NoMemory)?;
        let mut out = Vec::new();
        out.try_reserve_exact(len).map_err(|_| ReadError::NoMemory)?;
        let buffered = (self.buf.len() - self.used).min(len);
        out.extend_from_slice(&self.buf[self.used..self.used + buffered]);
        self.buf.clear();
        self.base = start + n;
        self.used = 0;
        // Within the reservation: no reallocation, and the zeros are
        // overwritten by the read right away.
        out.resize(len, 0);
        self.file.read_exact_at(&mut out[buffered..], start + buffered as u64)?;
        Ok(out)
    }

    /// Makes `n <= left` bytes readable at `buf[used..]`, reading up to
    /// [`CHUNK`] bytes ahead.
    fn fill(&mut self, n: usize) -> Result<(), ReadError> {
        if self.buf.len() - self.used >= n {
            return Ok(());
        }
        self.buf.drain(..self.used);
        self.base += self.used as u64;
        self.used = 0;
        let want = (CHUNK.max(n) as u64).min(self.end - self.base) as usize;
        let have = self.buf.len();
        self.buf.resize(want.max(n), 0);
        if let Err(e) = self.file.read_exact_at(&mut self.buf[have..], self.base + have as u64) {
            self.buf.truncate(have);
            return Err(e.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str, bytes: &[u8]) -> (File, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("ss-bounded-{}-{tag}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        (File::open(&path).unwrap(), path)
    }

    #[test]
    fn reads_small_and_large_fields_across_chunks() {
        let bytes: Vec<u8> = (0..3 * CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let (file, path) = temp("fields", &bytes);
        let mut r = Forward::new(&file, 3, bytes.len() as u64);
        assert_eq!(r.u32_ne().unwrap(), u32::from_ne_bytes(bytes[3..7].try_into().unwrap()));
        assert_eq!(r.take(CHUNK as u64 - 2).unwrap(), &bytes[7..7 + CHUNK - 2]);
        let big = 2 * CHUNK as u64;
        let at = r.pos() as usize;
        assert_eq!(r.take(big).unwrap(), &bytes[at..at + big as usize]);
        assert_eq!(r.take(r.left()).unwrap(), &bytes[at + big as usize..]);
        assert_eq!(r.left(), 0);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_file_that_shrank_is_an_eof_error() {
        let (file, path) = temp("shrank", &[1u8; 64]);
        let mut r = Forward::new(&file, 0, 4096);
        assert!(matches!(r.take(100), Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof));
        std::fs::remove_file(path).unwrap();
    }
}
