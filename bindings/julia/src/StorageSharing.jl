"""
    StorageSharing

Julia wrappers over libstorage_sharing's C API (`storage_sharing.h`):
shared-memory segments with ATen's names, flags and layouts, storages
shared by fd or by name, descriptor passing, and CUDA IPC tuples, which
C, C++, Go and PyTorch processes open too.

The library is `ENV["STORAGE_SHARING_LIB"]` (a path or a name) when set,
else `libstorage_sharing` from the standard search path (`LD_LIBRARY_PATH`,
the loader's cache, `Libdl.DL_LOAD_PATH`). It is looked up at the first
call, so the variable may be set after `using StorageSharing`.

Handles are released by `close`; a finalizer releases a forgotten one when
the garbage collector gets to it. Failures throw `SSError`.
"""
module StorageSharing

export SSError, SharedMap, open_map, open_fd, open_refcounted, new_fd_storage, share_memory,
       new_segment_name, data, bytes, filename, flags, isrefcounted, incref!, decref!, refcount,
       map_from_data, status_text, version,
       SharedStorage, WeakStorage, new_storage, storage_using_fd, storage_using_filename, open_shared_fd,
       open_shared_filename, storage_ref, weak_ref, upgrade, expired, isshared, share_fd, shared_fd,
       share_filename, shared_incref!, shared_decref!, shared_refcount, send_fds, recv_fds,
       set_manager_binary, spawn_manager,
       CudaIpcHandle, CudaSent, CudaReceived, cuda_available, cuda_unavailable_reason, cuda_driver_info,
       cuda_share, sent_counter, cuda_open, cuda_release_ipc_counter, cuda_ipc_collect, cuda_limbo_size,
       cuda_ipc_teardown, cuda_pointer_base, cuda_malloc, cuda_free, cuda_ipc_handle_to_text,
       cuda_ipc_handle_from_text,
       KVStore, store_file_open, store_tcp_open, store_tcp_port, store_ref, store_set, store_get, store_add,
       store_wait, store_check, store_compare_set, store_delete_key, store_num_keys, StoreCallbacks, store_from_callbacks,
       store_torch_file_open, set_log_callback,
       SymmMem, symm_set_group_info, symm_get_group_info, symm_set_backend, symm_alloc, symm_alloc_persistent,
       symm_get_alloc_size, symm_free, symm_rendezvous, symm_rank, symm_world_size, symm_buffer_size,
       symm_signal_pad_size, symm_buffer_ptr, symm_signal_pad_ptr, symm_get_buffer, symm_barrier, symm_put_signal,
       symm_buffer_ptrs_dev, symm_signal_pad_ptrs_dev, symm_has_multicast, symm_multicast_ptr,
       symm_wait_signal, symm_finalize, symm_get_signal_pad_size, symm_set_signal_pad_size,
       ArenaOptions, ArenaHandle, ArenaStats, SharedArena, ArenaView, arena_options_default, open_arena,
       arena_alloc, arena_free, arena_share, arena_unshare, arena_segment_fd, arena_collect, arena_stats,
       arena_trim_remote_cache, arena_remote_cache_size,
       arena_import_segment_fd, arena_open_remote, arena_send, arena_recv, storage_in_arena,
       hash_bytes, ContentWriter, ContentReader, ContentTensor, ContentStorage, content_writer, write_storage,
       write_tensor, writer_counts, set_durable!, content_reader, reader_format, set_verify!, read_tensor, read_storage,
       list_tensors, list_storages, verify, tensor_dtype, tensor_offset, tensor_ndim, tensor_shape, tensor_stride,
       tensor_storage_hash, tensor_conj, tensor_neg, tensor_bytes, storage_bytes,
       CudaPool, CudaWeights, cuda_pool_new, cuda_pool_alloc, cuda_pool_dealloc, cuda_pool_add_tensor, cuda_pool_export,
       cuda_pool_begin_update, cuda_pool_publish, cuda_weights_open, cuda_weights_count, cuda_weights_tensor,
       cuda_weights_find, cuda_weights_acquire, cuda_weights_release, cuda_weights_is_update_pending

"""The library to load: `STORAGE_SHARING_LIB`, else the standard search path."""
libstorage_sharing() = get(ENV, "STORAGE_SHARING_LIB", "libstorage_sharing")

# Flags and sizes, with the C header's names and values (a test compares them).
const SS_MAPPED_SHARED = Cint(1)
const SS_MAPPED_SHAREDMEM = Cint(2)
const SS_MAPPED_EXCLUSIVE = Cint(4)
const SS_MAPPED_NOCREATE = Cint(8)
const SS_MAPPED_KEEPFD = Cint(16)
const SS_MAPPED_FROMFD = Cint(32)
const SS_MAPPED_UNLINK = Cint(64)
const SS_REFCOUNT_HEADER_SIZE = 64
const SS_CUDA_MEM_HANDLE_MAX = 66
const SS_CUDA_IPC_HANDLE_SIZE = 64
const SS_CUDA_COUNTER_NAME_MAX = 64
const SS_CUDA_COUNTER_SLOTS = 10000
const SS_CUDA_HANDLE_TEXT_MAX = 512

