//! The consumer side: memory opened from a peer's handle, cached per
//! handle so that several tuples naming one allocation map it once (a
//! second `cuIpcOpenMemHandle` of the same handle fails), unmapped when
//! the last user lets go.

use super::backend::RawHandle;
use crate::error::Result;
use crate::fork_safe::ForkSafeMutex;
use std::collections::HashMap;

/// One received storage (PyTorch's `CudaIPCReceivedData` plus what its
/// deleter needs). Give it back with [`super::CudaIpc::received_free`].
#[derive(Debug)]
pub struct Received {
    pub(crate) device: i32,
    /// Handle of the mapping in the cache; None for a storage without data.
    pub(crate) key: Option<RawHandle>,
    pub(crate) data: u64,
    pub(crate) size: u64,
    pub(crate) counter_name: String,
    pub(crate) slot: u64,
    pub(crate) stream: u64,
}

impl Received {
    /// Device address of the storage's first byte (0 without data).
    pub fn data(&self) -> u64 {
        self.data
    }

    /// Bytes of the storage.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn device(&self) -> i32 {
        self.device
    }
}

struct Mapping {
    base: u64,
    size: usize,
    users: usize,
}

/// Per-process map from (device, handle) to the opened mapping.
pub struct ReceivedCache {
    map: ForkSafeMutex<HashMap<(i32, RawHandle), Mapping>>,
}

impl Default for ReceivedCache {
    fn default() -> Self {
        ReceivedCache { map: ForkSafeMutex::new(HashMap::new()) }
    }
}

impl ReceivedCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(i32, RawHandle), Mapping>> {
        self.map.lock()
    }

    pub(crate) fn register_fork_lock(&'static self) {
        self.map.register();
    }

    /// One more user of the mapping of `handle`, opening it (with `open`,
    /// under the lock) if this process has not yet: (base, size).
    pub fn acquire(&self, device: i32, handle: &RawHandle, open: impl FnOnce() -> Result<(u64, usize)>) -> Result<(u64, usize)> {
        let mut map = self.lock();
        if let Some(m) = map.get_mut(&(device, *handle)) {
            m.users += 1;
            return Ok((m.base, m.size));
        }
        let (base, size) = open()?;
        map.insert((device, *handle), Mapping { base, size, users: 1 });
        Ok((base, size))
    }

    /// One user fewer; the last one unmaps with `close`.
    pub fn release(&self, device: i32, handle: &RawHandle, close: impl FnOnce(u64) -> Result<()>) -> Result<()> {
        let mut map = self.lock();
        let Some(m) = map.get_mut(&(device, *handle)) else { return Ok(()) };
        m.users -= 1;
        if m.users == 0 {
            let base = m.base;
            map.remove(&(device, *handle));
            return close(base);
        }
        Ok(())
    }

    /// Whether `ptr` on `device` lies in memory this process received.
    pub fn holds(&self, device: i32, ptr: u64) -> bool {
        self.lock().iter().any(|((d, _), m)| *d == device && ptr >= m.base && ptr < m.base + m.size as u64)
    }

    /// Mappings open now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
