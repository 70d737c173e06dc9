//! Where blocks go inside the segments of a pool: first fit, in segment
//! order, every block a multiple of 512 bytes at a 512-aligned offset
//! (segments are multiples of the device granularity, itself a multiple
//! of 512). Freed neighbours merge. Only offsets are kept here; the pool
//! maps them to addresses.

use super::options::BLOCK_ALIGN;
use std::collections::BTreeMap;

/// The free and used ranges of one segment.
#[derive(Debug)]
struct SegmentSpace {
    size: usize,
    free: BTreeMap<usize, usize>,
    used: BTreeMap<usize, usize>,
}

#[derive(Debug, Default)]
pub struct Placement {
    segments: Vec<SegmentSpace>,
}

/// Bytes a request of `nbytes` takes (a zero-byte request still gets a
/// block of its own, so its address is unique); `None` on overflow.
pub fn block_bytes(nbytes: usize) -> Option<usize> {
    nbytes.max(1).checked_next_multiple_of(BLOCK_ALIGN)
}

impl Placement {
    /// Adds an empty segment of `size` bytes; returns its index.
    pub fn add_segment(&mut self, size: usize) -> usize {
        let mut free = BTreeMap::new();
        free.insert(0, size);
        self.segments.push(SegmentSpace { size, free, used: BTreeMap::new() });
        self.segments.len() - 1
    }

    /// The first free place for `bytes` (a result of [`block_bytes`]):
    /// (segment, offset), marked used; `None` when no segment has room.
    pub fn place(&mut self, bytes: usize) -> Option<(usize, usize)> {
        for (index, seg) in self.segments.iter_mut().enumerate() {
            let found = seg.free.iter().find(|(_, len)| **len >= bytes).map(|(o, l)| (*o, *l));
            if let Some((offset, len)) = found {
                seg.free.remove(&offset);
                if len > bytes {
                    seg.free.insert(offset + bytes, len - bytes);
                }
                seg.used.insert(offset, bytes);
                return Some((index, offset));
            }
        }
        None
    }

    /// Frees the block at `offset` of `segment`; false when no block starts there.
    pub fn release(&mut self, segment: usize, offset: usize) -> bool {
        let Some(seg) = self.segments.get_mut(segment) else { return false };
        let Some(block) = seg.used.remove(&offset) else { return false };
        let (mut start, mut len) = (offset, block);
        if let Some((&prev, &plen)) = seg.free.range(..offset).next_back() {
            if prev + plen == offset {
                seg.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        if let Some(next_len) = seg.free.remove(&(offset + block)) {
            len += next_len;
        }
        seg.free.insert(start, len);
        true
    }

    /// Bytes in use (blocks) over all segments.
    pub fn used_bytes(&self) -> usize {
        self.segments.iter().flat_map(|s| s.used.values()).sum()
    }

    /// Whether a block of `segment` starts at `offset`.
    pub fn is_block(&self, segment: usize, offset: usize) -> bool {
        self.segments.get(segment).is_some_and(|s| s.used.contains_key(&offset))
    }

    pub fn segment_size(&self, segment: usize) -> Option<usize> {
        self.segments.get(segment).map(|s| s.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_aligned_and_merging() {
        let mut p = Placement::default();
        assert_eq!(p.place(512), None);
        p.add_segment(4096);
        let a = p.place(block_bytes(100).unwrap()).unwrap();
        let b = p.place(block_bytes(1000).unwrap()).unwrap();
        let c = p.place(block_bytes(0).unwrap()).unwrap();
        assert_eq!((a, b, c), ((0, 0), (0, 512), (0, 1536)));
        assert_eq!(p.place(4096), None);
        p.add_segment(8192);
        assert_eq!(p.place(4096), Some((1, 0)));
        assert!(p.release(0, 512));
        assert!(!p.release(0, 512), "double free");
        assert!(!p.release(0, 100), "not a block start");
        assert_eq!(p.place(1024), Some((0, 512)), "first fit reuses the hole");
        assert!(p.release(0, 0) && p.release(0, 512) && p.release(0, 1536));
        assert_eq!(p.place(4096), Some((0, 0)), "freed neighbours merged back into one range");
        assert_eq!(p.used_bytes(), 8192);
        assert_eq!(block_bytes(usize::MAX), None);
    }
}
