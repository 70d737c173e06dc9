//! The manifest: the segments of a pool, the storages placed in them and
//! the named tensors (views) over those storages. The producer encodes it
//! once at export; a consumer decodes and validates it before mapping
//! anything, since its bytes come from another process: every count and
//! length is bounded before anything is allocated, every storage lies
//! inside its segment and every tensor inside its storage (with
//! overflow-checked arithmetic), names are unique UTF-8, dtypes known.

use crate::content_store::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use std::collections::HashSet;

/// First bytes of an encoded manifest (and its format version).
pub const MAGIC: &[u8; 8] = b"SSPMAN01";
/// Most segments: they travel as descriptors of one message, less the control
/// block's and the consumer's hold slot's.
pub const MAX_SEGMENTS: usize = crate::fdpass::MAX_FDS_PER_MESSAGE - 2;
/// Most tensors (and storages) of one manifest.
pub const MAX_TENSORS: usize = 1 << 20;
/// Longest tensor name, in bytes.
pub const MAX_NAME: usize = 4096;
/// Most dimensions of one tensor.
pub const MAX_NDIM: usize = 64;
/// Longest segment handle (a shm name, or a 64-byte CUDA IPC handle).
pub const MAX_HANDLE: usize = 255;
/// Largest encoded manifest a consumer accepts.
pub const MAX_BYTES: usize = 256 << 20;

/// One segment: its size, and for the Legacy kind the handle that opens
/// it (empty for the Vmm kind, whose segments travel as descriptors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentEntry {
    pub size: u64,
    pub handle: Vec<u8>,
}

/// One storage: `nbytes` bytes at `offset` of segment `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageEntry {
    pub segment: u32,
    pub offset: u64,
    pub nbytes: u64,
}

/// One named tensor: a view of storage `storage`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub storage: u32,
    pub dtype: Dtype,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    /// In elements, as PyTorch counts it.
    pub storage_offset: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifest {
    pub segments: Vec<SegmentEntry>,
    pub storages: Vec<StorageEntry>,
    pub tensors: Vec<TensorEntry>,
}

fn bad(kind: ErrorKind, msg: String) -> Error {
    Error::new(kind, msg)
}

/// Bytes a view needs in its storage, from its storage start: (offset +
/// the largest element index + 1) × itemsize, or 0 for an empty view.
/// Negative sizes, strides or offsets, and any overflow, are errors.
pub fn view_extent(sizes: &[i64], strides: &[i64], storage_offset: i64, itemsize: usize) -> std::result::Result<u64, String> {
    if sizes.len() != strides.len() {
        return Err(format!("{} sizes but {} strides", sizes.len(), strides.len()));
    }
    if sizes.len() > MAX_NDIM {
        return Err(format!("{} dimensions, at most {MAX_NDIM}", sizes.len()));
    }
    if storage_offset < 0 {
        return Err(format!("negative storage offset {storage_offset}"));
    }
    if let Some(s) = sizes.iter().find(|s| **s < 0) {
        return Err(format!("negative size {s}"));
    }
    if let Some(s) = strides.iter().find(|s| **s < 0) {
        return Err(format!("negative stride {s}"));
    }
    if sizes.contains(&0) {
        return Ok(0);
    }
    let overflow = || "the view's extent overflows".to_string();
    let mut last: u64 = storage_offset as u64;
    for (size, stride) in sizes.iter().zip(strides) {
        let step = ((*size - 1) as u64).checked_mul(*stride as u64).ok_or_else(overflow)?;
        last = last.checked_add(step).ok_or_else(overflow)?;
    }
    last.checked_add(1).and_then(|n| n.checked_mul(itemsize as u64)).ok_or_else(overflow)
}

