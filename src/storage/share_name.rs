//! Sharing by name through a manager (ATen's `_share_filename_cpu_`,
//! `_new_shared_filename_cpu`, `_new_using_filename_cpu`, `_shared_incref`,
//! `_shared_decref`).
//!
//! The reference protocol of `torch.multiprocessing`: the sender calls
//! [`Storage::shared_incref`] before sending the tuple (a +1 "in flight"
//! that keeps the segment alive if the sender drops its storage first);
//! the receiver opens it with [`Storage::new_shared_filename`] (+1 of its
//! own) and calls [`Storage::shared_decref`] to cancel the sender's +1.

use super::object::{Allocation, Storage};
use crate::error::{Error, ErrorKind, Result};
use crate::manager::ManagedMapAllocator;
use crate::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use crate::shm::new_process_wide_shm_handle;

/// What a receiver needs to open a storage shared by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilenameHandle {
    pub manager_handle: String,
    pub filename: String,
    pub nbytes: usize,
}

impl Storage {
    /// Moves the bytes into a new managed refcounted segment (flags 6,
    /// registered with this process's manager, spawned if needed) unless
    /// they are in one already, and returns its handle.
    pub fn share_filename(&self) -> Result<FilenameHandle> {
        {
            let s = self.read();
            if let Allocation::Managed(m) = &s.alloc {
                return Ok(handle_of(m, s.nbytes));
            }
        }
        let mut s = self.write();
        if let Allocation::Managed(m) = &s.alloc {
            return Ok(handle_of(m, s.nbytes));
        }
        // An empty storage gets a segment of the header alone, as in ATen.
        let bytes: &[u8] = if s.nbytes == 0 {
            &[]
        } else {
            // SAFETY: the allocation holds nbytes bytes and the write lock
            // keeps them still while they are copied.
            unsafe { std::slice::from_raw_parts(s.alloc.data(), s.nbytes) }
        };
        let m = ManagedMapAllocator::create_with("", &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, bytes)?;
        let handle = handle_of(&m, s.nbytes);
        let old = Storage::swap_in(&mut s, Allocation::Managed(m));
        drop(s);
        drop(old);
        Ok(handle)
    }

    /// Opens the segment `filename` of `nbytes` bytes shared by another
    /// process, registering with the manager at `manager_handle` first
    /// (flags 10: SHAREDMEM | NOCREATE; count + 1).
    pub fn new_shared_filename(manager_handle: &str, filename: &str, nbytes: usize) -> Result<Storage> {
        let m = ManagedMapAllocator::open(manager_handle, filename, SHAREDMEM | NOCREATE, nbytes)?;
        Ok(Storage::from_allocation(Allocation::Managed(m), nbytes, false))
    }

    /// A new managed segment of `nbytes` zero bytes (flags 6).
    pub fn new_using_filename(nbytes: usize) -> Result<Storage> {
        let m = ManagedMapAllocator::open("", &new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, nbytes)?;
        Ok(Storage::from_allocation(Allocation::Managed(m), nbytes, false))
    }

    /// The handle of a storage already shared by name.
    pub fn filename_handle(&self) -> Result<FilenameHandle> {
        let s = self.read();
        match &s.alloc {
            Allocation::Managed(m) => Ok(handle_of(m, s.nbytes)),
            _ => Err(not_managed("filename_handle")),
        }
    }

    /// Count + 1 in the segment header (the sender's in-flight reference).
    pub fn shared_incref(&self) -> Result<()> {
        match &self.read().alloc {
            Allocation::Managed(m) => m.refcounted().incref(),
            _ => Err(not_managed("shared_incref")),
        }
    }

    /// Count − 1 in the segment header (the receiver cancelling the
    /// sender's +1). As in ATen the name is not removed here, even at 0.
    pub fn shared_decref(&self) -> Result<()> {
        match &self.read().alloc {
            Allocation::Managed(m) => m.refcounted().decref().map(|_| ()),
            _ => Err(not_managed("shared_decref")),
        }
    }

    /// The count in the segment header.
    pub fn shared_refcount(&self) -> Result<i32> {
        match &self.read().alloc {
            Allocation::Managed(m) => m.refcounted().refcount(),
            _ => Err(not_managed("shared_refcount")),
        }
    }
}

fn handle_of(m: &ManagedMapAllocator, nbytes: usize) -> FilenameHandle {
    FilenameHandle { manager_handle: m.manager_handle().to_string(), filename: m.filename().to_string(), nbytes }
}

fn not_managed(what: &str) -> Error {
    Error::new(ErrorKind::Unsupported, format!("{what}: the storage is not shared by name (no managed segment)"))
}