# Status codes (ss_status).
const SS_OK = Cint(0)
const SS_ERR_INVALID_ARGUMENT = Cint(1)
const SS_ERR_NULL_POINTER = Cint(2)
const SS_ERR_NOT_FOUND = Cint(3)
const SS_ERR_ALREADY_EXISTS = Cint(4)
const SS_ERR_NO_SPACE = Cint(5)
const SS_ERR_PERMISSION = Cint(6)
const SS_ERR_SIZE_MISMATCH = Cint(7)
const SS_ERR_IO = Cint(8)
const SS_ERR_UNSUPPORTED = Cint(9)
const SS_ERR_CUDA_UNAVAILABLE = Cint(10)
const SS_ERR_CUDA = Cint(11)
const SS_ERR_TIMEOUT = Cint(12)
const SS_ERR_PROTOCOL = Cint(13)
const SS_ERR_PANIC = Cint(14)
const SS_ERR_NAME_TOO_LONG = Cint(15)
const SS_ERR_BAD_REFCOUNT = Cint(16)
const SS_ERR_TOO_MANY_FILES = Cint(17)
const SS_ERR_CLOSED = Cint(18)
const SS_ERR_BUFFER_TOO_SMALL = Cint(19)
const SS_ERR_PEER_GONE = Cint(20)
const SS_ERR_BUSY = Cint(21)
const SS_ERR_CORRUPT = Cint(22)

"""
    SSError(op, status, message)

A failed call: `op` is the C function, `status` its `ss_status` code (compare
with `StorageSharing.SS_ERR_NOT_FOUND` ...), `message` the library's detail.
"""
struct SSError <: Exception
    op::String
    status::Cint
    message::String
end

Base.showerror(io::IO, e::SSError) = print(io, e.op, ": ", e.message, " (", status_text(e.status), ")")

"""The fixed text of a status code."""
status_text(code::Integer) = unsafe_string(ccall((:ss_status_str, libstorage_sharing()), Cstring, (Cint,), code))

"""The library's version, "MAJOR.MINOR.PATCH"."""
version() = unsafe_string(ccall((:ss_version, libstorage_sharing()), Cstring, ()))

# Throws on failure. The message is per OS thread; a task only moves between
# threads where it yields, and nothing yields between the call and this read.
function check(op::String, status::Cint)
    status == SS_OK && return nothing
    msg = unsafe_string(ccall((:ss_last_error_message, libstorage_sharing()), Cstring, ()))
    throw(SSError(op, status, msg))
end

"""
    SharedMap

A mapped file or shared-memory segment (`ss_map`), plain or refcounted.
Release it with `close`.
"""
mutable struct SharedMap
    handle::Ptr{Cvoid}
    function SharedMap(handle::Ptr{Cvoid})
        m = new(handle)
        finalizer(free_handle!, m)
        return m
    end
end

# The finalizer: frees a map nobody closed (ccall only, no task switch).
function free_handle!(m::SharedMap)
    h = m.handle
    m.handle = C_NULL
    h == C_NULL || ccall((:ss_map_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

function live_handle(m::SharedMap, op::String)
    m.handle == C_NULL && throw(SSError(op, SS_ERR_CLOSED, "the map was closed"))
    return m.handle
end

"""
    open_map(name, flags, size) -> SharedMap

ATen's `MapAllocator(name, flags, size)`: opens `name` (SHAREDMEM names
start with '/') and maps `size` bytes.
"""
function open_map(name::AbstractString, flags::Integer, size::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_map_open, libstorage_sharing()), Cint, (Cstring, Cint, Csize_t, Ptr{Ptr{Cvoid}}),
               name, flags, size, out)
    check("ss_map_open", st)
    return SharedMap(out[])
end

"""
    open_fd(fd, flags, size; name="") -> SharedMap

Maps `size` bytes of the descriptor `fd`; `flags` must hold
`SS_MAPPED_FROMFD`. On success the map owns `fd`; on failure the caller does.
"""
function open_fd(fd::Integer, flags::Integer, size::Integer; name::AbstractString="")
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_map_open_fd, libstorage_sharing()), Cint, (Cstring, Cint, Cint, Csize_t, Ptr{Ptr{Cvoid}}),
               name, fd, flags, size, out)
    check("ss_map_open_fd", st)
    return SharedMap(out[])
end

"""
    open_refcounted(name, flags, size) -> SharedMap

ATen's `RefcountedMapAllocator`: creates (`SHAREDMEM | EXCLUSIVE`, count 1)
or opens (`SHAREDMEM | NOCREATE`, count + 1) a segment with `size` data
bytes after a 64-byte header. The last holder to close removes the name.
"""
function open_refcounted(name::AbstractString, flags::Integer, size::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_map_open_refcounted, libstorage_sharing()), Cint, (Cstring, Cint, Csize_t, Ptr{Ptr{Cvoid}}),
               name, flags, size, out)
    check("ss_map_open_refcounted", st)
    return SharedMap(out[])
