//! How many storage bytes a tensor view reaches, so a view that would
//! read past its storage is refused before anyone touches the bytes.

use super::meta::TensorMeta;
use crate::error::{Error, ErrorKind, Result};

/// Most dimensions a tensor may have (PyTorch's own limit is 64 too in
/// practice; it also bounds the metadata record).
pub const MAX_NDIM: usize = 64;

/// Bytes of storage the view needs: `(offset + sum((size_i - 1) *
/// stride_i) + 1) * itemsize`, or 0 for a view with no elements. Refuses,
/// with `kind`, mismatched shape and stride lengths, more than
/// [`MAX_NDIM`] dimensions, negative values and arithmetic overflow.
pub fn required_bytes(meta: &TensorMeta, kind: ErrorKind) -> Result<u64> {
    let bad = |why: String| Error::new(kind, format!("tensor view (storage {}): {why}", meta.storage_hash));
    if meta.shape.len() != meta.stride.len() {
        return Err(bad(format!("shape has {} dimensions but stride has {}", meta.shape.len(), meta.stride.len())));
    }
    if meta.shape.len() > MAX_NDIM {
        return Err(bad(format!("{} dimensions, more than {MAX_NDIM}", meta.shape.len())));
    }
    if meta.offset < 0 {
        return Err(bad(format!("negative storage offset {}", meta.offset)));
    }
    if let Some(s) = meta.shape.iter().find(|s| **s < 0) {
        return Err(bad(format!("negative size {s} in shape {:?}", meta.shape)));
    }
    if let Some(s) = meta.stride.iter().find(|s| **s < 0) {
        return Err(bad(format!("negative stride {s} in {:?} (not supported, as in PyTorch)", meta.stride)));
    }
    if meta.shape.contains(&0) {
        return Ok(0);
    }
    let overflow = || bad(format!("offset {} + shape {:?} x stride {:?} overflows", meta.offset, meta.shape, meta.stride));
    let mut last = meta.offset as u128;
    for (size, stride) in meta.shape.iter().zip(&meta.stride) {
        let reach = (*size as u128 - 1).checked_mul(*stride as u128).ok_or_else(overflow)?;
        last = last.checked_add(reach).ok_or_else(overflow)?;
    }
    let bytes = (last + 1).checked_mul(meta.dtype.itemsize() as u128).ok_or_else(overflow)?;
    u64::try_from(bytes).map_err(|_| overflow())
}

/// Checks that a storage of `nbytes` holds the view.
pub fn check_fits(meta: &TensorMeta, nbytes: u64, kind: ErrorKind) -> Result<()> {
    let need = required_bytes(meta, kind)?;
    if need > nbytes {
        return Err(Error::new(
            kind,
            format!(
                "tensor view offset {} shape {:?} stride {:?} of {} needs {need} bytes but storage {} has {nbytes}",
                meta.offset,
                meta.shape,
                meta.stride,
                meta.dtype.torch_name(),
                meta.storage_hash
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content_store::dtype::Dtype;

    fn view(offset: i64, shape: &[i64], stride: &[i64]) -> TensorMeta {
        TensorMeta { dtype: Dtype::Float32, storage_hash: "h".into(), offset, shape: shape.to_vec(), stride: stride.to_vec() }
    }

    #[test]
    fn extents() {
        assert_eq!(required_bytes(&view(0, &[], &[]), ErrorKind::Corrupt).unwrap(), 4);
        assert_eq!(required_bytes(&view(3, &[2, 3], &[3, 1]), ErrorKind::Corrupt).unwrap(), (3 + 3 + 2 + 1) * 4);
        assert_eq!(required_bytes(&view(1, &[3, 2], &[1, 3]), ErrorKind::Corrupt).unwrap(), (1 + 2 + 3 + 1) * 4);
        assert_eq!(required_bytes(&view(5, &[4, 0], &[1, 1]), ErrorKind::Corrupt).unwrap(), 0);
        assert_eq!(required_bytes(&view(0, &[4, 5], &[0, 0]), ErrorKind::Corrupt).unwrap(), 4);
        assert!(check_fits(&view(0, &[6], &[1]), 24, ErrorKind::Corrupt).is_ok());
        let e = check_fits(&view(0, &[7], &[1]), 24, ErrorKind::Corrupt).unwrap_err();
        assert!(e.message().contains("needs 28 bytes"), "{}", e.message());
    }

    #[test]
    fn refuses_bad_views() {
        let k = ErrorKind::Corrupt;
        for (v, why) in [
            (view(-1, &[1], &[1]), "negative storage offset"),
            (view(0, &[-2], &[1]), "negative size"),
            (view(0, &[2], &[-1]), "negative stride"),
            (view(0, &[2, 2], &[1]), "dimensions but stride"),
            (view(i64::MAX, &[2], &[i64::MAX]), "overflows"),
            (view(0, &[i64::MAX, i64::MAX, i64::MAX], &[i64::MAX, i64::MAX, i64::MAX]), "overflows"),
        ] {
            let e = required_bytes(&v, k).unwrap_err();
            assert_eq!(e.kind(), k);
            assert!(e.message().contains(why), "{why}: {}", e.message());
        }
        let many = view(0, &[1; 65], &[1; 65]);
        assert!(required_bytes(&many, k).unwrap_err().message().contains("more than 64"));
    }
}