impl Manifest {
    /// Checks the structure; `kind` is the error kind to report
    /// (`InvalidArgument` for the producer's own input, `Protocol` for bytes
    /// from a peer).
    pub fn validate(&self, kind: ErrorKind) -> Result<()> {
        if self.segments.len() > MAX_SEGMENTS {
            return Err(bad(kind, format!("manifest has {} segments, at most {MAX_SEGMENTS}", self.segments.len())));
        }
        if self.tensors.len() > MAX_TENSORS || self.storages.len() > MAX_TENSORS {
            return Err(bad(
                kind,
                format!("manifest has {} tensors and {} storages, at most {MAX_TENSORS}", self.tensors.len(), self.storages.len()),
            ));
        }
        for (i, seg) in self.segments.iter().enumerate() {
            if seg.size == 0 || seg.size > isize::MAX as u64 {
                return Err(bad(kind, format!("segment {i} has a size of {} bytes", seg.size)));
            }
            if seg.handle.len() > MAX_HANDLE {
                return Err(bad(kind, format!("segment {i} has a handle of {} bytes, at most {MAX_HANDLE}", seg.handle.len())));
            }
        }
        for (i, st) in self.storages.iter().enumerate() {
            if st.nbytes == 0 {
                continue;
            }
            let seg = self.segments.get(st.segment as usize).ok_or_else(|| {
                bad(kind, format!("storage {i} lies in segment {}, but there are {} segments", st.segment, self.segments.len()))
            })?;
            let end = st.offset.checked_add(st.nbytes);
            if !matches!(end, Some(e) if e <= seg.size) {
                return Err(bad(
                    kind,
                    format!(
                        "storage {i} ({} bytes at offset {}) lies outside segment {} of {} bytes",
                        st.nbytes, st.offset, st.segment, seg.size
                    ),
                ));
            }
        }
        let mut names = HashSet::with_capacity(self.tensors.len());
        for t in &self.tensors {
            if t.name.is_empty() || t.name.len() > MAX_NAME {
                return Err(bad(kind, format!("tensor name of {} bytes (1 to {MAX_NAME})", t.name.len())));
            }
            if t.name.contains('\0') {
                return Err(bad(kind, format!("tensor name {:?} holds a NUL byte", t.name)));
            }
            if !names.insert(t.name.as_str()) {
                return Err(bad(kind, format!("tensor name {:?} appears twice", t.name)));
            }
            let st = self.storages.get(t.storage as usize).ok_or_else(|| {
                bad(kind, format!("tensor {:?} uses storage {}, but there are {} storages", t.name, t.storage, self.storages.len()))
            })?;
            let need = view_extent(&t.sizes, &t.strides, t.storage_offset, t.dtype.itemsize())
                .map_err(|why| bad(kind, format!("tensor {:?}: {why}", t.name)))?;
            if need > st.nbytes {
                return Err(bad(
                    kind,
                    format!("tensor {:?} reaches {need} bytes into its storage, which holds {} bytes", t.name, st.nbytes),
                ));
            }
        }
        Ok(())
    }

