//! The process-wide "current pool", for PyTorch's `CUDAPluggableAllocator`
//! under a `torch.cuda.MemPool`: its malloc allocates in the current pool
//! (tensors are born there), and its free finds whichever live pool owns
//! the pointer (the registry of live pools is `inner`'s).

use super::options::PoolDevice;
use super::producer::Pool;
use crate::error::{Error, ErrorKind, Result};
use std::sync::{Arc, RwLock};

static CURRENT: RwLock<Option<Arc<Pool>>> = RwLock::new(None);

/// Makes `pool` the process's current pool (None: no current pool).
pub fn set_current(pool: Option<Arc<Pool>>) {
    *CURRENT.write().unwrap_or_else(|p| p.into_inner()) = pool;
}

/// The current pool, if any.
pub fn current() -> Option<Arc<Pool>> {
    CURRENT.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Allocates `nbytes` in the current pool, for `device` (checked against
/// the pool's: the host backend answers to device 0 or -1). The stream is
/// PyTorch's: blocks are not stream-ordered here.
pub fn alloc_in_current(nbytes: usize, device: i32, _stream: u64) -> Result<u64> {
    let pool = current()
        .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, "no current pool: allocate inside `pool.allocating()` (set_current) only"))?;
    let ok = match pool.device() {
        PoolDevice::Cuda(d) => d == device,
        PoolDevice::Host => device == 0 || device == -1,
    };
    if !ok {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("an allocation for device {device} asked of the current pool, which lives on {:?}", pool.device()),
        ));
    }
    pool.alloc(nbytes)
}

/// Frees `ptr` in whichever live pool holds it.
pub fn free_anywhere(ptr: u64) -> Result<()> {
    match super::inner::owner_of(ptr) {
        Some(p) => p.free_block(ptr),
        None => Err(Error::new(ErrorKind::InvalidArgument, format!("0x{ptr:x} is in no live pool of this process"))),
    }
}
