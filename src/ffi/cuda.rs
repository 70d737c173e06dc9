//! C API of CUDA IPC: share device memory with another process (ours or
//! PyTorch) and know when it may be freed.

use super::args::{copy_c_string, handle, out_arg, str_arg, write_out};
use super::guard::set_last_error;
use super::status::ss_status;
use crate::cuda::{self, IpcBackend, IpcHandle, Received, SentData};
use crate::error::{Error, ErrorKind, Result};
use std::ffi::c_void;
use std::os::raw::c_char;

/// Bytes of `ss_cuda_ipc_handle.mem_handle`: version byte, 'c', and the
/// 64-byte `cudaIpcMemHandle_t` (PyTorch's format).
pub const SS_CUDA_MEM_HANDLE_MAX: usize = 66;
/// Bytes of a raw CUDA IPC handle (memory or event).
pub const SS_CUDA_IPC_HANDLE_SIZE: usize = 64;
/// Bytes of `ss_cuda_ipc_handle.ref_counter_handle`, NUL included.
pub const SS_CUDA_COUNTER_NAME_MAX: usize = 64;
/// Slots in a ref-counter file (a file serves 10000 sends).
pub const SS_CUDA_COUNTER_SLOTS: usize = 10000;
/// A buffer of this many bytes holds any `ss_cuda_ipc_handle_to_text` output.
pub const SS_CUDA_HANDLE_TEXT_MAX: usize = 512;

/// The eight fields of PyTorch's `storage._share_cuda_()` tuple, in its
/// order, as a plain struct that may be copied byte for byte between
/// processes (pipes, sockets, shared memory).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SsCudaIpcHandle {
    /// Device ordinal of the memory.
    pub device: i32,
    /// Memory-handle bytes: version 2, 'c', the segment's cudaIpcMemHandle_t.
    pub mem_handle: [u8; SS_CUDA_MEM_HANDLE_MAX],
    /// Used bytes of `mem_handle`: 66, or 64 for a legacy raw handle, or 0
    /// for a storage without data (PyTorch's `None`).
    pub mem_handle_len: usize,
    /// Bytes of the shared storage.
    pub size_bytes: u64,
    /// Bytes from the segment base to the storage's data.
    pub offset_bytes: u64,
    /// NUL-terminated name of the producer's ref-counter file.
    pub ref_counter_handle: [c_char; SS_CUDA_COUNTER_NAME_MAX],
    /// Slot of this send in the ref-counter file.
    pub ref_counter_offset: u64,
    /// cudaIpcEventHandle_t to wait on (zeros when no event was recorded).
    pub event_handle: [u8; SS_CUDA_IPC_HANDLE_SIZE],
    /// Whether the consumer must wait on the event before using the data.
    pub event_sync_required: bool,
}

/// The producer's record of one send. Release it with `ss_cuda_sent_free`.
/// Thread safety: one thread at a time.
pub struct SsCudaSent(SentData);

/// A storage received from another process. Release it with
/// `ss_cuda_received_free`. Thread safety: one thread at a time.
pub struct SsCudaReceived(Received);

/// Called when shared memory is no longer used by anyone: gets back the
/// `deleter_ctx` given to `ss_cuda_share` and the device pointer. Runs on
/// whichever thread frees or collects; it may call `ss_cuda_free`.
pub type ss_cuda_deleter = Option<unsafe extern "C" fn(ctx: *mut c_void, device_ptr: *mut c_void)>;

impl SsCudaIpcHandle {
    fn from_core(h: &IpcHandle) -> Result<Self> {
        let mut out = SsCudaIpcHandle {
            device: h.device,
            mem_handle: [0; SS_CUDA_MEM_HANDLE_MAX],
            mem_handle_len: h.mem_handle.len(),
            size_bytes: h.size_bytes,
            offset_bytes: h.offset_bytes,
            ref_counter_handle: [0; SS_CUDA_COUNTER_NAME_MAX],
            ref_counter_offset: h.ref_counter_offset,
            event_handle: h.event_handle,
            event_sync_required: h.event_sync_required,
        };
        if h.mem_handle.len() > SS_CUDA_MEM_HANDLE_MAX {
            return Err(Error::new(
                ErrorKind::BufferTooSmall,
                format!("memory handle of {} bytes does not fit the {SS_CUDA_MEM_HANDLE_MAX}-byte field", h.mem_handle.len()),
            ));
        }
        out.mem_handle[..h.mem_handle.len()].copy_from_slice(&h.mem_handle);
        if h.ref_counter_handle.len() >= SS_CUDA_COUNTER_NAME_MAX {
            return Err(Error::new(
                ErrorKind::NameTooLong,
                format!("ref-counter name <{}> does not fit the {SS_CUDA_COUNTER_NAME_MAX}-byte field", h.ref_counter_handle),
            ));
        }
        for (d, s) in out.ref_counter_handle.iter_mut().zip(h.ref_counter_handle.bytes()) {
            *d = s as c_char;
        }
        Ok(out)
    }

