//! The host-side rules of the CUDA symmetric-memory backend, kept apart
//! from the driver calls so they are unit-tested on machines without a GPU:
//! the block layout, the overlapping-devices rule, the multicast decision,
//! the kernel launch shapes, the device timeout records, and the order in
//! which a block's driver objects are undone.

use super::backend::Layout;
use super::request::RendezvousRequest;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Timeout;

/// The buffer starts this far into the block at least (the pad is at 0):
/// the same page-aligned offset as the CPU backend (12288 for the default
/// 9216-byte pad).
pub const BUFFER_ALIGN: usize = 4096;

/// PyTorch's switch that lets several ranks of a group share one device.
pub const ALLOW_OVERLAPPING_ENV: &str = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES";
/// PyTorch's switch that turns multicast off.
pub const DISABLE_MULTICAST_ENV: &str = "TORCH_SYMM_MEM_DISABLE_MULTICAST";

/// Oldest driver API for multicast (PyTorch asks for CUDA 12.3).
pub const MULTICAST_MIN_DRIVER: i32 = 12030;

/// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` (CUDA 12.1; not in cudarc's
/// CUDA 12.0 bindings, so asked by number).
pub const ATTR_MULTICAST_SUPPORTED: i32 = 132;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub const ATTR_VMM_SUPPORTED: i32 = 102;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
pub const ATTR_POSIX_FD_SUPPORTED: i32 = 103;
/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
pub const ATTR_RDMA_WITH_VMM: i32 = 110;

/// The layout of a CUDA block: PyTorch's newest `[signal pad | buffer]`,
/// the buffer offset aligned, the buffer rounded to 16 bytes and the
/// whole block to the allocation granularity.
pub fn layout(size: usize, pad: usize, granularity: usize) -> Result<Layout> {
    if granularity == 0 || !granularity.is_power_of_two() {
        return Err(Error::new(ErrorKind::CudaError, format!("cuMemGetAllocationGranularity gave {granularity}, not a power of two")));
    }
    let too_large = || Error::new(ErrorKind::InvalidArgument, format!("symmetric block of {size} bytes is too large"));
    let buffer_offset = pad.checked_next_multiple_of(BUFFER_ALIGN).ok_or_else(too_large)?;
    let block_size = size
        .checked_next_multiple_of(16)
        .and_then(|s| s.checked_add(buffer_offset))
        .and_then(|s| s.checked_next_multiple_of(granularity))
        .ok_or_else(too_large)?;
    Ok(Layout { block_size, buffer_size: size, buffer_offset, signal_pad_size: pad })
}

/// Whether an on/off environment variable is on: set, and not empty, "0",
/// "false", "no" or "off" (any case).
pub fn env_flag_value(value: Option<&str>) -> bool {
    match value {
        None => false,
        Some(v) => !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "no" | "off"),
    }
}

/// [`env_flag_value`] of the variable `name`.
pub fn env_flag(name: &str) -> bool {
    env_flag_value(std::env::var(name).ok().as_deref())
}

/// The first two ranks that use the same device of the same host, if any.
pub fn overlapping_devices(requests: &[RendezvousRequest]) -> Option<(usize, usize, i32)> {
    for (j, b) in requests.iter().enumerate() {
        for (i, a) in requests.iter().enumerate().take(j) {
            if a.device_idx == b.device_idx && a.hostname == b.hostname {
                return Some((i, j, a.device_idx));
            }
        }
    }
    None
}

/// PyTorch's rule: ranks of a group use distinct devices unless
/// `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES` is on. Returns whether some
/// ranks share a device (allowed).
pub fn check_devices(requests: &[RendezvousRequest], group: &str, allow_overlapping: bool) -> Result<bool> {
    match overlapping_devices(requests) {
        None => Ok(false),
        Some(_) if allow_overlapping => Ok(true),
        Some((i, j, dev)) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "rendezvous of group {group}: ranks {i} and {j} both allocated on CUDA device {dev} of host {}; \
                 each rank needs its own device (set {ALLOW_OVERLAPPING_ENV}=1 to allow sharing one)",
                requests[i].host()
            ),
        )),
    }
}

