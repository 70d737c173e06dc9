//! C API of descriptor passing over Unix sockets (SCM_RIGHTS).

use super::args::{null, out_arg, write_out};
use super::status::ss_status;
use crate::error::{Error, ErrorKind};
use crate::fdpass::{recv_fds, send_fds};
use std::ffi::c_void;
use std::os::fd::IntoRawFd;
use std::os::raw::c_int;

/// Sends `len` payload bytes (at least 1) and `nfds` descriptors (at most
/// 253; may be 0 with `fds` NULL) over the connected Unix socket `sock`.
/// All payload bytes are sent; the descriptors travel with the first ones
/// and stay open in the sender.
///
/// # Safety
/// `payload` is NULL or readable for `len` bytes; `fds` is NULL or readable
/// for `nfds` `int`s. Neither may be written by another thread during the
/// call.
#[no_mangle]
pub unsafe extern "C" fn ss_fds_send(sock: c_int, payload: *const c_void, len: usize, fds: *const c_int, nfds: usize) -> ss_status {
    ffi_status!("ss_fds_send", {
        if payload.is_null() {
            return Err(null("payload"));
        }
        if fds.is_null() && nfds > 0 {
            return Err(null("fds"));
        }
        // SAFETY: the caller gives len readable bytes and nfds ints.
        let payload = unsafe { std::slice::from_raw_parts(payload.cast::<u8>(), len) };
        let fds = if nfds == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(fds, nfds) } };
        let mut sent = send_fds(sock, payload, fds)?;
        while sent < payload.len() {
            sent += send_fds(sock, &payload[sent..], &[])?;
        }
        Ok(())
    })
}

/// Receives one message: up to `len` payload bytes into `buf` (their
/// number in `*out_len`, 0 when the peer closed) and up to `max_fds`
/// descriptors into `fds` (their number in `*out_nfds`; close-on-exec,
/// owned by the caller). If the kernel dropped descriptors because this
/// process is at its open-file limit, the call fails with
/// `SS_ERR_TOO_MANY_FILES` (PyTorch loses them silently); more descriptors
/// than `max_fds` give `SS_ERR_BUFFER_TOO_SMALL`, and so does a datagram
/// longer than `len` (the kernel drops its tail; stream sockets keep the
/// rest for the next call). On failure no descriptor is left open.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes; `fds` is NULL or writable for
/// `max_fds` `int`s; `out_len` and `out_nfds` are NULL or point to a writable
/// `size_t`. No other thread may access `buf` or `fds` during the call.
#[no_mangle]
pub unsafe extern "C" fn ss_fds_recv(
    sock: c_int,
    buf: *mut c_void,
    len: usize,
    out_len: *mut usize,
    fds: *mut c_int,
    max_fds: usize,
    out_nfds: *mut usize,
) -> ss_status {
    ffi_status!("ss_fds_recv", {
        out_arg(out_len, "out_len")?;
        out_arg(out_nfds, "out_nfds")?;
        if buf.is_null() {
            return Err(null("buf"));
        }
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "receive buffer of 0 bytes"));
        }
        if fds.is_null() && max_fds > 0 {
            return Err(null("fds"));
        }
        // SAFETY: the caller gives len writable bytes.
        let buf = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
        let (n, got) = recv_fds(sock, buf, max_fds)?;
        // SAFETY: checked above; got.len() <= max_fds.
        unsafe {
            let count = got.len();
            for (i, fd) in got.into_iter().enumerate() {
                fds.add(i).write(fd.into_raw_fd());
            }
            write_out(out_len, n);
            write_out(out_nfds, count);
        }
        Ok(())
    })
}
