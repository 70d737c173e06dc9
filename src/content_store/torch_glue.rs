//! The PyTorch format's file bodies. They come from `torch_format`
//! (branch content-torch); until that module is part of the build, every
//! PyTorch-format operation fails with `Unsupported` and says so. Branch
//! content-core-torch holds the wiring to it.

use super::meta::TensorMeta;
use crate::error::{Error, ErrorKind, Result};
use std::ops::Range;

const MISSING: &str = "the PyTorch content-store format is not in this build (module content_store::torch_format, branch content-torch)";

fn missing() -> Error {
    Error::new(ErrorKind::Unsupported, MISSING)
}

/// Refuses before anything is written.
pub fn check_available() -> Result<()> {
    Err(missing())
}

pub fn write_storage_file(_f: &mut std::fs::File, _data: &[u8]) -> std::io::Result<()> {
    Err(std::io::Error::other(MISSING))
}

pub fn tensor_file(_meta: &TensorMeta) -> Vec<u8> {
    Vec::new()
}

pub fn storage_data_range(_file: &[u8]) -> Result<Range<usize>> {
    Err(missing())
}

pub fn parse_tensor_file(_file: &[u8]) -> Result<TensorMeta> {
    Err(missing())
}