    /// The wire form (little-endian).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.tensors.len() * 96);
        out.extend_from_slice(MAGIC);
        for n in [self.segments.len(), self.storages.len(), self.tensors.len()] {
            out.extend_from_slice(&(n as u32).to_le_bytes());
        }
        for s in &self.segments {
            out.extend_from_slice(&s.size.to_le_bytes());
            out.extend_from_slice(&(s.handle.len() as u16).to_le_bytes());
            out.extend_from_slice(&s.handle);
        }
        for s in &self.storages {
            out.extend_from_slice(&s.segment.to_le_bytes());
            out.extend_from_slice(&s.offset.to_le_bytes());
            out.extend_from_slice(&s.nbytes.to_le_bytes());
        }
        for t in &self.tensors {
            out.extend_from_slice(&(t.name.len() as u16).to_le_bytes());
            out.extend_from_slice(t.name.as_bytes());
            out.extend_from_slice(&t.storage.to_le_bytes());
            out.extend_from_slice(&t.dtype.code().to_le_bytes());
            out.push(t.sizes.len() as u8);
            for v in t.sizes.iter().chain(&t.strides) {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&t.storage_offset.to_le_bytes());
        }
        out
    }

    /// Decodes and validates bytes from a peer; every failure is a
    /// `Protocol` error saying what was wrong.
    pub fn decode(bytes: &[u8]) -> Result<Manifest> {
        if bytes.len() > MAX_BYTES {
            return Err(bad(ErrorKind::Protocol, format!("manifest of {} bytes, at most {MAX_BYTES}", bytes.len())));
        }
        let mut r = Reader { bytes, at: 0 };
        if r.take(8)? != MAGIC {
            return Err(bad(
                ErrorKind::Protocol,
                "manifest does not start with its magic bytes (not a pool manifest, or another version)".into(),
            ));
        }
        let (nseg, nst, nt) = (r.u32()? as usize, r.u32()? as usize, r.u32()? as usize);
        if nseg > MAX_SEGMENTS || nst > MAX_TENSORS || nt > MAX_TENSORS {
            return Err(bad(
                ErrorKind::Protocol,
                format!("manifest counts {nseg} segments, {nst} storages, {nt} tensors: above the limits"),
            ));
        }
        // Smallest encodings: segment 10 bytes, storage 20, tensor 2+1+4+4+1+8.
        let least = nseg * 10 + nst * 20 + nt * 20;
        if least > r.left() {
            return Err(bad(
                ErrorKind::Protocol,
                format!("manifest counts need at least {least} more bytes, {} are left (truncated?)", r.left()),
            ));
        }
        let mut m = Manifest { segments: Vec::with_capacity(nseg), storages: Vec::with_capacity(nst), tensors: Vec::with_capacity(nt) };
        for _ in 0..nseg {
            let size = r.u64()?;
            let len = r.u16()? as usize;
            m.segments.push(SegmentEntry { size, handle: r.take(len)?.to_vec() });
        }
        for _ in 0..nst {
            m.storages.push(StorageEntry { segment: r.u32()?, offset: r.u64()?, nbytes: r.u64()? });
        }
        for _ in 0..nt {
            let len = r.u16()? as usize;
            let name = std::str::from_utf8(r.take(len)?)
                .map_err(|_| bad(ErrorKind::Protocol, "a tensor name in the manifest is not UTF-8".into()))?
                .to_string();
            let storage = r.u32()?;
            let dtype = Dtype::from_code(r.i32()?).map_err(|e| bad(ErrorKind::Protocol, format!("tensor {name:?}: {e}")))?;
            let ndim = r.u8()? as usize;
            if ndim > MAX_NDIM {
                return Err(bad(ErrorKind::Protocol, format!("tensor {name:?} has {ndim} dimensions, at most {MAX_NDIM}")));
            }
            let sizes = (0..ndim).map(|_| r.i64()).collect::<Result<Vec<_>>>()?;
            let strides = (0..ndim).map(|_| r.i64()).collect::<Result<Vec<_>>>()?;
            let storage_offset = r.i64()?;
            m.tensors.push(TensorEntry { name, storage, dtype, sizes, strides, storage_offset });
        }
        if r.left() != 0 {
            return Err(bad(ErrorKind::Protocol, format!("manifest has {} bytes after its last tensor", r.left())));
        }
        m.validate(ErrorKind::Protocol)?;
        Ok(m)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(bad(
                ErrorKind::Protocol,
                format!("manifest is truncated: {n} bytes wanted at offset {}, {} left", self.at, self.left()),
            ));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take gave N bytes"))
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            segments: vec![SegmentEntry { size: 4096, handle: vec![] }, SegmentEntry { size: 8192, handle: b"/x".to_vec() }],
            storages: vec![StorageEntry { segment: 0, offset: 512, nbytes: 1024 }, StorageEntry { segment: 1, offset: 0, nbytes: 8192 }],
            tensors: vec![
                TensorEntry {
                    name: "w".into(),
                    storage: 0,
                    dtype: Dtype::Float32,
                    sizes: vec![16, 16],
                    strides: vec![16, 1],
                    storage_offset: 0,
                },
                TensorEntry {
                    name: "w.T".into(),
                    storage: 0,
                    dtype: Dtype::Float32,
                    sizes: vec![16, 16],
                    strides: vec![1, 16],
                    storage_offset: 0,
                },
                TensorEntry { name: "b".into(), storage: 1, dtype: Dtype::BFloat16, sizes: vec![10], strides: vec![2], storage_offset: 3 },
                TensorEntry {
                    name: "empty".into(),
                    storage: 1,
                    dtype: Dtype::Int64,
                    sizes: vec![0, 5],
                    strides: vec![5, 1],
                    storage_offset: 0,
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        m.validate(ErrorKind::InvalidArgument).unwrap();
        assert_eq!(Manifest::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn extents_are_overflow_safe() {
        assert_eq!(view_extent(&[2, 3], &[3, 1], 1, 4), Ok(28));
        assert_eq!(view_extent(&[0, 3], &[3, 1], 100, 4), Ok(0));
        assert_eq!(view_extent(&[], &[], 0, 2), Ok(2));
        assert!(view_extent(&[i64::MAX, 2], &[i64::MAX, 1], 0, 8).is_err());
        assert!(view_extent(&[2], &[i64::MAX], i64::MAX, 8).is_err());
        assert!(view_extent(&[2], &[-1], 5, 1).is_err());
        assert!(view_extent(&[2], &[1, 1], 0, 1).is_err());
    }

    fn refused(m: &Manifest, what: &str) {
        let e = Manifest::decode(&m.encode()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        assert!(e.message().contains(what), "{what:?} not in {e}");
    }

    #[test]
    fn hostile_manifests_are_refused() {
        let mut m = sample();
        m.storages[0].offset = 4000;
        refused(&m, "outside segment 0");
        let mut m = sample();
        m.storages[1].offset = u64::MAX - 10;
        refused(&m, "outside segment 1");
        let mut m = sample();
        m.storages[0].segment = 9;
        refused(&m, "there are 2 segments");
        let mut m = sample();
        m.tensors[0].sizes = vec![17, 16];
        refused(&m, "reaches 1088 bytes");
        let mut m = sample();
        m.tensors[2].strides = vec![i64::MAX];
        refused(&m, "overflows");
        let mut m = sample();
        m.tensors[1].name = "w".into();
        refused(&m, "appears twice");
        let mut m = sample();
        m.tensors[0].storage = 7;
        refused(&m, "uses storage 7");
        let mut m = sample();
        m.tensors[0].name = String::new();
        refused(&m, "tensor name of 0 bytes");
    }

    #[test]
    fn malformed_bytes_are_refused() {
        let bytes = sample().encode();
        for cut in [0, 7, 8, 19, bytes.len() - 1] {
            assert_eq!(Manifest::decode(&bytes[..cut]).unwrap_err().kind(), ErrorKind::Protocol, "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(Manifest::decode(&long).unwrap_err().message().contains("after its last tensor"));
        // Huge counts are refused before anything is allocated.
        let mut huge = bytes.clone();
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Manifest::decode(&huge).unwrap_err().message().contains("above the limits"));
        let mut many = bytes.clone();
        many[16..20].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(Manifest::decode(&many).unwrap_err().message().contains("truncated"));
        // A bad dtype code.
        let mut m = sample();
        m.tensors.truncate(1);
        let mut b = m.encode();
        let at = b.len() - (8 * 5 + 1 + 4);
        b[at..at + 4].copy_from_slice(&99i32.to_le_bytes());
        assert!(Manifest::decode(&b).unwrap_err().message().contains("dtype code 99"));
        // Names that are not UTF-8.
        let mut b = m.encode();
        let name_at = b.len() - (8 * 5 + 1 + 4 + 4 + 1);
        b[name_at] = 0xff;
        assert!(Manifest::decode(&b).unwrap_err().message().contains("not UTF-8"));
    }
}
