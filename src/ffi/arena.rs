//! C API of the shareable CPU arena: `ss_arena` (a producer's allocator),
//! `ss_arena_handle` (a shared block), `ss_arena_view` (a consumer's hold
//! on one).

use super::args::{free_handle, handle, out_arg, write_out};
use super::status::ss_status;
use crate::arena::handle::MAX_NAME_LEN;
use crate::arena::segment::SegmentKey;
use crate::arena::{self, Arena, ArenaHandle, ArenaOptions, RemoteView, Strategy};
use crate::error::{Error, ErrorKind, Result};
use crate::storage::Storage;
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::raw::{c_char, c_int};

/// Arena segments are anonymous memfds; their descriptors travel by
/// SCM_RIGHTS, once per segment per peer.
pub const SS_ARENA_BY_FD: u32 = 1;
/// Arena segments are named POSIX shm objects (`/dev/shm/ss_arena_*`),
/// opened by name; no descriptor is kept or sent.
pub const SS_ARENA_BY_NAME: u32 = 2;
/// Bytes of `ss_arena_handle.segment_name`, with the NUL.
pub const SS_ARENA_NAME_LEN: usize = 48;
const _: () = assert!(SS_ARENA_NAME_LEN == MAX_NAME_LEN + 1);

/// How `ss_arena_open` sets up an arena. Start from `SS_ARENA_OPTIONS_INIT`
/// or `ss_arena_options_default`, which set `struct_size` and the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ss_arena_options {
    /// `sizeof(ss_arena_options)` as the caller was built: 0 is refused
    /// (`SS_ERR_INVALID_ARGUMENT`), a size larger than this library knows
    /// is `SS_ERR_UNSUPPORTED`; fields past an older, smaller size take
    /// their defaults.
    pub struct_size: usize,
    /// Bytes of data in each segment of small blocks (default 64 MiB).
    pub segment_size: usize,
    /// `SS_ARENA_BY_FD` (default) or `SS_ARENA_BY_NAME`.
    pub strategy: u32,
    /// Hold slots per small-block segment: shares in flight or held by
    /// consumers at once (default 4096).
    pub max_holds: u32,
    /// Blocks above this many bytes get a segment of their own, released
    /// when they are freed (at least 64, at most segment_size / 4). 0 (the
    /// default): automatic, 1 MiB or segment_size / 4 if that is less, so
    /// setting segment_size alone always works.
    pub large_threshold: usize,
}

/// A shared block: what a consumer passes to `ss_arena_view_open`.
/// Plain bytes: send it over any channel. Each handle carries one hold
/// and opens once.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ss_arena_handle {
    /// `SS_ARENA_BY_FD` or `SS_ARENA_BY_NAME`.
    pub strategy: u32,
    /// The producer's pid and start time (clock ticks since boot): with
    /// the segment id, the key of a consumer's segment cache, so a reused
    /// pid cannot alias.
    pub producer_pid: i32,
    pub producer_start: u64,
    pub segment_id: u64,
    /// Bytes of data in the segment.
    pub segment_size: u64,
    /// Where the block is in the segment, and its size.
    pub offset: u64,
    pub size: u64,
    /// The hold this share took in the segment's counter area.
    pub hold_slot: u32,
    pub hold_generation: u32,
    /// The segment's name (by name), NUL-terminated; empty by fd. Every
    /// byte after the NUL is 0 (as `ss_arena_share` writes it); a handle
    /// with anything else there is refused.
    pub segment_name: [c_char; SS_ARENA_NAME_LEN],
}

/// Counts of an arena's state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ss_arena_stats {
    pub segments: usize,
    pub live_blocks: usize,
    /// Freed by the producer, still held by a consumer.
    pub deferred_blocks: usize,
    /// Bytes of segment data.
    pub segment_bytes: usize,
}

/// A producer's shareable CPU arena. Thread safety: a `const ss_arena*`
/// may be used from several threads at once (it locks internally).
pub struct SsArena {
    arena: Arena,
}

/// A consumer's view of a block shared by another process: keeps the
/// block from being reused until `ss_arena_view_free`. Its bytes stay
/// readable even if the producer dies.
pub struct SsArenaView {
    view: RemoteView,
}

