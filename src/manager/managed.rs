//! ManagedMapAllocator (libshm's THManagedMapAllocator): a refcounted
//! segment that is registered with a manager daemon *before* it is created
//! or opened, and reported freed after it is closed, so the manager can
//! remove it if this process dies holding it.

use super::{client_for, default_client, Client};
use crate::error::Result;
use crate::shm::RefcountedMapAllocator;
use std::sync::Arc;

/// A refcounted segment known to a manager. Dropping it closes it.
#[derive(Debug)]
pub struct ManagedMapAllocator {
    inner: RefcountedMapAllocator,
    client: Arc<Client>,
    closed: bool,
}

impl ManagedMapAllocator {
    /// Registers `name` with the manager at `manager_handle` (empty: this
    /// process's manager, spawned if it has none), then opens it as
    /// [`RefcountedMapAllocator::open`] does.
    pub fn open(manager_handle: &str, name: &str, flags: i32, size: usize) -> Result<Self> {
        Self::register_then(manager_handle, name, || RefcountedMapAllocator::open(name, flags, size))
    }

    /// Registers `name` as [`ManagedMapAllocator::open`] does, then creates
    /// it holding a copy of `bytes` ([`RefcountedMapAllocator::create_with`]:
    /// one pwrite pass instead of reserving and copying through the map).
    pub fn create_with(manager_handle: &str, name: &str, flags: i32, bytes: &[u8]) -> Result<Self> {
        Self::register_then(manager_handle, name, || RefcountedMapAllocator::create_with(name, flags, bytes))
    }

    fn register_then(manager_handle: &str, name: &str, map: impl FnOnce() -> Result<RefcountedMapAllocator>) -> Result<Self> {
        crate::shm::names::validate_shm_name(name)?;
        super::protocol::check_filename(name)?;
        let client = if manager_handle.is_empty() { default_client()? } else { client_for(manager_handle)? };
        client.register(name)?;
        match map() {
            Ok(inner) => Ok(ManagedMapAllocator { inner, client, closed: false }),
            Err(e) => {
                // We hold nothing: tell the manager so it does not watch it.
                let _ = client.free(name);
                Err(e)
            }
        }
    }

    /// Socket path of the manager this segment is registered with.
    pub fn manager_handle(&self) -> &str {
        self.client.path()
    }

    pub fn refcounted(&self) -> &RefcountedMapAllocator {
        &self.inner
    }

    pub fn data(&self) -> *mut u8 {
        self.inner.data()
    }

    pub fn len(&self) -> usize {
        self.inner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    pub fn filename(&self) -> &str {
        self.inner.filename()
    }

    /// Closes the segment (count −1, removed at 0), then tells the manager.
    /// The free message has no reply; a gone manager is not an error here.
    /// When this close removed the name, the free goes with the next
    /// message to that manager ([`Client::free_gone`]).
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let result = self.inner.close();
        let name = self.inner.filename();
        let _ = if self.inner.name_removed() { self.client.free_gone(name) } else { self.client.free(name) };
        result
    }
}

impl Drop for ManagedMapAllocator {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
