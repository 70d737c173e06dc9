//! Limbo: blocks the producer has freed while consumers still refer to
//! them. They are given back by a later collection once their counter is 0.

use super::sent::{PinnedBlock, SentData};
use crate::fork_safe::ForkSafeMutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Above this many blocks in limbo we warn once: every collection scans them.
pub const WARN_AFTER_BLOCKS_IN_LIMBO: usize = 1000;

pub struct Limbo {
    blocks: ForkSafeMutex<Vec<SentData>>,
    warned: AtomicBool,
}

impl Default for Limbo {
    fn default() -> Self {
        Limbo { blocks: ForkSafeMutex::new(Vec::new()), warned: AtomicBool::new(false) }
    }
}

impl Limbo {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<SentData>> {
        self.blocks.lock()
    }

    pub(crate) fn register_fork_lock(&'static self) {
        self.blocks.register();
    }

    /// Puts a block in limbo; warns once when limbo grows past the limit.
    pub fn add(&self, block: SentData) {
        let n = {
            let mut blocks = self.lock();
            blocks.push(block);
            blocks.len()
        };
        if n > WARN_AFTER_BLOCKS_IN_LIMBO && !self.warned.swap(true, Ordering::Relaxed) {
            crate::log::warn(&format!(
                "storage-sharing warning: more than {WARN_AFTER_BLOCKS_IN_LIMBO} CUDA blocks freed by this producer are still \
                 referenced by consumer processes; each collection now scans them all. Consumers should release \
                 shared CUDA memory as soon as they are done with it."
            ));
        }
    }

    /// Removes and returns the blocks no consumer refers to any more; the
    /// caller frees them outside the lock.
    pub fn take_released(&self) -> Vec<SentData> {
        let mut blocks = self.lock();
        let (done, pinned): (Vec<_>, Vec<_>) = std::mem::take(&mut *blocks).into_iter().partition(SentData::released);
        *blocks = pinned;
        done
    }

    /// Removes every block (teardown).
    pub fn take_all(&self) -> Vec<SentData> {
        std::mem::take(&mut *self.lock())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn warned(&self) -> bool {
        self.warned.load(Ordering::Relaxed)
    }

    pub fn report(&self) -> Vec<PinnedBlock> {
        self.lock()
            .iter()
            .map(|b| PinnedBlock {
                device: b.device,
                ptr: b.ptr,
                counter_name: b.counter_name().to_string(),
                slot: b.slot_index(),
                counter_value: b.counter_value(),
            })
            .collect()
    }
}