    fn to_core(self) -> Result<IpcHandle> {
        if self.mem_handle_len > SS_CUDA_MEM_HANDLE_MAX {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("mem_handle_len {} is larger than the {SS_CUDA_MEM_HANDLE_MAX}-byte field", self.mem_handle_len),
            ));
        }
        let name_bytes: Vec<u8> = self.ref_counter_handle.iter().map(|c| *c as u8).collect();
        let end = name_bytes
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, "ref_counter_handle is not NUL-terminated within its 64 bytes"))?;
        let name = std::str::from_utf8(&name_bytes[..end])
            .map_err(|_| Error::new(ErrorKind::InvalidArgument, "ref_counter_handle is not valid UTF-8"))?;
        Ok(IpcHandle {
            device: self.device,
            mem_handle: self.mem_handle[..self.mem_handle_len].to_vec(),
            size_bytes: self.size_bytes,
            offset_bytes: self.offset_bytes,
            ref_counter_handle: name.to_string(),
            ref_counter_offset: self.ref_counter_offset,
            event_handle: self.event_handle,
            event_sync_required: self.event_sync_required,
        })
    }
}

/// A C callback and its context, called once from any thread.
struct CDeleter {
    f: unsafe extern "C" fn(*mut c_void, *mut c_void),
    ctx: *mut c_void,
}
// SAFETY: the C caller promises (see ss_cuda_deleter) that the callback and
// its context may be used from whichever thread frees the block.
unsafe impl Send for CDeleter {}

/// Ends this process's part in CUDA IPC: warns (see `ss_log_set_callback`)
/// if consumers still hold blocks this producer freed, and removes the
/// names of its ref-counter files so nothing is left in /dev/shm
/// (consumers releasing later get `SS_ERR_PEER_GONE`). Runs by itself at
/// exit once any CUDA IPC function was used; does nothing in a forked
/// child. Later sends start afresh.
#[no_mangle]
pub extern "C" fn ss_cuda_ipc_teardown() {
    ffi_value!("ss_cuda_ipc_teardown", (), {
        cuda::teardown();
    })
}

/// Whether CUDA can be used here: the driver library loads, is new enough,
/// and a device is visible. When false, `ss_last_error_message()` says why.
#[no_mangle]
pub extern "C" fn ss_cuda_available() -> bool {
    ffi_value!("ss_cuda_available", false, {
        match cuda::check_available() {
            Ok(()) => true,
            Err(e) => {
                set_last_error(&e);
                false
            }
        }
    })
}

/// The driver's CUDA version (1000 × major + 10 × minor) and the number of
/// visible devices. `SS_ERR_CUDA_UNAVAILABLE` (with the reason) otherwise.
///
/// # Safety
/// `out_version` and `out_device_count` are NULL or point to a writable
/// `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_driver_info(out_version: *mut i32, out_device_count: *mut i32) -> ss_status {
    ffi_status!("ss_cuda_driver_info", {
        out_arg(out_version, "out_version")?;
        out_arg(out_device_count, "out_device_count")?;
        let d = cuda::driver::driver()?;
        // SAFETY: both checked above.
        unsafe {
            write_out(out_version, d.version);
            write_out(out_device_count, d.device_count);
        }
        Ok(())
    })
}

