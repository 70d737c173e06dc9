//! The host-mapped records a kernel writes when it times out, and reading
//! them back.

use super::teardown;
use crate::cuda::driver::check;
use crate::error::Result;
use crate::symm::cuda_plan as plan;
use cudarc::driver::sys::{self, CUdeviceptr};
use std::ffi::c_void;
use std::sync::atomic::{fence, Ordering};

/// The host-mapped timeout records (see `cuda_signals.ptx`).
pub(super) struct HostRecords {
    pub(super) device: i32,
    pub(super) host: usize,
    pub(super) dev: CUdeviceptr,
}

impl HostRecords {
    pub(super) fn new(device: i32) -> Result<HostRecords> {
        let bytes = plan::RECORDS * plan::RECORD_BYTES;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: out-pointer ours.
        check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }, || "cuMemHostAlloc for the timeout records".to_string())?;
        let mut r = HostRecords { device, host: host as usize, dev: 0 };
        // SAFETY: `bytes` of pinned host memory just allocated.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        // SAFETY: mapped pinned memory; out-pointer ours.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut r.dev, host, 0) }, || {
            "cuMemHostGetDevicePointer for the timeout records".to_string()
        })?;
        Ok(r)
    }

    /// The first timeout a kernel recorded, clearing its record.
    pub(super) fn take(&self) -> Option<plan::DeviceTimeout> {
        // SAFETY: `host` holds RECORDS records of 8 words, mapped while self lives.
        unsafe { take_record(self.host as *mut u32) }
    }
}

/// Scans the records at `base` (RECORDS × 8 u32 words) for one a kernel
/// wrote, clears it and returns it. The device writes the records, so
/// every access is volatile; the state word is written last (release) on
/// the device, and read first here, before an acquire fence.
///
/// # Safety
/// `base` points at RECORDS × 8 readable and writable u32 words.
pub(super) unsafe fn take_record(base: *mut u32) -> Option<plan::DeviceTimeout> {
    let words_per = plan::RECORD_BYTES / 4;
    for rec in 0..plan::RECORDS {
        // SAFETY: inside the records, per the contract.
        let at = |i: usize| unsafe { base.add(rec * words_per + i) };
        // SAFETY: as above.
        if unsafe { std::ptr::read_volatile(at(0)) } != plan::RECORD_WRITTEN {
            continue;
        }
        fence(Ordering::Acquire);
        let mut words = [0u32; 8];
        for (i, w) in words.iter_mut().enumerate() {
            // SAFETY: as above.
            *w = unsafe { std::ptr::read_volatile(at(i)) };
        }
        // SAFETY: as above; the kernel that wrote this record has ended.
        unsafe { std::ptr::write_volatile(at(0), 0) };
        return plan::parse_record(words);
    }
    None
}

impl Drop for HostRecords {
    fn drop(&mut self) {
        let host = self.host as *mut c_void;
        // SAFETY: our allocation; no kernel uses it any more.
        teardown(self.device, || unsafe {
            sys::cuMemFreeHost(host);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_taken_one_at_a_time_and_cleared() {
        let mut mem = vec![0u32; plan::RECORDS * plan::RECORD_BYTES / 4];
        // SAFETY: the vector has exactly the records' size.
        assert_eq!(unsafe { take_record(mem.as_mut_ptr()) }, None);
        // Two kernels timed out: records 5 (a barrier) and 63 (a put).
        mem[5 * 8..6 * 8].copy_from_slice(&[2, 3, 2, 0, 1, 4, 7_000_000, 0]);
        mem[63 * 8..64 * 8].copy_from_slice(&[2, 1, 1, 0, 1, 9, 1, 0]);
        // A record still being written (state not 2) is not taken.
        mem[7 * 8] = 1;
        let first = unsafe { take_record(mem.as_mut_ptr()) }.unwrap();
        assert_eq!((first.op, first.send, first.peer, first.channel, first.elapsed_ns), ("barrier", false, 1, 4, 7_000_000));
        assert_eq!(mem[5 * 8], 0, "cleared");
        let second = unsafe { take_record(mem.as_mut_ptr()) }.unwrap();
        assert_eq!((second.op, second.send, second.channel), ("put_signal", true, 9));
        assert_eq!(unsafe { take_record(mem.as_mut_ptr()) }, None);
        assert_eq!(mem[7 * 8], 1, "the unfinished record is left alone");
    }
}
