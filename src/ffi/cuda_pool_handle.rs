//! What a weights-pool handle says before it is opened: the device its
//! tensors live on, so a consumer (the libtorch header) can give its views
//! the right device. The bytes are checked as `ss_cuda_weights_open` checks
//! them; nothing is connected or mapped.

use super::args::{null, out_arg, write_out};
use super::status::ss_status;
use crate::cuda::pool::PoolHandle;

/// The device of the pool a handle names: `*out_device_type` gets
/// `SS_POOL_DEVICE_CUDA` (then `*out_device` is the CUDA device index) or
/// `SS_POOL_DEVICE_HOST` (then `*out_device` is 0). A malformed handle is
/// `SS_ERR_INVALID_ARGUMENT` naming what is wrong with it.
///
/// # Safety
/// `handle_bytes` is NULL or readable for `len` bytes; `out_device_type`
/// and `out_device` are NULL or point to a writable `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pool_handle_device(
    handle_bytes: *const u8,
    len: usize,
    out_device_type: *mut i32,
    out_device: *mut i32,
) -> ss_status {
    ffi_status!("ss_cuda_pool_handle_device", {
        out_arg(out_device_type, "out_device_type")?;
        out_arg(out_device, "out_device")?;
        if handle_bytes.is_null() {
            return Err(null("handle"));
        }
        // SAFETY: readable for len bytes (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(handle_bytes, len) };
        let (device_type, device) = PoolHandle::from_bytes(bytes)?.device.code();
        // SAFETY: both checked above.
        unsafe {
            write_out(out_device_type, device_type);
            write_out(out_device, device);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::pool::{PoolDevice, PoolKind};

    fn device_of(bytes: &[u8]) -> (ss_status, i32, i32) {
        let (mut t, mut d) = (-1, -1);
        // SAFETY: a live slice and two live ints.
        let st = unsafe { ss_cuda_pool_handle_device(bytes.as_ptr(), bytes.len(), &mut t, &mut d) };
        (st, t, d)
    }

    #[test]
    fn names_the_device_of_a_handle_and_refuses_junk() {
        let handle =
            |device| PoolHandle { socket_name: "ss_pool-1-ab".into(), producer_pid: 1, producer_start: 1, device, kind: PoolKind::Vmm };
        assert_eq!(device_of(&handle(PoolDevice::Host).to_bytes()), (ss_status::SS_OK, 1, 0));
        assert_eq!(device_of(&handle(PoolDevice::Cuda(3)).to_bytes()), (ss_status::SS_OK, 0, 3));
        let bytes = handle(PoolDevice::Cuda(3)).to_bytes();
        assert_eq!(device_of(&bytes[..bytes.len() - 1]).0, ss_status::SS_ERR_INVALID_ARGUMENT);
        assert_eq!(device_of(b"junk").0, ss_status::SS_ERR_INVALID_ARGUMENT);
        let (mut t, mut d) = (0, 0);
        // SAFETY: NULL handle bytes are refused before any read.
        let st = unsafe { ss_cuda_pool_handle_device(std::ptr::null(), 8, &mut t, &mut d) };
        assert_eq!(st, ss_status::SS_ERR_NULL_POINTER);
    }
}
