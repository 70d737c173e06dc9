//! What the producer keeps for each send until the consumer is done: the
//! slot, the original allocation (given back through a deleter) and the
//! event recorded for the consumer.

use super::counters::Slot;

/// Gives the original allocation back to its owner (say, a caching
/// allocator) once no consumer refers to it; gets the data pointer.
pub type Deleter = Box<dyn FnOnce(u64) + Send>;

/// One send, owned by the producer (PyTorch's `CudaIPCSentData`).
pub struct SentData {
    pub(crate) device: i32,
    pub(crate) ptr: u64,
    pub(crate) slot: Slot,
    pub(crate) event: Option<u64>,
    pub(crate) deleter: Option<Deleter>,
}

impl SentData {
    /// The consumer count in the slot: 1 after the send, 0 once released.
    pub fn counter_value(&self) -> i64 {
        self.slot.value()
    }

    /// Whether no consumer refers to the block any more (a counter below 0
    /// means a peer released twice; the block is not in use either way).
    pub fn released(&self) -> bool {
        self.counter_value() <= 0
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn counter_name(&self) -> &str {
        self.slot.file.name()
    }

    pub fn slot_index(&self) -> usize {
        self.slot.index
    }

    pub fn has_event(&self) -> bool {
        self.event.is_some()
    }
}

impl std::fmt::Debug for SentData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentData")
            .field("device", &self.device)
            .field("ptr", &format_args!("0x{:x}", self.ptr))
            .field("counter", &self.counter_name())
            .field("slot", &self.slot.index)
            .field("value", &self.counter_value())
            .field("event", &self.event.is_some())
            .finish()
    }
}

/// A block in limbo, as reported by [`super::CudaIpc::limbo_report`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedBlock {
    pub device: i32,
    pub ptr: u64,
    pub counter_name: String,
    pub slot: usize,
    pub counter_value: i64,
}