fn options_from_c(o: &ss_arena_options) -> Result<ArenaOptions> {
    let size = std::mem::size_of::<ss_arena_options>();
    super::struct_size::check("ss_arena_options", o.struct_size, size, size)?;
    Ok(ArenaOptions {
        segment_size: o.segment_size,
        strategy: Strategy::from_u32(o.strategy)?,
        max_holds: o.max_holds as usize,
        large_threshold: o.large_threshold,
    })
}

fn handle_to_c(h: &ArenaHandle) -> ss_arena_handle {
    let mut name = [0 as c_char; SS_ARENA_NAME_LEN];
    for (d, s) in name.iter_mut().zip(h.name.bytes().take(MAX_NAME_LEN)) {
        *d = s as c_char;
    }
    ss_arena_handle {
        strategy: h.strategy as u32,
        producer_pid: h.key.producer_pid,
        producer_start: h.key.producer_start,
        segment_id: h.key.segment_id,
        segment_size: h.segment_data_size,
        offset: h.offset,
        size: h.size,
        hold_slot: h.slot,
        hold_generation: h.generation,
        segment_name: name,
    }
}

fn handle_from_c(h: &ss_arena_handle) -> Result<ArenaHandle> {
    let bytes: Vec<u8> = h.segment_name.iter().map(|c| *c as u8).collect();
    // The form ss_arena_share writes: name, NUL, NULs (one spelling per handle).
    let name = arena::handle::name_from_field(&bytes)
        .map_err(|why| Error::new(ErrorKind::InvalidArgument, format!("bad arena handle: segment_name: {why}")))?;
    let out = ArenaHandle {
        strategy: Strategy::from_u32(h.strategy).map_err(|e| e.context("bad arena handle"))?,
        key: SegmentKey { producer_pid: h.producer_pid, producer_start: h.producer_start, segment_id: h.segment_id },
        segment_data_size: h.segment_size,
        offset: h.offset,
        size: h.size,
        slot: h.hold_slot,
        generation: h.hold_generation,
        name,
    };
    out.validate()?;
    Ok(out)
}

unsafe fn arena_arg<'a>(a: *const SsArena) -> Result<&'a Arena> {
    // SAFETY: the caller passes NULL or a live handle.
    Ok(&unsafe { handle(a, "arena") }?.arena)
}

unsafe fn handle_arg(h: *const ss_arena_handle) -> Result<ArenaHandle> {
    // SAFETY: the caller passes NULL or a readable handle.
    handle_from_c(unsafe { handle(h, "handle") }?)
}

/// Fills `*out` with the default options: 64 MiB segments by fd, 4096
/// holds per segment, and an automatic large threshold (0: blocks above
/// 1 MiB, or above a quarter of a smaller segment_size, get segments of
/// their own), and `struct_size`: the same as `SS_ARENA_OPTIONS_INIT`.
///
/// # Safety
/// `out` is NULL or points to a writable `ss_arena_options`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_options_default(out: *mut ss_arena_options) -> ss_status {
    ffi_status!("ss_arena_options_default", {
        out_arg(out, "out")?;
        let d = ArenaOptions::default();
        let o = ss_arena_options {
            struct_size: std::mem::size_of::<ss_arena_options>(),
            segment_size: d.segment_size,
            strategy: d.strategy as u32,
            max_holds: d.max_holds as u32,
            large_threshold: d.large_threshold,
        };
        // SAFETY: checked above.
        unsafe { write_out(out, o) };
        Ok(())
    })
}

/// A new arena with `options` (NULL: the defaults). No segment is made
/// until the first allocation. Release with `ss_arena_close`.
///
/// The arena is this process's. In a child forked from it, every call
/// on the inherited arena (alloc, free, share, unshare, segment_fd,
/// collect, stats, send, ss_storage_new_in_arena) fails with
/// `SS_ERR_INVALID_ARGUMENT` ("arena was created by pid X; this is a
/// forked child") and changes nothing of the parent's; blocks allocated
/// before the fork stay readable, views inherited from the parent keep
/// the parent's holds, and `ss_arena_close` there releases nothing.
///
/// # Safety
/// `options` is NULL or points to a readable `ss_arena_options`; `out` is
/// NULL or points to a writable `ss_arena*`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_open(options: *const ss_arena_options, out: *mut *mut SsArena) -> ss_status {
    ffi_status!("ss_arena_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or readable options.
        let opts = match unsafe { options.as_ref() } {
            Some(o) => options_from_c(o)?,
            None => ArenaOptions::default(),
        };
        let arena = Arena::new(opts)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsArena { arena }))) };
        Ok(())
    })
}

