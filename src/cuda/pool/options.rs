//! What a pool is made of: its device, how its segments are shared (the
//! kind), how large a new segment is, and how many consumers it admits.

use crate::error::{Error, ErrorKind, Result};

/// How the segments of a pool are handed to consumers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Segments made with `cuMemCreate`, exported as file descriptors
    /// (host backend: sealed memfds). The default.
    Vmm,
    /// Segments made with `cuMemAlloc` and shared with legacy IPC handles,
    /// so that stock PyTorch can open them (host backend: named POSIX shm).
    Legacy,
}

/// Where the memory of a pool lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolDevice {
    /// CUDA device of this ordinal.
    Cuda(i32),
    /// Host memory (the host backend: used by the tests, usable for CPU weights).
    Host,
}

/// Most consumer slots one pool may have (each is one cache line of the
/// control block, and one connection of the server thread).
pub const MAX_CONSUMERS: usize = 4096;

/// Alignment of every block, as PyTorch's caching allocator aligns.
pub const BLOCK_ALIGN: usize = 512;

/// The options of [`super::Pool::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolOptions {
    pub device: PoolDevice,
    pub kind: PoolKind,
    /// Bytes of a new segment (rounded up to the device's granularity); a
    /// larger request gets a segment of its own size.
    pub segment_size: usize,
    /// Most consumer processes connected at once.
    pub max_consumers: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions { device: PoolDevice::Cuda(0), kind: PoolKind::Vmm, segment_size: 256 << 20, max_consumers: 64 }
    }
}

impl PoolOptions {
    /// Checks the numbers; an error names the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.segment_size == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "pool segment_size must be above 0"));
        }
        if self.segment_size > isize::MAX as usize / 2 {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("pool segment_size {} is too large", self.segment_size)));
        }
        if self.max_consumers == 0 || self.max_consumers > MAX_CONSUMERS {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("pool max_consumers {} is out of range (1 to {MAX_CONSUMERS})", self.max_consumers),
            ));
        }
        if let PoolDevice::Cuda(d) = self.device {
            if d < 0 {
                return Err(Error::new(ErrorKind::InvalidArgument, format!("CUDA device index {d} is negative")));
            }
        }
        Ok(())
    }
}

impl PoolKind {
    /// The byte that stands for the kind in a handle or a hello.
    pub fn code(self) -> u8 {
        match self {
            PoolKind::Vmm => 0,
            PoolKind::Legacy => 1,
        }
    }

    pub fn from_code(code: u8) -> Result<PoolKind> {
        match code {
            0 => Ok(PoolKind::Vmm),
            1 => Ok(PoolKind::Legacy),
            _ => Err(Error::new(ErrorKind::InvalidArgument, format!("unknown pool kind {code} (0 = vmm, 1 = legacy)"))),
        }
    }
}

impl PoolDevice {
    /// (type, index): type 0 = CUDA, 1 = host (the C API's numbers).
    pub fn code(self) -> (i32, i32) {
        match self {
            PoolDevice::Cuda(d) => (0, d),
            PoolDevice::Host => (1, 0),
        }
    }

    pub fn from_code(device_type: i32, index: i32) -> Result<PoolDevice> {
        match device_type {
            0 if index >= 0 => Ok(PoolDevice::Cuda(index)),
            0 => Err(Error::new(ErrorKind::InvalidArgument, format!("CUDA device index {index} is negative"))),
            1 => Ok(PoolDevice::Host),
            _ => Err(Error::new(ErrorKind::InvalidArgument, format!("unknown pool device type {device_type} (0 = CUDA, 1 = host)"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_bad_numbers() {
        let o = PoolOptions::default();
        assert_eq!((o.device, o.kind, o.segment_size, o.max_consumers), (PoolDevice::Cuda(0), PoolKind::Vmm, 256 << 20, 64));
        o.validate().unwrap();
        let bad = [
            PoolOptions { segment_size: 0, ..o },
            PoolOptions { max_consumers: 0, ..o },
            PoolOptions { max_consumers: MAX_CONSUMERS + 1, ..o },
            PoolOptions { device: PoolDevice::Cuda(-1), ..o },
        ];
        for b in bad {
            assert_eq!(b.validate().unwrap_err().kind(), ErrorKind::InvalidArgument, "{b:?}");
        }
        assert_eq!(PoolKind::from_code(PoolKind::Legacy.code()).unwrap(), PoolKind::Legacy);
        assert!(PoolKind::from_code(7).is_err());
        assert_eq!(PoolDevice::from_code(1, 0).unwrap(), PoolDevice::Host);
        assert!(PoolDevice::from_code(2, 0).is_err());
    }
}
