//! What a tensor entry records, whatever the on-disk format.

use super::dtype::Dtype;

/// A tensor entry: a view (dtype, offset, shape, stride) of a stored
/// storage named by its content hash. Offset, shape and stride count
/// elements, as in PyTorch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub dtype: Dtype,
    pub storage_hash: String,
    pub offset: i64,
    pub shape: Vec<i64>,
    pub stride: Vec<i64>,
}
