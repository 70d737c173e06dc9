//! The process's symmetric allocations: plain and persistent blocks, keyed
//! by the buffer address handed to the caller, and each block's rendezvous
//! objects (one per group, so a second rendezvous returns the same one).
//!
//! Persistent allocations follow PyTorch's `empty_strided_p2p` with an
//! `alloc_id`: the block is kept for the life of the process; asking again
//! gives the same block, unless the previous use is still active (not
//! freed) or the size changed.

use super::backend::SymmBlock;
use super::group::get_group_info;
use super::handle::SymmetricMemory;
use super::registry::get_allocator;
use super::{rendezvous as rdv, DeviceType};
use crate::error::{Error, ErrorKind, Result};
use crate::fork_safe::ForkSafeMutex;
use crate::store::Timeout;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

struct Allocation {
    /// Rendezvous objects by group name (declared first: dropped first).
    handles: Mutex<HashMap<String, Arc<SymmetricMemory>>>,
    block: Box<dyn SymmBlock>,
    backend: String,
    device_type: DeviceType,
    device_idx: i32,
    alloc_id: Option<u64>,
    state: Mutex<State>,
}

struct State {
    /// The group given at allocation, used when rendezvous names none.
    group: Option<String>,
    /// False once a persistent block was freed (it stays mapped for reuse).
    active: bool,
}

#[derive(Default)]
struct Table {
    by_ptr: HashMap<usize, Arc<Allocation>>,
    by_id: HashMap<u64, usize>,
}

static TABLE: Lazy<ForkSafeMutex<Table>> = Lazy::new(|| ForkSafeMutex::new(Table::default()));

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn new_allocation(device_type: DeviceType, device_idx: i32, size: usize, group: Option<&str>, alloc_id: Option<u64>) -> Result<Allocation> {
    let allocator = get_allocator(device_type)?;
    let block = allocator.alloc(size, device_idx)?;
    Ok(Allocation {
        handles: Mutex::new(HashMap::new()),
        block,
        backend: allocator.name().to_string(),
        device_type,
        device_idx,
        alloc_id,
        state: Mutex::new(State { group: group.map(str::to_string), active: true }),
    })
}

/// A new block whose buffer holds `size` bytes on `device_type`
/// `device_idx`; `group` is the default group for its rendezvous.
/// Returns the buffer's address.
pub fn alloc(device_type: DeviceType, device_idx: i32, size: usize, group: Option<&str>) -> Result<*mut u8> {
    let a = new_allocation(device_type, device_idx, size, group, None)?;
    let ptr = a.block.buffer_ptr();
    TABLE.lock_static().by_ptr.insert(ptr as usize, Arc::new(a));
    Ok(ptr)
}

/// The persistent block `alloc_id`: made on first use, the same block on
/// later uses once the previous one was freed.
pub fn alloc_persistent(device_type: DeviceType, device_idx: i32, size: usize, group: Option<&str>, alloc_id: u64) -> Result<*mut u8> {
    let mut table = TABLE.lock_static();
    if let Some(&ptr) = table.by_id.get(&alloc_id) {
        let a = table.by_ptr[&ptr].clone();
        let mut st = lock(&a.state);
        if st.active {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "ss_symm_alloc_persistent: can not allocate with alloc_id == {alloc_id} because a previous \
                     allocation with the same alloc_id is still active."
                ),
            ));
        }
        let prev = a.block.layout().buffer_size;
        if prev != size {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!(
                    "ss_symm_alloc_persistent: requested allocation size ({size}) is different from the size of a \
                     previous allocation with the same alloc_id {prev}"
                ),
            ));
        }
        if (a.device_type, a.device_idx) != (device_type, device_idx) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "ss_symm_alloc_persistent: alloc_id {alloc_id} was allocated on {} device {}, not {device_type} device {device_idx}",
                    a.device_type, a.device_idx
                ),
            ));
        }
        st.active = true;
        if group.is_some() {
            st.group = group.map(str::to_string);
        }
        return Ok(ptr as *mut u8);
    }
    let a = new_allocation(device_type, device_idx, size, group, Some(alloc_id))?;
    let ptr = a.block.buffer_ptr();
    table.by_ptr.insert(ptr as usize, Arc::new(a));
    table.by_id.insert(alloc_id, ptr as usize);
    Ok(ptr)
}

/// Locks the block's rendezvous table, waiting while another thread runs a
/// rendezvous of the block, but no longer than `timeout` (None: forever).
fn lock_until<'a, T>(m: &'a Mutex<T>, timeout: Timeout, group: &str) -> Result<MutexGuard<'a, T>> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut pause = Duration::from_micros(100);
    loop {
        match m.try_lock() {
            Ok(g) => return Ok(g),
            Err(TryLockError::Poisoned(p)) => return Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        if deadline.is_some_and(|d| Instant::now() + pause > d) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "ss_symm_mem_rendezvous of group {group} timed out: another rendezvous of the same block (another \
                     thread) is still running"
                ),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// The live allocation at `ptr` (exactly a buffer address alloc gave).
fn live(ptr: *mut u8, what: &str) -> Result<Arc<Allocation>> {
    let table = TABLE.lock_static();
    match table.by_ptr.get(&(ptr as usize)) {
        Some(a) if lock(&a.state).active => Ok(a.clone()),
        _ => Err(Error::new(
            ErrorKind::NotFound,
            format!("{what}: {ptr:p} is not a live symmetric-memory allocation (not from ss_symm_alloc, or freed)"),
        )),
    }
}

/// Frees the block at `ptr` with its rendezvous objects. A persistent block
/// is only marked free: it stays for the next request of its `alloc_id`.
pub fn free(ptr: *mut u8) -> Result<()> {
    let a = live(ptr, "ss_symm_free")?;
    let mut table = TABLE.lock_static();
    if a.alloc_id.is_some() {
        lock(&a.state).active = false;
        return Ok(());
    }
    let removed = table.by_ptr.remove(&(ptr as usize));
    drop(table);
    drop(removed); // unmaps here, outside the table lock
    Ok(())
}

/// The size the caller asked for when allocating `ptr`.
pub fn get_alloc_size(ptr: *mut u8) -> Result<usize> {
    Ok(live(ptr, "ss_symm_get_alloc_size")?.block.layout().buffer_size)
}

/// The rendezvous object of the block at `ptr` in `group` (or the group
/// given at allocation), running the rendezvous on first use. It lives
/// until the block is freed.
pub fn rendezvous(ptr: *mut u8, group: Option<&str>, timeout: Timeout) -> Result<Arc<SymmetricMemory>> {
    let a = live(ptr, "ss_symm_mem_rendezvous")?;
    let name = match group {
        Some(g) => g.to_string(),
        None => lock(&a.state).group.clone().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                "ss_symm_mem_rendezvous: `group_name` is neither specified during allocation nor passed to rendezvous().",
            )
        })?,
    };
    let info = get_group_info(&name)?;
    let started = Instant::now();
    // Held through the rendezvous, so two threads do not run it twice.
    let mut handles = lock_until(&a.handles, timeout, &name)?;
    if let Some(h) = handles.get(&name) {
        return Ok(h.clone());
    }
    // What the wait for the lock left of the timeout.
    let left = timeout.map(|t| t.saturating_sub(started.elapsed()).max(Duration::from_millis(1)));
    let h = Arc::new(rdv::run(a.block.as_ref(), &a.backend, &info, left)?);
    handles.insert(name, h.clone());
    Ok(h)
}