/// Whether a rendezvous sets up multicast, or why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Multicast {
    On,
    Off(String),
}

/// PyTorch's conditions for multicast, in the order it checks them: not
/// turned off, a new enough driver with the entry points, no two ranks on
/// one device, and every rank's device supporting it.
pub fn multicast_plan(
    requests: &[RendezvousRequest],
    overlapping: bool,
    disabled_by_env: bool,
    driver_version: i32,
    missing_symbol: Option<&str>,
) -> Multicast {
    if disabled_by_env {
        return Multicast::Off(format!("{DISABLE_MULTICAST_ENV} is set"));
    }
    if driver_version < MULTICAST_MIN_DRIVER {
        return Multicast::Off(format!(
            "the driver supports CUDA {}.{}; multicast needs 12.3 or newer",
            driver_version / 1000,
            driver_version % 1000 / 10
        ));
    }
    if let Some(why) = missing_symbol {
        return Multicast::Off(why.to_string());
    }
    if overlapping {
        return Multicast::Off(format!("ranks share a device ({ALLOW_OVERLAPPING_ENV})"));
    }
    if let Some((r, req)) = requests.iter().enumerate().find(|(_, q)| !q.has_multicast_support) {
        return Multicast::Off(format!("device {} of rank {r} does not support multicast", req.device_idx));
    }
    Multicast::On
}

/// After a multicast step every rank all-gathers one byte (1: done here).
/// `None` when every rank succeeded, else the reason multicast stays off,
/// naming the ranks that failed (with this rank's own error if it is one).
pub fn multicast_step_failed(step: &str, flags: &[Vec<u8>], rank: usize, own_error: Option<&str>) -> Option<String> {
    let failed: Vec<usize> = flags.iter().enumerate().filter(|(_, f)| f.as_slice() != [1]).map(|(r, _)| r).collect();
    if failed.is_empty() {
        return None;
    }
    let list = failed.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    let mut why = format!("multicast {step} failed on rank(s) {list}");
    if let (true, Some(e)) = (failed.contains(&rank), own_error) {
        why.push_str(&format!(" (here: {e})"));
    }
    Some(why)
}

/// The kernels' timeout argument: 0 waits forever, else nanoseconds (at
/// least 1, so a tiny timeout is not taken for "forever").
pub fn timeout_ns(timeout: Timeout) -> u64 {
    match timeout {
        None => 0,
        Some(t) => u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1),
    }
}

/// Threads of the barrier kernel's one block: one per rank, rounded up to
/// whole warps, at most 1024 and at most the whole warps of `kernel_max`
/// (the kernel's `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`); the kernel
/// loops over the ranks beyond that.
pub fn barrier_threads(world_size: usize, kernel_max: u32) -> u32 {
    let cap = (kernel_max.min(1024) / 32 * 32).max(32) as usize;
    world_size.clamp(1, 1024).next_multiple_of(32).min(cap) as u32
}

/// Timeout records in the host-mapped array; each launch writes only its
/// own (launch number modulo this), so two launches never share one.
pub const RECORDS: usize = 64;
/// Bytes of one record.
pub const RECORD_BYTES: usize = 32;
/// The record's state word once the kernel has written it.
pub const RECORD_WRITTEN: u32 = 2;

/// A timeout that a kernel recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTimeout {
    /// "put_signal", "wait_signal" or "barrier".
    pub op: &'static str,
    /// True: the slot in the peer's pad never became free (send);
    /// false: the peer's signal never came (receive).
    pub send: bool,
    pub rank: u32,
    pub peer: u32,
    pub channel: u32,
    pub elapsed_ns: u64,
}

/// The timeout in a record's eight words, if the kernel wrote one.
/// Words: state, op (1 put_signal, 2 wait_signal, 3 barrier), kind
/// (1 send, 2 receive), rank, peer, channel, elapsed ns (low, high).
pub fn parse_record(words: [u32; 8]) -> Option<DeviceTimeout> {
    if words[0] != RECORD_WRITTEN {
        return None;
    }
    let op = match words[1] {
        1 => "put_signal",
        2 => "wait_signal",
        3 => "barrier",
        _ => "signal kernel",
    };
    Some(DeviceTimeout {
        op,
        send: words[2] == 1,
        rank: words[3],
        peer: words[4],
        channel: words[5],
        elapsed_ns: u64::from(words[6]) | (u64::from(words[7]) << 32),
    })
}