/// Releases the handle (the one release verb that is not `_free`, for
/// one release: `ss_arena_free` still names the deprecated block free; when
/// that alias goes, `ss_arena_free` becomes this function's name) and, once
/// no storage made by
/// `ss_storage_new_in_arena` keeps it alive, the arena and its segments:
/// blocks from `ss_arena_alloc` must not be used after that. Views other
/// processes hold stay readable (they have their own mapping); a handle
/// not opened yet opens only in a process that has its segment mapped
/// already (else `SS_ERR_NOT_FOUND`). NULL is a no-op.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` that no other thread is using; it must
/// not be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_close(a: *mut SsArena) {
    ffi_value!("ss_arena_close", (), {
        // SAFETY: NULL or a handle from ss_arena_open, not used after.
        unsafe { free_handle(a) }
    })
}

/// A block of `size` bytes (> 0) aligned to `align` (a power of two, at
/// most 4096) in shared memory, in `*out_ptr`. A full /dev/shm or out of
/// memory gives `SS_ERR_NO_SPACE`, never a SIGBUS later.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `out_ptr` is NULL or points to a writable `void*`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_alloc(a: *const SsArena, size: usize, align: usize, out_ptr: *mut *mut c_void) -> ss_status {
    ffi_status!("ss_arena_alloc", {
        out_arg(out_ptr, "out_ptr")?;
        // SAFETY: NULL or a live handle.
        let p = unsafe { arena_arg(a) }?.alloc(size, align)?;
        // SAFETY: checked above.
        unsafe { write_out(out_ptr, p.cast()) };
        Ok(())
    })
}

/// Frees a block of this arena. One a consumer still holds is reused only
/// after the consumer releases it (or dies and `ss_arena_collect` runs).
/// A pointer this arena did not allocate, or one freed already, gives
/// `SS_ERR_INVALID_ARGUMENT` and changes nothing.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `ptr` may be any value. The freed block must not be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_dealloc(a: *const SsArena, ptr: *mut c_void) -> ss_status {
    ffi_status!("ss_arena_dealloc", {
        // SAFETY: NULL or a live handle.
        unsafe { arena_arg(a) }?.free(ptr.cast())
    })
}

/// Shares a live block in O(1), no copy: takes one hold on it and writes
/// the handle another process opens with `ss_arena_view_open` (once).
/// By fd, that process needs the segment's descriptor first
/// (`ss_arena_segment_fd`, once per segment), or use `ss_arena_send`.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `ptr` may be any value; `out` is NULL or points to a writable
/// `ss_arena_handle`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_share(a: *const SsArena, ptr: *mut c_void, out: *mut ss_arena_handle) -> ss_status {
    ffi_status!("ss_arena_share", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let h = unsafe { arena_arg(a) }?.share(ptr.cast())?;
        // SAFETY: checked above.
        unsafe { write_out(out, handle_to_c(&h)) };
        Ok(())
    })
}

/// Cancels a share whose handle will never be opened, releasing its
/// hold. A handle opened or cancelled already: `SS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile); `h`
/// is NULL or points to a readable `ss_arena_handle`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_unshare(a: *const SsArena, h: *const ss_arena_handle) -> ss_status {
    ffi_status!("ss_arena_unshare", {
        // SAFETY: NULL or live/readable arguments.
        let (arena, h) = unsafe { (arena_arg(a)?, handle_arg(h)?) };
        arena.unshare(&h)
    })
}

/// The descriptor of segment `segment_id` (from a handle) of a by-fd
/// arena, owned by the arena: send it once per peer, never close it.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `out_fd` is NULL or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_segment_fd(a: *const SsArena, segment_id: u64, out_fd: *mut c_int) -> ss_status {
    ffi_status!("ss_arena_segment_fd", {
        out_arg(out_fd, "out_fd")?;
        // SAFETY: NULL or a live handle.
        let fd = unsafe { arena_arg(a) }?.segment_fd(segment_id)?;
        // SAFETY: checked above.
        unsafe { write_out(out_fd, fd) };
        Ok(())
    })
}

