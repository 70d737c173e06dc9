//! A shareable pool of device memory whose tensors are shared whole
//! (docs/cuda-weights.md): the producer places a model's tensors in one or
//! a few segments, describes them in a manifest, exports once and updates
//! in place under a version protocol; each consumer process imports once
//! (one connection, one message) and reads versions it acquires.
//!
//! - [`options`]: device, kind, segment size, consumer slots;
//! - [`manifest`]: the tensors, their encoding and validation;
//! - [`placement`]: where blocks go in the segments;
//! - [`control`]: the version state and the consumers' hold slots;
//! - [`producer`]: the producer; `inner`: what its threads share (and
//!   the registry of live pools); `server`: its connection thread;
//! - [`import`]: the consumer ([`Weights`]);
//! - [`host_backend`] (host RAM; tests and CPU weights) and
//!   [`cuda_backend`] (CUDA VMM or legacy IPC): the device calls;
//! - [`current`]: the current pool of PyTorch's pluggable allocator.

pub mod backend;
pub mod control;
pub mod cuda_backend;
pub mod current;
pub mod handle;
pub mod host_backend;
pub mod import;
mod inner;
pub mod manifest;
pub mod options;
pub mod placement;
pub mod producer;
mod region;
mod server;
pub mod wire;

pub use crate::store::Timeout;
pub use current::{alloc_in_current, free_anywhere, set_current};
pub use handle::PoolHandle;
pub use import::{OpenTensor, Weights};
pub use options::{PoolDevice, PoolKind, PoolOptions};
pub use producer::{Pool, TensorSpec, UpdateGuard};

use crate::error::Result;
use backend::PoolBackend;
use std::sync::{Arc, Mutex, MutexGuard};

/// The backend for a device and kind (CUDA: `CudaUnavailable` without a driver).
pub(crate) fn backend_for(device: PoolDevice, kind: PoolKind) -> Result<Arc<dyn PoolBackend>> {
    match device {
        PoolDevice::Host => Ok(Arc::new(host_backend::HostBackend::new(kind))),
        PoolDevice::Cuda(index) => Ok(Arc::new(cuda_backend::CudaPoolBackend::new(index, kind)?)),
    }
}

/// Locks `m`; poisoning is ignored (the pool's state is whole between
/// statements that could panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
