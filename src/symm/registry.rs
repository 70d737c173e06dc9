//! The allocator registry: one allocator per device type and backend name,
//! with PyTorch's selection rules and messages (docs/pytorch-compat.md).
//!
//! - `set_backend(name)` picks a backend by name, before any allocation;
//!   afterwards it fails with "Backend can not be changed after use.".
//! - Without it, a CUDA allocation takes the backend named by the
//!   `TORCH_SYMMMEM` environment variable (`CUDA`, `NVSHMEM` or `NCCL`,
//!   default `CUDA`); a CPU allocation takes the CPU allocator. The library
//!   registers both its allocators itself: "CPU" and "CUDA" (which fails
//!   with `CudaUnavailable` and the reason where there is no driver).
//! - `is_finalizing()` turns true when the process exits, so that frees
//!   run by teardown code leave mappings alone.

use super::backend::SymmAllocator;
use super::cpu_backend::CpuAllocator;
use super::cuda_backend::CudaSymmAllocator;
use super::DeviceType;
use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use once_cell::sync::Lazy;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// The backend names `TORCH_SYMMMEM` may hold, as in PyTorch.
pub const TORCH_SYMMMEM_CHOICES: [&str; 3] = ["CUDA", "NVSHMEM", "NCCL"];

struct Registry {
    allocators: Vec<Arc<dyn SymmAllocator>>,
    /// The name given to `set_backend`, if any.
    chosen: Option<String>,
    /// Set by the first `get_allocator`: the backend is fixed from then on.
    used: bool,
}

static REGISTRY: Lazy<ForkSafeMutex<Registry>> = Lazy::new(|| {
    // Statics are never dropped: mark finalizing at exit instead.
    register_finalize_at_exit();
    ForkSafeMutex::new(Registry { allocators: vec![Arc::new(CpuAllocator), Arc::new(CudaSymmAllocator)], chosen: None, used: false })
});

static FINALIZING: AtomicBool = AtomicBool::new(false);

/// The atexit callback: [`begin_finalizing`] (it cannot panic; the catch
/// only keeps that true if it changes, as nothing may unwind into libc).
extern "C" fn finalize_at_exit() {
    let _ = std::panic::catch_unwind(begin_finalizing);
}

/// Registers [`finalize_at_exit`] with atexit, once per process.
fn register_finalize_at_exit() {
    static REGISTER: Once = Once::new();
    // SAFETY: atexit only stores the pointer to a function that takes and
    // returns nothing and never unwinds.
    REGISTER.call_once(|| unsafe {
        libc::atexit(finalize_at_exit);
    });
}

/// PyTorch's newest default signal pad: 32 channels x 72 ranks x 4 bytes.
pub const DEFAULT_SIGNAL_PAD_SIZE: usize = 32 * 72 * 4;
/// The largest pad `set_signal_pad_size` takes (a sanity bound, 1 GiB).
pub const MAX_SIGNAL_PAD_SIZE: usize = 1 << 30;

/// The signal pad size of the blocks allocated from now on. Written only
/// under the registry lock, before the first allocation.
static SIGNAL_PAD_SIZE: AtomicUsize = AtomicUsize::new(DEFAULT_SIGNAL_PAD_SIZE);

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock_static()
}

/// Registers `allocator` for its device type under its name, replacing an
/// earlier one with the same device type and name.
pub fn register_allocator(allocator: Arc<dyn SymmAllocator>) {
    let mut reg = registry();
    reg.allocators.retain(|a| !(a.device_type() == allocator.device_type() && a.name() == allocator.name()));
    reg.allocators.push(allocator);
}

/// Whether an allocator is registered for `device_type`.
pub fn has_allocator(device_type: DeviceType) -> bool {
    registry().allocators.iter().any(|a| a.device_type() == device_type)
}

/// Chooses the backend `name` for later allocations.
pub fn set_backend(name: &str) -> Result<()> {
    let mut reg = registry();
    if reg.used {
        return Err(Error::new(ErrorKind::Busy, "Backend can not be changed after use."));
    }
    if !reg.allocators.iter().any(|a| a.name() == name) {
        return Err(Error::new(ErrorKind::NotFound, format!("SymmetricMemory does not find allocation backend {name}")));
    }
    reg.chosen = Some(name.to_string());
    Ok(())
}

