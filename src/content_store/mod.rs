//! Content store: content-addressed snapshots of storages and tensors
//! (PyTorch's `_content_store.py` layout: `storages/<hash>`,
//! `tensors/<name>`), in our own format or in PyTorch's.

pub mod bounds;
pub mod check;
mod copy_out;
pub mod dtype;
mod fork_aware;
mod fsio;
pub mod hash;
pub mod layout;
pub mod meta;
pub mod names;
pub mod pipeline;
pub mod reader;
pub mod record;
mod storage_io;
mod store_lock;
pub mod torch_default_hash;
pub mod torch_format;
mod torch_glue;
mod torch_hash_table;
pub mod writer;

pub use check::{gc, verify, GcReport, Problem, VerifyReport};
pub use dtype::Dtype;
pub use hash::{hash_hex, HashMode};
pub use layout::Format;
pub use meta::{TensorMeta, ViewBits};
pub use pipeline::{Digest, HashWhere, Pipeline};
pub use reader::{EntryListing, OddObject, Reader, StorageBytes, StorageFile, Tensor};
pub use writer::{WriteStats, Writer};