/// Shares `nbytes` of device memory at `device_ptr` (inside a cudaMalloc
/// allocation of `device`) with another process. Work queued on `stream`
/// (a `cudaStream_t`; NULL = the default stream) before this call is
/// visible to the consumer: an interprocess event is recorded there (or,
/// with 1000 events alive, the stream is synchronised).
///
/// Writes the tuple to send into `*out_handle` and the producer's record
/// into `*out_sent`; release that with `ss_cuda_sent_free` when the
/// producer is done with the memory. Once the consumer has released it too,
/// `deleter(deleter_ctx, device_ptr)` gives the memory back (NULL deleter:
/// nothing is called). Memory received from another process cannot be sent
/// on (`SS_ERR_UNSUPPORTED`: clone it first). A NULL `device_ptr` with
/// `nbytes` 0 gives the tuple of a storage without data and `*out_sent` NULL.
///
/// # Safety
/// `device_ptr` is a device address (never read on the host); `stream` is
/// NULL or a live `cudaStream_t` of `device`'s context. `deleter`, if not
/// NULL, must be safe to call once, from any thread, with `deleter_ctx`.
/// `out_handle` is NULL or points to a writable `ss_cuda_ipc_handle`;
/// `out_sent` is NULL or points to a writable `ss_cuda_sent*`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_share(
    device_ptr: *const c_void,
    nbytes: usize,
    device: i32,
    stream: *mut c_void,
    deleter: ss_cuda_deleter,
    deleter_ctx: *mut c_void,
    out_handle: *mut SsCudaIpcHandle,
    out_sent: *mut *mut SsCudaSent,
) -> ss_status {
    ffi_status!("ss_cuda_share", {
        out_arg(out_handle, "out_handle")?;
        out_arg(out_sent, "out_sent")?;
        let deleter = deleter.map(|f| {
            let d = CDeleter { f, ctx: deleter_ctx };
            Box::new(move |ptr: u64| {
                let d = d;
                // SAFETY: the caller's callback with the caller's context.
                unsafe { (d.f)(d.ctx, ptr as *mut c_void) }
            }) as cuda::Deleter
        });
        let (h, sent) = cuda::global().share(device_ptr as u64, nbytes, device, stream as u64, deleter)?;
        let c = SsCudaIpcHandle::from_core(&h);
        let c = match c {
            Ok(c) => c,
            Err(e) => {
                // Undo the send: the caller keeps its memory.
                if let Some(mut s) = sent {
                    s.deleter = None;
                    s.slot.file.slot(s.slot.index).store(0, std::sync::atomic::Ordering::SeqCst);
                    cuda::global().sent_free(s);
                }
                return Err(e);
            }
        };
        let raw = sent.map_or(std::ptr::null_mut(), |s| Box::into_raw(Box::new(SsCudaSent(s))));
        // SAFETY: both checked above.
        unsafe {
            write_out(out_handle, c);
            write_out(out_sent, raw);
        }
        Ok(())
    })
}

/// The consumer count of a send: 1 while the consumer holds it, 0 once it
/// released it.
///
/// # Safety
/// `sent` is NULL or a live `ss_cuda_sent` that no other thread is using;
/// `out` is NULL or points to a writable `int64_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_sent_counter(sent: *const SsCudaSent, out: *mut i64) -> ss_status {
    ffi_status!("ss_cuda_sent_counter", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let s = unsafe { handle(sent, "sent") }?;
        // SAFETY: checked above.
        unsafe { write_out(out, s.0.counter_value()) };
        Ok(())
    })
}

/// The producer's release of a send (the handle is freed). If no consumer
/// refers to the memory any more it is given back (the deleter runs) now;
/// else it waits in limbo until a collection finds its counter at 0, and
/// `*out_in_limbo` (may be NULL) is set to true. Also frees the limbo
/// blocks already released. NULL `sent` is a no-op.
///
/// # Safety
/// `sent` is NULL or a live `ss_cuda_sent` that no other thread is using; it
/// must not be used after the call. `out_in_limbo` is NULL or points to a
/// writable `bool`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_sent_free(sent: *mut SsCudaSent, out_in_limbo: *mut bool) -> ss_status {
    ffi_status!("ss_cuda_sent_free", {
        if sent.is_null() {
            return Ok(());
        }
        // SAFETY: a handle from ss_cuda_share, not used after this call.
        let s = unsafe { Box::from_raw(sent) };
        let in_limbo = cuda::global().sent_free(s.0);
        if !out_in_limbo.is_null() {
            // SAFETY: non-NULL out-parameter from the caller.
            unsafe { write_out(out_in_limbo, in_limbo) };
        }
        Ok(())
    })
}

/// Opens a tuple from another process (ours or PyTorch's `_share_cuda_()`):
/// maps the memory (once per allocation in this process) and makes
/// `stream` (NULL = default stream) wait for the producer's event. Use the
/// data with work on that stream; release with `ss_cuda_received_free`.
/// `SS_ERR_PEER_GONE` when the producer has exited; `SS_ERR_BAD_REFCOUNT`
/// when the tuple was already released.
///
/// # Safety
/// `ipc_handle` is NULL or points to a readable `ss_cuda_ipc_handle` whose
/// `event_sync_required` byte is 0 or 1; `stream` is NULL or a live
/// `cudaStream_t` of the handle's device; `out` is NULL or points to a
/// writable `ss_cuda_received*`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_received_open(
    ipc_handle: *const SsCudaIpcHandle,
    stream: *mut c_void,
    out: *mut *mut SsCudaReceived,
) -> ss_status {
    ffi_status!("ss_cuda_received_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a readable struct.
        let h = unsafe { handle(ipc_handle, "ipc_handle") }?.to_core()?;
        let r = cuda::global().open(&h, stream as u64)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsCudaReceived(r)))) };
        Ok(())
    })
}