/// The backend chosen with `set_backend`, if any.
pub fn get_backend() -> Option<String> {
    registry().chosen.clone()
}

/// The backend name `TORCH_SYMMMEM` asks for CUDA allocations.
fn env_backend() -> Result<String> {
    match std::env::var("TORCH_SYMMMEM") {
        Err(_) => Ok("CUDA".to_string()),
        Ok(v) if TORCH_SYMMMEM_CHOICES.contains(&v.as_str()) => Ok(v),
        Ok(_) => {
            Err(Error::new(ErrorKind::InvalidArgument, "TORCH_SYMMMEM environment variable must be one of 'CUDA', 'NVSHMEM', 'NCCL'."))
        }
    }
}

/// The allocator for `device_type` under the rules above; fixes the backend.
pub fn get_allocator(device_type: DeviceType) -> Result<Arc<dyn SymmAllocator>> {
    let mut reg = registry();
    let candidates: Vec<Arc<dyn SymmAllocator>> = reg.allocators.iter().filter(|a| a.device_type() == device_type).cloned().collect();
    let wanted = match (&reg.chosen, device_type) {
        (Some(name), _) if candidates.iter().any(|a| a.name() == name) => name.clone(),
        (_, DeviceType::Cuda) => env_backend()?,
        _ => candidates.first().map(|a| a.name().to_string()).unwrap_or_default(),
    };
    let Some(found) = candidates.into_iter().find(|a| a.name() == wanted) else {
        return Err(no_allocator(device_type, &wanted));
    };
    reg.used = true;
    Ok(found)
}

fn no_allocator(device_type: DeviceType, wanted: &str) -> Error {
    match device_type {
        DeviceType::Cuda => Error::new(
            ErrorKind::Unsupported,
            format!(
                "SymmetricMemory does not support device type {device_type} with backend {wanted}: \
                 this library has the CUDA backend only (TORCH_SYMMMEM=CUDA, the default)"
            ),
        ),
        DeviceType::Cpu => Error::new(ErrorKind::Unsupported, format!("SymmetricMemory does not support device type {device_type}")),
    }
}

/// The signal pad size of new blocks (PyTorch's `get_signal_pad_size`).
pub fn signal_pad_size() -> usize {
    SIGNAL_PAD_SIZE.load(Ordering::Acquire)
}

/// Sets the signal pad size of the blocks to come (PyTorch's newest
/// `set_signal_pad_size`): a positive multiple of 4 bytes (u32 slots), at
/// most [`MAX_SIGNAL_PAD_SIZE`], before the first allocation of the process
/// (blocks of one rendezvous must agree, and every rank sets the same).
pub fn set_signal_pad_size(size: usize) -> Result<()> {
    if size == 0 || size % 4 != 0 || size > MAX_SIGNAL_PAD_SIZE {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("set_signal_pad_size: the size must be a positive multiple of 4 bytes, at most {MAX_SIGNAL_PAD_SIZE} (got {size})"),
        ));
    }
    let reg = registry();
    if reg.used {
        return Err(Error::new(
            ErrorKind::Busy,
            format!("set_signal_pad_size: the signal pad size can not be changed after the first allocation (it is {})", signal_pad_size()),
        ));
    }
    SIGNAL_PAD_SIZE.store(size, Ordering::Release);
    drop(reg);
    Ok(())
}

/// Whether the process is exiting (set by [`begin_finalizing`]).
pub fn is_finalizing() -> bool {
    FINALIZING.load(Ordering::Acquire)
}

/// Marks the process as exiting: from now on, freeing a block leaves its
/// mappings in place (other teardown code may still read them, and the
/// kernel unmaps everything at exit anyway).
pub fn begin_finalizing() {
    FINALIZING.store(true, Ordering::Release);
    crate::cuda::vmm::begin_finalizing();
}