/// Releases the holds of consumers that died (their pid is gone or now
/// belongs to a process with another start time) and reuses the freed
/// blocks nobody holds any more. Counts go to the out-parameters, each
/// of which may be NULL.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `out_reclaimed_holds` and `out_recycled_blocks` are NULL or point to a
/// writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_collect(
    a: *const SsArena,
    out_reclaimed_holds: *mut usize,
    out_recycled_blocks: *mut usize,
) -> ss_status {
    ffi_status!("ss_arena_collect", {
        // SAFETY: NULL or a live handle.
        let r = unsafe { arena_arg(a) }?.collect()?;
        // SAFETY: each is NULL or writable.
        unsafe {
            if !out_reclaimed_holds.is_null() {
                write_out(out_reclaimed_holds, r.reclaimed_holds);
            }
            if !out_recycled_blocks.is_null() {
                write_out(out_recycled_blocks, r.recycled_blocks);
            }
        }
        Ok(())
    })
}

/// The arena's counts: segments, live blocks, deferred blocks, bytes.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `ss_arena_stats`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_stats_get(a: *const SsArena, out: *mut ss_arena_stats) -> ss_status {
    ffi_status!("ss_arena_stats_get", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let s = unsafe { arena_arg(a) }?.stats()?;
        let s = ss_arena_stats {
            segments: s.segments,
            live_blocks: s.live_blocks,
            deferred_blocks: s.deferred_blocks,
            segment_bytes: s.segment_bytes,
        };
        // SAFETY: checked above.
        unsafe { write_out(out, s) };
        Ok(())
    })
}

/// Consumer: maps the segment a by-fd handle names from `fd`, received
/// from the producer. The descriptor is taken over on success (closed at
/// once if this process has the segment mapped already); on failure the
/// caller still owns it. A descriptor not sealed against shrinking (the
/// arena seals every segment it makes) is refused with
/// `SS_ERR_PERMISSION`, one smaller than the segment with
/// `SS_ERR_SIZE_MISMATCH`; nothing is mapped then.
///
/// # Safety
/// `h` is NULL or points to a readable `ss_arena_handle`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_import_segment_fd(h: *const ss_arena_handle, fd: c_int) -> ss_status {
    ffi_status!("ss_arena_import_segment_fd", {
        // SAFETY: NULL or a readable handle.
        let h = unsafe { handle_arg(h) }?;
        if fd < 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("invalid file descriptor {fd}")));
        }
        // SAFETY: dup of the caller's descriptor: theirs stays theirs until we succeed.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(Error::last_os_error(format!("duplicating segment descriptor {fd}")));
        }
        // SAFETY: a fresh descriptor we own.
        arena::import_segment_fd(&h, unsafe { OwnedFd::from_raw_fd(dup) })?;
        // SAFETY: success: the caller's descriptor is ours to close.
        unsafe { libc::close(fd) };
        Ok(())
    })
}

/// Consumer: opens a shared block. The segment is mapped once per
/// process (by name on first use; by fd it must be imported first, else
/// `SS_ERR_NOT_FOUND`); the handle's hold becomes this view's. A handle
/// opened already, cancelled, stale or malformed gives
/// `SS_ERR_INVALID_ARGUMENT` (or `SS_ERR_CORRUPT` when the segment does
/// not match it).
///
/// # Safety
/// `h` is NULL or points to a readable `ss_arena_handle`; `out` is NULL or
/// points to a writable `ss_arena_view*`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_view_open(h: *const ss_arena_handle, out: *mut *mut SsArenaView) -> ss_status {
    ffi_status!("ss_arena_view_open", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a readable handle.
        let view = arena::open_remote(&unsafe { handle_arg(h) }?)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsArenaView { view }))) };
        Ok(())
    })
}

/// Consumer: unmaps the cached remote segments that no view uses and
/// whose producer retired them or died (also when its pid now belongs to
/// another process); by name, a dead producer's name goes too. Their
/// count goes to `out_released` (may be NULL). `ss_arena_view_open`
/// does this by itself before it maps a new segment.
///
/// # Safety
/// `out_released` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_remote_cache_trim(out_released: *mut usize) -> ss_status {
    ffi_status!("ss_arena_remote_cache_trim", {
        let n = arena::trim_cache();
        if !out_released.is_null() {
            // SAFETY: non-NULL, so writable by the contract.
            unsafe { write_out(out_released, n) };
        }
        Ok(())
    })
}