/// Device address of a received storage's first byte (NULL for NULL or a
/// storage without data).
///
/// # Safety
/// `received` is NULL or a live `ss_cuda_received` that no other thread is
/// using. The address is valid until the handle is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_received_data(received: *const SsCudaReceived) -> *mut c_void {
    ffi_value!("ss_cuda_received_data", std::ptr::null_mut(), {
        // SAFETY: NULL or a live handle.
        unsafe { received.as_ref() }.map_or(std::ptr::null_mut(), |r| r.0.data() as *mut c_void)
    })
}

/// Bytes of a received storage (0 for NULL).
///
/// # Safety
/// `received` is NULL or a live `ss_cuda_received` that no other thread is
/// using.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_received_size(received: *const SsCudaReceived) -> usize {
    ffi_value!("ss_cuda_received_size", 0, {
        // SAFETY: NULL or a live handle.
        unsafe { received.as_ref() }.map_or(0, |r| r.0.size() as usize)
    })
}

/// The consumer's release (the handle is freed whatever the result): waits
/// for the work queued on the stream given to `ss_cuda_received_open`, unmaps the
/// memory if this was its last user here, and decrements the producer's
/// counter slot atomically. `SS_ERR_PEER_GONE` when the producer is gone.
/// NULL is a no-op.
///
/// # Safety
/// `received` is NULL or a live `ss_cuda_received` that no other thread is
/// using; neither it nor its device address may be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_received_free(received: *mut SsCudaReceived) -> ss_status {
    ffi_status!("ss_cuda_received_free", {
        if received.is_null() {
            return Ok(());
        }
        // SAFETY: a handle from ss_cuda_received_open, not used after this call.
        let r = unsafe { Box::from_raw(received) };
        cuda::global().received_free(r.0)
    })
}

/// Decrements slot `slot` of the ref-counter file `counter_name` by one,
/// atomically, as PyTorch's `_release_ipc_counter_cuda` does (non-atomically).
/// For a consumer that drops a duplicate tuple without opening it. Needs
/// no GPU. `SS_ERR_PEER_GONE` when the file is gone, `SS_ERR_BAD_REFCOUNT`
/// when the slot is already 0.
///
/// # Safety
/// `counter_name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_ipc_counter_release(counter_name: *const c_char, slot: u64) -> ss_status {
    ffi_status!("ss_cuda_ipc_counter_release", {
        // SAFETY: NULL or a NUL-terminated string.
        let name = unsafe { str_arg(counter_name, "counter_name") }?;
        cuda::release_ipc_counter(name, slot)
    })
}

/// Gives back every block in limbo that no consumer refers to any more
/// (running their deleters); `*out_freed` (may be NULL) gets how many.
/// With limbo then empty, also closes the current ref-counter file if no
/// send uses it. Call it when device memory runs short (`ss_cuda_alloc`
/// does), as `torch.cuda.ipc_collect()`.
///
/// # Safety
/// `out_freed` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_ipc_collect(out_freed: *mut usize) -> ss_status {
    ffi_status!("ss_cuda_ipc_collect", {
        let n = cuda::global().collect();
        if !out_freed.is_null() {
            // SAFETY: non-NULL out-parameter from the caller.
            unsafe { write_out(out_freed, n) };
        }
        Ok(())
    })
}

/// Blocks freed by this producer that consumers still refer to.
#[no_mangle]
pub extern "C" fn ss_cuda_limbo_size() -> usize {
    ffi_value!("ss_cuda_limbo_size", 0, { cuda::global().limbo_size() })
}

/// Base address and size of the cudaMalloc allocation of `device` that
/// holds `device_ptr` (what the tuple's offset is measured from).
///
/// # Safety
/// `device_ptr` may be any value (it is only looked up); `out_base` is NULL
/// or points to a writable `void*`; `out_size` is NULL or points to a
/// writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_pointer_base(
    device_ptr: *const c_void,
    device: i32,
    out_base: *mut *mut c_void,
    out_size: *mut usize,
) -> ss_status {
    ffi_status!("ss_cuda_pointer_base", {
        out_arg(out_base, "out_base")?;
        out_arg(out_size, "out_size")?;
        let (base, size) = cuda::global().backend().allocation_range(device, device_ptr as u64)?;
        // SAFETY: both checked above.
        unsafe {
            write_out(out_base, base as *mut c_void);
            write_out(out_size, size);
        }
        Ok(())
    })
}

