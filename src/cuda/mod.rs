//! CUDA IPC with cross-process reference counts, compatible with PyTorch's
//! `torch.multiprocessing` sharing of CUDA storages (docs/pytorch-compat.md).
//!
//! A producer shares device memory as PyTorch's 8-field tuple
//! ([`IpcHandle`]); a consumer in another process (ours or PyTorch) opens
//! it, and decrements a slot in the producer's ref-counter file when done.
//! The producer frees a block only once that counter is 0; until then the
//! block waits in limbo. The driver is loaded at run time: without it every
//! device call fails with `CudaUnavailable` and the reason.

pub mod backend;
pub mod counters;
pub mod cuda_backend;
pub mod driver;
pub mod global;
pub mod handle;
pub mod ipc;
pub mod limbo;
pub mod pool;
pub mod received;
pub mod sent;
pub mod vmm;

#[cfg(test)]
mod host_backend;
#[cfg(test)]
mod tests;

pub use backend::IpcBackend;
pub use counters::release_slot as release_ipc_counter;
pub use cuda_backend::CudaBackend;
pub use driver::check_available;
pub use global::{device_alloc, device_free, global, teardown};
pub use handle::IpcHandle;
pub use ipc::{CudaIpc, TeardownReport};
pub use received::Received;
pub use sent::{Deleter, PinnedBlock, SentData};
