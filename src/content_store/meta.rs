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

/// PyTorch's lazy view bits of a tensor entry (the `metadata` dict that
/// `torch._utils.get_tensor_metadata` gives): with `conj` the values are
/// the complex conjugates of the stored ones, with `neg` their negations.
/// The storage itself holds the bytes before either applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ViewBits {
    pub conj: bool,
    pub neg: bool,
}