/// Allocates `nbytes` of device memory on `device` (cuMemAlloc, shareable
/// with `ss_cuda_share`). When the device is full, collects limbo and, if
/// that gave any block back, tries once more; else `SS_ERR_NO_SPACE`.
///
/// # Safety
/// `out` is NULL or points to a writable `void*`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_alloc(device: i32, nbytes: usize, out: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_cuda_alloc", {
        out_arg(out, "out")?;
        let ptr = cuda::device_alloc(device, nbytes)?;
        // SAFETY: checked above.
        unsafe { write_out(out, ptr as *mut c_void) };
        Ok(())
    })
}

/// Frees memory from `ss_cuda_alloc`. NULL is a no-op.
///
/// # Safety
/// `device_ptr` is NULL or memory from `ss_cuda_alloc` on `device` that is
/// not freed yet; it must not be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_free(device: i32, device_ptr: *mut c_void) -> ss_status {
    ffi_status!("ss_cuda_free", {
        if device_ptr.is_null() {
            return Ok(());
        }
        cuda::device_free(device, device_ptr as u64)
    })
}

/// Writes the tuple as one line of text (eight space-separated fields,
/// byte strings in hex, `-` for an empty one) into `buf` of `len` bytes
/// (`SS_CUDA_HANDLE_TEXT_MAX` is always enough): for pipes, argv, Python.
///
/// # Safety
/// `ipc_handle` is NULL or points to a readable `ss_cuda_ipc_handle` whose
/// `event_sync_required` byte is 0 or 1; `buf` is NULL or writable for `len`
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_ipc_handle_to_text(ipc_handle: *const SsCudaIpcHandle, buf: *mut c_char, len: usize) -> ss_status {
    ffi_status!("ss_cuda_ipc_handle_to_text", {
        // SAFETY: NULL or a readable struct.
        let h = unsafe { handle(ipc_handle, "ipc_handle") }?.to_core()?;
        // SAFETY: NULL or writable for len bytes.
        unsafe { copy_c_string(&h.to_text(), buf, len, "buf") }
    })
}

/// Parses `ss_cuda_ipc_handle_to_text`'s form into `*out`.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string; `out` is NULL or points to a
/// writable `ss_cuda_ipc_handle`.
#[no_mangle]
pub unsafe extern "C" fn ss_cuda_ipc_handle_from_text(text: *const c_char, out: *mut SsCudaIpcHandle) -> ss_status {
    ffi_status!("ss_cuda_ipc_handle_from_text", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a NUL-terminated string.
        let text = unsafe { str_arg(text, "text") }?;
        let h = SsCudaIpcHandle::from_core(&IpcHandle::from_text(text)?)?;
        // SAFETY: checked above.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::handle::{IPC_HANDLE_SIZE, MEM_HANDLE_LEN};

    #[test]
    fn c_constants_match_core() {
        assert_eq!(SS_CUDA_MEM_HANDLE_MAX, MEM_HANDLE_LEN);
        assert_eq!(SS_CUDA_IPC_HANDLE_SIZE, IPC_HANDLE_SIZE);
        assert_eq!(SS_CUDA_COUNTER_SLOTS, crate::cuda::counters::SLOTS_PER_FILE);
    }

    #[test]
    fn struct_round_trips_and_checks_fields() {
        let h = IpcHandle {
            device: 0,
            mem_handle: crate::cuda::handle::encode_mem_handle(&[3; 64]).to_vec(),
            size_bytes: 10,
            offset_bytes: 2,
            ref_counter_handle: "/torch_1_2_3".into(),
            ref_counter_offset: 7,
            event_handle: [9; 64],
            event_sync_required: true,
        };
        let c = SsCudaIpcHandle::from_core(&h).unwrap();
        assert_eq!(c.to_core().unwrap(), h);
        let text = h.to_text();
        assert!(text.len() < SS_CUDA_HANDLE_TEXT_MAX);
        let mut bad = c;
        bad.mem_handle_len = 67;
        assert_eq!(bad.to_core().unwrap_err().kind(), ErrorKind::InvalidArgument);
        let mut bad = c;
        bad.ref_counter_handle = [b'a' as c_char; 64];
        assert!(bad.to_core().unwrap_err().message().contains("NUL-terminated"));
        let long = IpcHandle { ref_counter_handle: format!("/{}", "n".repeat(70)), ..h };
        assert_eq!(SsCudaIpcHandle::from_core(&long).err().unwrap().kind(), ErrorKind::NameTooLong);
    }
}