end

"""An anonymous segment of `size` zero bytes, shared by its descriptor (`fd`)."""
function new_fd_storage(size::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_map_new_shm_fd, libstorage_sharing()), Cint, (Csize_t, Ptr{Ptr{Cvoid}}), size, out)
    check("ss_map_new_shm_fd", st)
    return SharedMap(out[])
end

"""PyTorch's `share_memory_()`: a copy of `src` in a new fd-backed segment."""
function share_memory(src::Vector{UInt8})
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve src ccall((:ss_map_new_copy, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Ptr{Ptr{Cvoid}}),
                                pointer(src), length(src), out)
    check("ss_map_new_copy", st)
    return SharedMap(out[])
end

"""A fresh process-wide segment name, "/torch_<pid>_<rand>_<n>"."""
function new_segment_name()
    buf = zeros(UInt8, 64)
    st = GC.@preserve buf ccall((:ss_shm_name_new, libstorage_sharing()), Cint, (Ptr{UInt8}, Csize_t),
                                pointer(buf), length(buf))
    check("ss_shm_name_new", st)
    return GC.@preserve buf unsafe_string(pointer(buf))
end

"""Start of the mapped data (after a refcounted map's header)."""
function data(m::SharedMap)
    h = live_handle(m, "ss_map_data")
    return GC.@preserve m ccall((:ss_map_data, libstorage_sharing()), Ptr{UInt8}, (Ptr{Cvoid},), h)
end

"""Bytes of mapped data."""
function Base.length(m::SharedMap)
    m.handle == C_NULL && return 0
    return Int(GC.@preserve m ccall((:ss_map_size, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), m.handle))
end

"""
    bytes(m) -> Vector{UInt8}

The mapped data as an array that does not own it: valid while `m` is open
and reachable (use it inside `GC.@preserve m`).
"""
bytes(m::SharedMap) = unsafe_wrap(Array, data(m), length(m); own=false)

"""The descriptor kept with `SS_MAPPED_KEEPFD`, else -1. The map owns it (extends `Base.fd`)."""
function Base.fd(m::SharedMap)
    h = live_handle(m, "ss_map_fd")
    return Int(GC.@preserve m ccall((:ss_map_fd, libstorage_sharing()), Cint, (Ptr{Cvoid},), h))
end

"""The name the map was opened with."""
function filename(m::SharedMap)
    h = live_handle(m, "ss_map_filename")
    return GC.@preserve m unsafe_string(ccall((:ss_map_filename, libstorage_sharing()), Cstring, (Ptr{Cvoid},), h))
end

"""The flags in effect."""
function flags(m::SharedMap)
    h = live_handle(m, "ss_map_flags")
    return GC.@preserve m ccall((:ss_map_flags, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
end

"""Whether the map came from `open_refcounted`."""
function isrefcounted(m::SharedMap)
    h = live_handle(m, "ss_map_is_refcounted")
    return GC.@preserve m ccall((:ss_map_is_refcounted, libstorage_sharing()), Bool, (Ptr{Cvoid},), h)
end

"""Adds one to a refcounted segment's shared count."""
function incref!(m::SharedMap)
    h = live_handle(m, "ss_map_incref")
    st = GC.@preserve m ccall((:ss_map_incref, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
    check("ss_map_incref", st)
end

"""Subtracts one from the shared count; returns whether it reached 0."""
function decref!(m::SharedMap)
    h = live_handle(m, "ss_map_decref")
    zero = Ref{Bool}(false)
    st = GC.@preserve m ccall((:ss_map_decref, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Bool}), h, zero)
    check("ss_map_decref", st)
    return zero[]
end

"""The shared count of a refcounted segment."""
function refcount(m::SharedMap)
    h = live_handle(m, "ss_map_refcount")
    n = Ref{Int32}(0)
    st = GC.@preserve m ccall((:ss_map_refcount, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Int32}), h, n)
    check("ss_map_refcount", st)
    return n[]
end

"""
    map_from_data(ptr) -> Ptr{Cvoid}

ATen's `fromDataPtr`: the raw handle of the live map holding `ptr`, or
`C_NULL`. Borrowed: compare it with `m.handle`, never free it.
"""
map_from_data(ptr::Ptr) = ccall((:ss_map_lookup, libstorage_sharing()), Ptr{Cvoid}, (Ptr{Cvoid},), ptr)

"""
    close(m::SharedMap)

Unmaps, closes a kept descriptor, removes the name where ATen would and
frees the handle. Closing twice does nothing.
"""
function Base.close(m::SharedMap)
    h = m.handle
    h == C_NULL && return nothing
    st = ccall((:ss_map_close, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
    free_handle!(m)
    check("ss_map_close", st)
end

Base.isopen(m::SharedMap) = m.handle != C_NULL

include("storage.jl")
include("cuda.jl")
include("cuda_pool.jl")
include("store.jl")
include("symm.jl")
include("arena.jl")
include("fork.jl")
include("content_store.jl")
include("log.jl")

end # module
