//! The CUDA backend of a pool (written for a GPU; built everywhere).

use super::backend::{MappedSegment, PoolBackend, PoolSegment, RecordedEvent, EVENT_BYTES};
use super::options::PoolKind;
use crate::error::{Error, ErrorKind, Result};
use std::os::fd::OwnedFd;

pub struct CudaPoolBackend {
    device: i32,
    kind: PoolKind,
}

impl CudaPoolBackend {
    pub fn new(device: i32, kind: PoolKind) -> Result<CudaPoolBackend> {
        crate::cuda::driver::check_available()?;
        Ok(CudaPoolBackend { device, kind })
    }

    fn todo(&self) -> Error {
        Error::new(
            ErrorKind::CudaUnavailable,
            format!("the CUDA pool backend ({:?} on device {}) is not built yet", self.kind, self.device),
        )
    }
}

impl PoolBackend for CudaPoolBackend {
    fn granularity(&self) -> usize {
        2 << 20
    }
    fn create_segment(&self, _size: usize) -> Result<Box<dyn PoolSegment>> {
        Err(self.todo())
    }
    fn import_fd(&self, _fd: OwnedFd, _size: usize, _what: &str) -> Result<Box<dyn MappedSegment>> {
        Err(self.todo())
    }
    fn import_handle(&self, _handle: &[u8], _size: usize, _what: &str) -> Result<Box<dyn MappedSegment>> {
        Err(self.todo())
    }
    fn record_event(&self, _stream: u64) -> Result<Option<RecordedEvent>> {
        Err(self.todo())
    }
    fn destroy_event(&self, _id: u64) {}
    fn wait_event(&self, _handle: &[u8; EVENT_BYTES], _stream: u64) -> Result<()> {
        Err(self.todo())
    }
    fn sync_stream(&self, _stream: u64) -> Result<()> {
        Err(self.todo())
    }
}
