//! The bytes the zip reader looks at: a whole file in memory, or only
//! the pieces of a file read from it with `pread` (its head and its
//! tail, where a torch.save storage file keeps every record but the
//! data). Reading pieces instead of mapping the file means a file that
//! someone else truncates meanwhile gives a short read (an error), never
//! a SIGBUS; and the data, often gigabytes, is not read to be parsed.

use std::borrow::Cow;

/// A file's length and the parts of it at hand.
pub struct Image<'a> {
    len: usize,
    /// (offset in the file, bytes), not overlapping.
    pieces: Vec<(usize, Cow<'a, [u8]>)>,
}

/// Why a range of an [`Image`] could not be had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// The range runs past the end of the file.
    PastEnd,
    /// The range lies (partly) in a part of the file not read.
    NotRead,
}

impl<'a> Image<'a> {
    /// All of `file`.
    pub fn whole(file: &'a [u8]) -> Image<'a> {
        Image { len: file.len(), pieces: vec![(0, Cow::Borrowed(file))] }
    }

    /// A file of `len` bytes of which only `pieces` (offset, bytes) were
    /// read; each must lie inside the file.
    pub fn from_pieces(len: usize, pieces: Vec<(usize, Vec<u8>)>) -> Image<'static> {
        debug_assert!(pieces.iter().all(|(at, b)| at + b.len() <= len));
        Image { len, pieces: pieces.into_iter().map(|(at, b)| (at, Cow::Owned(b))).collect() }
    }

    /// The file's length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every byte of the file is at hand.
    pub fn is_whole(&self) -> bool {
        self.pieces.iter().map(|p| p.1.len()).sum::<usize>() == self.len
    }

    /// Bytes `at..at + n` of the file.
    pub fn get(&self, at: usize, n: usize) -> Result<&[u8], Missing> {
        let end = at.checked_add(n).filter(|e| *e <= self.len).ok_or(Missing::PastEnd)?;
        self.pieces
            .iter()
            .find(|(start, b)| *start <= at && end <= start + b.len())
            .map(|(start, b)| &b[at - start..end - start])
            .ok_or(Missing::NotRead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_answer_only_what_they_hold() {
        let img = Image::from_pieces(100, vec![(0, vec![1; 10]), (90, vec![2; 10])]);
        assert_eq!(img.get(2, 3), Ok(&[1u8, 1, 1][..]));
        assert_eq!(img.get(95, 5), Ok(&[2u8; 5][..]));
        assert_eq!(img.get(8, 4), Err(Missing::NotRead));
        assert_eq!(img.get(50, 1), Err(Missing::NotRead));
        assert_eq!(img.get(99, 2), Err(Missing::PastEnd));
        assert_eq!(img.get(usize::MAX, 2), Err(Missing::PastEnd));
        assert!(!img.is_whole());
        let bytes = [7u8; 4];
        let whole = Image::whole(&bytes);
        assert!(whole.is_whole());
        assert_eq!(whole.get(0, 4), Ok(&bytes[..]));
        assert_eq!(whole.get(0, 0), Ok(&[][..]));
    }
}