impl DeviceTimeout {
    /// The message of the `SS_ERR_TIMEOUT` the next call reports.
    pub fn message(&self) -> String {
        let what = if self.send {
            format!("failed to send signal to rank {}", self.peer)
        } else {
            format!("failed to receive signal from rank {}", self.peer)
        };
        format!(
            "CUDASymmetricMemory::{}: rank {} {what} on channel {} after {} ms (timed out on the device in an \
             earlier call; reported by this one, which was not enqueued)",
            self.op,
            self.rank,
            self.channel,
            self.elapsed_ns / 1_000_000
        )
    }
}

/// The undo plan of a VMM mapping lives with the mapping, in `crate::cuda::vmm`.
pub use crate::cuda::vmm::{undo_steps, Undo, VmmProgress};

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn req(dev: i32, host: &str, mc: bool) -> RendezvousRequest {
        let layout = Layout { block_size: 2 << 20, buffer_size: 100, buffer_offset: 12288, signal_pad_size: 9216 };
        let mut r = RendezvousRequest::new(dev, &layout);
        r.hostname = [0; super::super::request::HOSTNAME_LEN];
        r.hostname[..host.len()].copy_from_slice(host.as_bytes());
        r.has_multicast_support = mc;
        r
    }

    #[test]
    fn layout_pad_first_buffer_aligned_block_granular() {
        let l = layout(100, 9216, 2 << 20).unwrap();
        assert_eq!(l, Layout { block_size: 2 << 20, buffer_size: 100, buffer_offset: 12288, signal_pad_size: 9216 });
        // A buffer that crosses the granularity takes another granule.
        let l = layout((2 << 20) - 12288 + 1, 9216, 2 << 20).unwrap();
        assert_eq!(l.block_size, 4 << 20);
        assert_eq!(l.buffer_size, (2 << 20) - 12288 + 1);
        // Exactly filling one granule stays one granule.
        assert_eq!(layout((2 << 20) - 12288, 9216, 2 << 20).unwrap().block_size, 2 << 20);
        // Pads that are not page multiples still give an aligned buffer.
        assert_eq!(layout(1, 4, 4096).unwrap().buffer_offset, 4096);
        assert_eq!(layout(1, 4100, 4096).unwrap().buffer_offset, 8192);
        assert_eq!(layout(0, 9216, 2 << 20).unwrap().block_size, 2 << 20);
        assert_eq!(layout(17, 9216, 4096).unwrap().block_size, 12288 + 4096);
    }

    #[test]
    fn layout_rejects_overflow_and_bad_granularity() {
        assert_eq!(layout(usize::MAX - 10, 9216, 2 << 20).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(layout(1, 9216, 0).unwrap_err().kind(), ErrorKind::CudaError);
        assert_eq!(layout(1, 9216, 3000).unwrap_err().kind(), ErrorKind::CudaError);
    }

    #[test]
    fn env_flags() {
        for off in [None, Some(""), Some("0"), Some("false"), Some("FALSE"), Some("no"), Some("off")] {
            assert!(!env_flag_value(off), "{off:?}");
        }
        for on in [Some("1"), Some("true"), Some("yes"), Some("2")] {
            assert!(env_flag_value(on), "{on:?}");
        }
    }

    #[test]
    fn overlapping_devices_refused_unless_allowed() {
        let distinct = [req(0, "a", true), req(1, "a", true), req(0, "b", true)];
        assert_eq!(overlapping_devices(&distinct), None);
        assert!(!check_devices(&distinct, "g", false).unwrap());
        let shared = [req(0, "a", true), req(1, "a", true), req(1, "a", true)];
        assert_eq!(overlapping_devices(&shared), Some((1, 2, 1)));
        let e = check_devices(&shared, "g", false).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.message().contains("ranks 1 and 2 both allocated on CUDA device 1 of host a"), "{}", e.message());
        assert!(e.message().contains(ALLOW_OVERLAPPING_ENV), "{}", e.message());
        assert!(check_devices(&shared, "g", true).unwrap());
    }

    #[test]
    fn multicast_conditions_in_order() {
        let all = [req(0, "a", true), req(1, "a", true)];
        assert_eq!(multicast_plan(&all, false, false, 12040, None), Multicast::On);
        let off = |m: Multicast| match m {
            Multicast::Off(why) => why,
            Multicast::On => panic!("multicast on"),
        };
        assert!(off(multicast_plan(&all, false, true, 12040, None)).contains(DISABLE_MULTICAST_ENV));
        assert!(off(multicast_plan(&all, false, false, 12020, None)).contains("CUDA 12.2"));
        assert!(off(multicast_plan(&all, false, false, 12040, Some("lacks cuMulticastCreate"))).contains("cuMulticastCreate"));
        assert!(off(multicast_plan(&all, true, false, 12040, None)).contains("share a device"));
        let one_without = [req(0, "a", true), req(1, "a", false)];
        assert_eq!(off(multicast_plan(&one_without, false, false, 12040, None)), "device 1 of rank 1 does not support multicast");
    }

    #[test]
    fn multicast_steps_agree_or_name_the_failed_ranks() {
        let ok = vec![vec![1u8], vec![1u8], vec![1u8]];
        assert_eq!(multicast_step_failed("bind", &ok, 0, None), None);
        let bad = vec![vec![1u8], vec![0u8], vec![]];
        assert_eq!(multicast_step_failed("bind", &bad, 0, None).unwrap(), "multicast bind failed on rank(s) 1, 2");
        assert_eq!(
            multicast_step_failed("import", &bad, 1, Some("CUDA_ERROR_X")).unwrap(),
            "multicast import failed on rank(s) 1, 2 (here: CUDA_ERROR_X)"
        );
        assert_eq!(multicast_step_failed("import", &bad, 0, Some("unused")).unwrap(), "multicast import failed on rank(s) 1, 2");
    }

    #[test]
    fn timeouts_and_launch_shapes() {
        assert_eq!(timeout_ns(None), 0);
        assert_eq!(timeout_ns(Some(Duration::from_millis(500))), 500_000_000);
        assert_eq!(timeout_ns(Some(Duration::ZERO)), 1);
        assert_eq!(timeout_ns(Some(Duration::from_secs(u64::MAX))), u64::MAX);
        assert_eq!(barrier_threads(1, 1024), 32);
        assert_eq!(barrier_threads(2, 1024), 32);
        assert_eq!(barrier_threads(33, 1024), 64);
        assert_eq!(barrier_threads(72, 1024), 96);
        assert_eq!(barrier_threads(5000, 1024), 1024);
        // A kernel the device can run with fewer threads per block: whole
        // warps of that limit (the kernel loops over the other ranks).
        assert_eq!(barrier_threads(72, 64), 64);
        assert_eq!(barrier_threads(72, 100), 96);
        assert_eq!(barrier_threads(5000, 2048), 1024);
        assert_eq!(barrier_threads(8, 0), 32);
    }

    #[test]
    fn records_parse_and_read_as_messages() {
        assert_eq!(parse_record([0; 8]), None);
        assert_eq!(parse_record([1, 3, 1, 0, 1, 0, 0, 0]), None); // not finished writing
        let t = parse_record([2, 3, 2, 0, 3, 7, 500_000_000, 0]).unwrap();
        assert_eq!(t, DeviceTimeout { op: "barrier", send: false, rank: 0, peer: 3, channel: 7, elapsed_ns: 500_000_000 });
        assert!(t
            .message()
            .starts_with("CUDASymmetricMemory::barrier: rank 0 failed to receive signal from rank 3 on channel 7 after 500 ms"));
        let t = parse_record([2, 1, 1, 2, 0, 1, 0, 1]).unwrap();
        assert_eq!(t.elapsed_ns, 1 << 32);
        assert!(t
            .message()
            .starts_with("CUDASymmetricMemory::put_signal: rank 2 failed to send signal to rank 0 on channel 1 after 4294 ms"));
        assert_eq!(parse_record([2, 2, 2, 1, 0, 0, 0, 0]).unwrap().op, "wait_signal");
    }
}
