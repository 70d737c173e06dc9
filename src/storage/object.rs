//! The storage object: a byte buffer, what holds its bytes (heap, an
//! fd-backed segment, a managed refcounted segment), and strong and weak
//! references to it (ATen's StorageImpl with intrusive_ptr/weak_intrusive_ptr).

use super::heap::HeapBuf;
use crate::arena::Arena;
use crate::error::{Error, ErrorKind, Result};
use crate::manager::ManagedMapAllocator;
use crate::shm::MapAllocator;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

/// What holds a storage's bytes.
#[derive(Debug)]
pub enum Allocation {
    /// Private heap memory: not shared yet.
    Heap(HeapBuf),
    /// An fd-backed segment (nameless, flags 86 or 58): shared by fd.
    Fd(MapAllocator),
    /// A refcounted segment registered with a manager: shared by name.
    Managed(ManagedMapAllocator),
    /// A block of a shareable arena (already in shared memory).
    Arena(ArenaBlock),
}

/// A storage's block in an [`Arena`]; dropping it frees the block.
#[derive(Debug)]
pub struct ArenaBlock {
    arena: Arena,
    ptr: *mut u8,
}

// SAFETY: the block is owned by this value alone; the arena locks itself.
unsafe impl Send for ArenaBlock {}
// SAFETY: as above; `&self` only reads the pointer.
unsafe impl Sync for ArenaBlock {}

impl ArenaBlock {
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for ArenaBlock {
    fn drop(&mut self) {
        // Only fails for a pointer the arena does not know, which this
        // value's construction rules out.
        let _ = self.arena.free(self.ptr);
    }
}

impl Allocation {
    pub(crate) fn data(&self) -> *mut u8 {
        match self {
            Allocation::Heap(h) => h.data(),
            Allocation::Fd(m) => m.data(),
            Allocation::Managed(m) => m.data(),
            Allocation::Arena(b) => b.ptr,
        }
    }
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) alloc: Allocation,
    pub(crate) nbytes: usize,
    pub(crate) resizable: bool,
}

#[derive(Debug)]
pub(crate) struct Inner {
    state: RwLock<State>,
}

/// A strong reference to a storage. Clones share the same bytes.
///
/// Thread safety: every method takes `&self` and may run on any thread.
/// Moving a storage into shared memory (`share_fd`, `share_filename`)
/// changes its data pointer: pointers obtained from [`Storage::data`]
/// before that point at freed memory afterwards. That is the caller's
/// concern, as in ATen.
#[derive(Clone, Debug)]
pub struct Storage(pub(crate) Arc<Inner>);

/// A weak reference: does not keep the bytes alive.
#[derive(Clone, Debug)]
pub struct WeakStorage(Weak<Inner>);

impl Storage {
    /// A resizable storage of `nbytes` zero bytes on the heap.
    pub fn new(nbytes: usize) -> Result<Self> {
        Ok(Self::from_allocation(Allocation::Heap(HeapBuf::new(nbytes)?), nbytes, true))
    }

    /// A storage of `nbytes` bytes in a new block of `arena` (shared
    /// memory from birth; not resizable). Blocks above the arena's large
    /// threshold fill a segment of their own, which
    /// [`Storage::share_fd`] then hands out with no copy.
    pub fn new_in_arena(arena: &Arena, nbytes: usize) -> Result<Self> {
        let ptr = arena.alloc(nbytes, 64)?;
        Ok(Self::from_allocation(Allocation::Arena(ArenaBlock { arena: arena.clone(), ptr }), nbytes, false))
    }

    /// A heap storage holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let heap = HeapBuf::new(bytes.len())?;
        if !bytes.is_empty() {
            // SAFETY: heap holds bytes.len() bytes and does not overlap bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), heap.data(), bytes.len()) };
        }
        Ok(Self::from_allocation(Allocation::Heap(heap), bytes.len(), true))
    }

    pub(crate) fn from_allocation(alloc: Allocation, nbytes: usize, resizable: bool) -> Self {
        Storage(Arc::new(Inner { state: RwLock::new(State { alloc, nbytes, resizable }) }))
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, State> {
        // Every critical section leaves State consistent before anything
        // that could panic, so a poisoned lock still holds valid data.
        self.0.state.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.0.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Start of the bytes (null for an empty storage).
    pub fn data(&self) -> *mut u8 {
        self.read().alloc.data()
    }

    pub fn nbytes(&self) -> usize {
        self.read().nbytes
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let s = self.read();
        if s.nbytes == 0 {
            return Vec::new();
        }
        // SAFETY: the allocation holds nbytes bytes while the lock is held.
        unsafe { std::slice::from_raw_parts(s.alloc.data(), s.nbytes) }.to_vec()
    }

    /// Copies `bytes` in at `offset`.
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        let s = self.read();
        if offset.checked_add(bytes.len()).map_or(true, |end| end > s.nbytes) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("write of {} bytes at offset {offset} past the end of a {}-byte storage", bytes.len(), s.nbytes),
            ));
        }
        if !bytes.is_empty() {
            // SAFETY: range checked above; other writers are the caller's concern.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), s.alloc.data().add(offset), bytes.len()) };
        }
        Ok(())
    }

    /// Whether the bytes live in shared memory (fd-backed or managed).
    pub fn is_shared(&self) -> bool {
        !matches!(self.read().alloc, Allocation::Heap(_))
    }

    pub fn resizable(&self) -> bool {
        self.read().resizable
    }

    /// Changes the size of a heap storage, keeping the common prefix and
    /// zero-filling the rest. Shared storages cannot be resized.
    pub fn resize(&self, nbytes: usize) -> Result<()> {
        let mut s = self.write();
        if !s.resizable || !matches!(s.alloc, Allocation::Heap(_)) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "Trying to resize storage that is not resizable ({} bytes, shared: {})",
                    s.nbytes,
                    !matches!(s.alloc, Allocation::Heap(_))
                ),
            ));
        }
        let new = HeapBuf::new(nbytes)?;
        let keep = nbytes.min(s.nbytes);
        if keep > 0 {
            // SAFETY: both buffers hold at least `keep` bytes.
            unsafe { std::ptr::copy_nonoverlapping(s.alloc.data(), new.data(), keep) };
        }
        s.alloc = Allocation::Heap(new);
        s.nbytes = nbytes;
        Ok(())
    }

    /// A weak reference to this storage.
    pub fn downgrade(&self) -> WeakStorage {
        WeakStorage(Arc::downgrade(&self.0))
    }

    /// Number of strong references.
    pub fn strong_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Whether `self` and `other` are the same storage.
    pub fn ptr_eq(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Replaces the allocation (after a copy into shared memory); the old
    /// one is released when the write lock is gone.
    pub(crate) fn swap_in(s: &mut State, alloc: Allocation) -> Allocation {
        s.resizable = false;
        std::mem::replace(&mut s.alloc, alloc)
    }
}

// Storages are shared between threads (the C API promises it).
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Storage>();
    send_sync::<WeakStorage>();
};

impl WeakStorage {
    /// A strong reference if the storage is still alive.
    pub fn upgrade(&self) -> Option<Storage> {
        self.0.upgrade().map(Storage)
    }

    /// True when no strong reference is left (ATen's `use_count() == 0`).
    pub fn expired(&self) -> bool {
        self.0.strong_count() == 0
    }
}
