//! A mapping that is either plain or refcounted, as one C handle holds it,
//! and the way back from a data pointer to the object that owns it.

use super::{registry, MapAllocator, RefcountedMapAllocator};
use crate::error::{Error, ErrorKind, Result};

/// A [`MapAllocator`] or a [`RefcountedMapAllocator`]. Once an owner is
/// registered ([`Mapping::register_owner`]), [`owner_of`] finds it from
/// any pointer into the data, until the mapping is closed or dropped.
pub enum Mapping {
    Plain(MapAllocator),
    Refcounted(RefcountedMapAllocator),
}

impl Mapping {
    pub fn filename(&self) -> &str {
        match self {
            Mapping::Plain(m) => m.filename(),
            Mapping::Refcounted(m) => m.filename(),
        }
    }

    /// Start of the user data (after the header when refcounted); null
    /// once closed.
    pub fn data(&self) -> *mut u8 {
        match self {
            Mapping::Plain(m) => m.data(),
            Mapping::Refcounted(m) => m.data(),
        }
    }

    /// Bytes of user data (a refcounted mapping's header not counted).
    pub fn len(&self) -> usize {
        match self {
            Mapping::Plain(m) => m.len(),
            Mapping::Refcounted(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The descriptor a plain mapping kept (KEEPFD), else -1.
    pub fn fd(&self) -> i32 {
        match self {
            Mapping::Plain(m) => m.fd(),
            Mapping::Refcounted(_) => -1,
        }
    }

    pub fn flags(&self) -> i32 {
        match self {
            Mapping::Plain(m) => m.flags(),
            Mapping::Refcounted(m) => m.flags(),
        }
    }

    pub fn is_refcounted(&self) -> bool {
        matches!(self, Mapping::Refcounted(_))
    }

    /// The refcounted mapping, or `Unsupported` naming the plain one.
    pub fn refcounted(&self) -> Result<&RefcountedMapAllocator> {
        match self {
            Mapping::Refcounted(m) => Ok(m),
            Mapping::Plain(m) => Err(Error::new(
                ErrorKind::Unsupported,
                format!("<{}> is a plain mapping: reference counts need ss_map_open_refcounted", m.filename()),
            )),
        }
    }

    /// Records `owner` (an address the caller chooses, such as the handle
    /// holding this mapping) as the owner of the data range.
    pub fn register_owner(&self, owner: usize) {
        registry::register(self.data() as usize, self.len(), owner);
    }

    /// Forgets the owner, then unmaps as the allocator's `close` does.
    /// Closing twice does nothing.
    pub fn close(&mut self) -> Result<()> {
        let data = self.data();
        if !data.is_null() {
            registry::unregister(data as usize);
        }
        match self {
            Mapping::Plain(m) => m.close(),
            Mapping::Refcounted(m) => m.close(),
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// The owner registered for the live mapping whose data holds `addr` (its
/// start or any byte inside): ATen's `fromDataPtr`.
pub fn owner_of(addr: usize) -> Option<usize> {
    registry::lookup(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{flags, names::new_process_wide_shm_handle};

    #[test]
    fn owner_found_from_interior_pointer_until_close() {
        let name = new_process_wide_shm_handle();
        let m = MapAllocator::open(&name, flags::SHAREDMEM | flags::EXCLUSIVE, 4096).unwrap();
        let mut mapping = Mapping::Plain(m);
        mapping.register_owner(0xabc0);
        let data = mapping.data() as usize;
        assert_eq!(owner_of(data), Some(0xabc0));
        assert_eq!(owner_of(data + 4095), Some(0xabc0));
        assert_eq!(owner_of(data + 4096), None);
        mapping.close().unwrap();
        assert_eq!(owner_of(data), None);
        assert!(mapping.refcounted().is_err());
    }
}
