//! Symmetric memory (PyTorch's `c10d/symm_mem`): every rank of a group
//! allocates a block of the same size; after a rendezvous each rank holds a
//! pointer to every peer's buffer and signal pad, and synchronises with
//! barrier / put_signal / wait_signal.
//!
//! Pieces: the allocator [`registry`] (one allocator per device type and
//! backend name), [`group`] info (rank, world size, store), the
//! [`alloc`](mod@alloc)ation table (plain and persistent blocks, the rendezvous cache),
//! the [`rendezvous`](mod@rendezvous) itself (store all-gather + descriptor ring over
//! abstract-namespace Unix sockets), and the [`cpu_backend`], a real multi-process
//! backend in shared memory that PyTorch does not have, and the
//! [`cuda_backend`] (driver VMM and PTX signal kernels), both through the
//! traits of [`backend`].

/// Moved down to `fdpass` (the GPU weights pool uses it too); kept here by name.
pub use crate::fdpass::abstract_socket;
pub mod alloc;
pub mod backend;
pub mod collective_header;
pub mod cpu_backend;
pub mod cpu_collectives;
pub mod cuda_backend;
pub mod cuda_plan;
pub mod exchange;
pub mod group;
pub mod handle;
pub mod ipc_channel;
pub mod mapping;
pub mod reduce;
pub mod registry;
pub mod rendezvous;
pub mod request;
pub mod signals;

pub use alloc::{alloc, alloc_persistent, free, get_alloc_size, rendezvous};
pub use handle::SymmetricMemory;

use std::fmt;

/// The kind of device a block lives on (values are the C constants).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceType {
    Cpu = 0,
    Cuda = 1,
}

impl DeviceType {
    /// The device type of a C value, or an error naming it.
    pub fn from_code(code: i32) -> crate::Result<Self> {
        match code {
            0 => Ok(DeviceType::Cpu),
            1 => Ok(DeviceType::Cuda),
            other => Err(crate::Error::new(
                crate::ErrorKind::InvalidArgument,
                format!("unknown device type {other} (SS_DEVICE_CPU = 0, SS_DEVICE_CUDA = 1)"),
            )),
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceType::Cpu => "cpu",
            DeviceType::Cuda => "cuda",
        })
    }
}
