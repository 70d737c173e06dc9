//! Content store: content-addressed snapshots of storages and tensors
//! (PyTorch's `_content_store.py` layout: `storages/<hash>`,
//! `tensors/<name>`), in our own format or in PyTorch's.

pub mod dtype;
pub mod meta;
pub mod torch_format;