/// Consumer: how many remote segments this process has mapped now.
///
/// # Safety
/// `out` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_remote_cache_size(out: *mut usize) -> ss_status {
    ffi_status!("ss_arena_remote_cache_size", {
        out_arg(out, "out")?;
        // SAFETY: checked above.
        unsafe { write_out(out, arena::cached_segments()) };
        Ok(())
    })
}

/// Start of the viewed block; NULL for NULL.
///
/// # Safety
/// `v` is NULL or a live `ss_arena_view` (other threads may use it
/// meanwhile). The pointer is valid until the view is freed.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_view_data(v: *const SsArenaView) -> *mut c_void {
    ffi_value!("ss_arena_view_data", std::ptr::null_mut(), {
        // SAFETY: NULL or a live view.
        unsafe { v.as_ref() }.map_or(std::ptr::null_mut(), |v| v.view.data().cast())
    })
}

/// Size of the viewed block in bytes (the block's carved size, at least
/// what the producer asked for); 0 for NULL.
///
/// # Safety
/// `v` is NULL or a live `ss_arena_view` (other threads may use it
/// meanwhile).
#[no_mangle]
pub unsafe extern "C" fn ss_arena_view_size(v: *const SsArenaView) -> usize {
    ffi_value!("ss_arena_view_size", 0, {
        // SAFETY: NULL or a live view.
        unsafe { v.as_ref() }.map_or(0, |v| v.view.size())
    })
}

/// Releases the view's hold (one atomic compare-and-swap in the segment)
/// and the view. The segment stays mapped for later views until its
/// producer retires it or dies. NULL is a no-op.
///
/// # Safety
/// `v` is NULL or a live `ss_arena_view` that no other thread is using;
/// neither it nor the block's bytes may be used after the call.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_view_free(v: *mut SsArenaView) {
    ffi_value!("ss_arena_view_free", (), {
        // SAFETY: NULL or a view from ss_arena_view_open, not used after.
        unsafe { free_handle(v) }
    })
}

/// Shares the block at `ptr` and sends it over `sock` (a connected Unix
/// stream socket): the handle, plus the segment's descriptor the first
/// time that segment goes to this peer. On failure the share is cancelled.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `ptr` may be any value.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_send(a: *const SsArena, sock: c_int, ptr: *mut c_void) -> ss_status {
    ffi_status!("ss_arena_send", {
        // SAFETY: NULL or a live handle.
        arena::transport::send_block(unsafe { arena_arg(a) }?, sock, ptr.cast())
    })
}

/// Receives one block sent with `ss_arena_send` and opens it.
///
/// # Safety
/// `out` is NULL or points to a writable `ss_arena_view*`.
#[no_mangle]
pub unsafe extern "C" fn ss_arena_recv(sock: c_int, out: *mut *mut SsArenaView) -> ss_status {
    ffi_status!("ss_arena_recv", {
        out_arg(out, "out")?;
        let view = arena::transport::recv_block(sock)?;
        // SAFETY: checked above.
        unsafe { write_out(out, Box::into_raw(Box::new(SsArenaView { view }))) };
        Ok(())
    })
}

/// A storage of `nbytes` (> 0) bytes in a new block of the arena: shared
/// memory from birth. Above the arena's large threshold the block fills a
/// memfd segment of its own, and `ss_storage_share_fd` returns that
/// segment's fd with no copy (the tuple PyTorch maps); smaller blocks are
/// copied into their own segment when shared by fd or by name, as heap
/// storages are. The block is freed with the storage's last reference.
///
/// # Safety
/// `a` is NULL or a live `ss_arena` (other threads may use it meanwhile);
/// `out` is NULL or points to a writable `ss_storage*`.
#[no_mangle]
pub unsafe extern "C" fn ss_storage_new_in_arena(a: *const SsArena, nbytes: usize, out: *mut *mut super::storage::SsStorage) -> ss_status {
    ffi_status!("ss_storage_new_in_arena", {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle.
        let storage = Storage::new_in_arena(unsafe { arena_arg(a) }?, nbytes)?;
        // SAFETY: checked above.
        unsafe { write_out(out, super::storage::SsStorage::wrap(storage)) };
        Ok(())
    })
}
