# CUDA IPC (ss_cuda_*). Included by StorageSharing.jl. Device pointers and
# streams are `Ptr{Cvoid}` values that Julia never dereferences.

"""
    CudaIpcHandle

The 8-field tuple of PyTorch's `storage._share_cuda_()`, laid out as the C
struct `ss_cuda_ipc_handle` (a test compares the fields with the header), so
its bytes may be sent between processes as they are.
"""
struct CudaIpcHandle
    device::Int32
    mem_handle::NTuple{66,UInt8}
    mem_handle_len::Csize_t
    size_bytes::UInt64
    offset_bytes::UInt64
    ref_counter_handle::NTuple{64,UInt8}
    ref_counter_offset::UInt64
    event_handle::NTuple{64,UInt8}
    event_sync_required::Bool
end

"""An all-zero tuple (a storage without data), to fill by `cuda_ipc_handle_from_text`."""
CudaIpcHandle() = CudaIpcHandle(0, ntuple(_ -> 0x00, 66), 0, 0, 0, ntuple(_ -> 0x00, 64), 0, ntuple(_ -> 0x00, 64), false)

"""Whether CUDA can be used here (see `cuda_unavailable_reason`)."""
cuda_available() = ccall((:ss_cuda_available, libstorage_sharing()), Bool, ())

"""Why CUDA cannot be used: call right after `cuda_available()` returned false."""
cuda_unavailable_reason() = unsafe_string(ccall((:ss_last_error_message, libstorage_sharing()), Cstring, ()))

"""The driver's CUDA version (1000 major + 10 minor) and the visible devices."""
function cuda_driver_info()
    v = Ref{Int32}(0)
    n = Ref{Int32}(0)
    st = ccall((:ss_cuda_driver_info, libstorage_sharing()), Cint, (Ptr{Int32}, Ptr{Int32}), v, n)
    check("ss_cuda_driver_info", st)
    return (version=Int(v[]), devices=Int(n[]))
end

"""The producer's record of one send (`ss_cuda_sent`); `close` is the producer's release."""
mutable struct CudaSent
    handle::Ptr{Cvoid}
    function CudaSent(handle::Ptr{Cvoid})
        s = new(handle)
        finalizer(s) do s
            h = s.handle
            s.handle = C_NULL
            h == C_NULL || ccall((:ss_cuda_sent_free, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Bool}), h, C_NULL)
        end
        return s
    end
end

"""
    cuda_share(ptr, nbytes, device; stream=C_NULL, deleter=C_NULL, ctx=C_NULL) -> (handle, sent)

Shares `nbytes` of device memory at `ptr` with another process. `deleter` is
a C function pointer (`@cfunction`) called with `(ctx, ptr)` once nobody
uses the memory. `sent` is `nothing` for a storage without data.
"""
function cuda_share(ptr::Ptr, nbytes::Integer, device::Integer; stream::Ptr=C_NULL, deleter::Ptr=C_NULL, ctx::Ptr=C_NULL)
    out = Ref(CudaIpcHandle())
    sent = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_cuda_share, libstorage_sharing()), Cint,
               (Ptr{Cvoid}, Csize_t, Int32, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{CudaIpcHandle}, Ptr{Ptr{Cvoid}}),
               ptr, nbytes, device, stream, deleter, ctx, out, sent)
    check("ss_cuda_share", st)
    return (handle=out[], sent=sent[] == C_NULL ? nothing : CudaSent(sent[]))
end

"""1 while the consumer holds the memory, 0 once it released it."""
function sent_counter(s::CudaSent)
    s.handle == C_NULL && throw(SSError("ss_cuda_sent_counter", SS_ERR_CLOSED, "the send was closed"))
    n = Ref{Int64}(0)
    st = GC.@preserve s ccall((:ss_cuda_sent_counter, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Int64}), s.handle, n)
    check("ss_cuda_sent_counter", st)
    return n[]
end

"""Releases the send; returns whether the memory waits in limbo for the consumer."""
function Base.close(s::CudaSent)
    h = s.handle
    s.handle = C_NULL
    limbo = Ref{Bool}(false)
    st = ccall((:ss_cuda_sent_free, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Bool}), h, limbo)
    check("ss_cuda_sent_free", st)
    return limbo[]
end

"""A storage received from another process (`ss_cuda_received`); `close` is the consumer's release."""
mutable struct CudaReceived
    handle::Ptr{Cvoid}
    function CudaReceived(handle::Ptr{Cvoid})
        r = new(handle)
        finalizer(r) do r
            h = r.handle
            r.handle = C_NULL
            h == C_NULL || ccall((:ss_cuda_received_free, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
        end
        return r
    end
end

"""Maps a tuple from another process; `stream` waits for the producer's event."""
function cuda_open(handle::CudaIpcHandle; stream::Ptr=C_NULL)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_cuda_received_open, libstorage_sharing()), Cint, (Ptr{CudaIpcHandle}, Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
               Ref(handle), stream, out)
    check("ss_cuda_received_open", st)
    return CudaReceived(out[])
end

"""Device address of the first byte (`C_NULL` when empty or closed)."""
data(r::CudaReceived) = GC.@preserve r ccall((:ss_cuda_received_data, libstorage_sharing()), Ptr{Cvoid}, (Ptr{Cvoid},), r.handle)
Base.length(r::CudaReceived) = Int(GC.@preserve r ccall((:ss_cuda_received_size, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), r.handle))

function Base.close(r::CudaReceived)
    h = r.handle
    r.handle = C_NULL
    st = ccall((:ss_cuda_received_free, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
    check("ss_cuda_received_free", st)
end

"""Decrements a ref-counter slot (a tuple dropped unopened); needs no GPU."""
function cuda_release_ipc_counter(name::AbstractString, slot::Integer)
    st = ccall((:ss_cuda_ipc_counter_release, libstorage_sharing()), Cint, (Cstring, UInt64), name, slot)
    check("ss_cuda_ipc_counter_release", st)
end

"""Gives back limbo blocks no consumer uses; returns how many."""
function cuda_ipc_collect()
    n = Ref{Csize_t}(0)
    st = ccall((:ss_cuda_ipc_collect, libstorage_sharing()), Cint, (Ptr{Csize_t},), n)
    check("ss_cuda_ipc_collect", st)
    return Int(n[])
end

"""Blocks this producer freed that consumers still use."""
cuda_limbo_size() = Int(ccall((:ss_cuda_limbo_size, libstorage_sharing()), Csize_t, ()))

"""Ends this process's part in CUDA IPC (also runs at exit)."""
cuda_ipc_teardown() = ccall((:ss_cuda_ipc_teardown, libstorage_sharing()), Cvoid, ())

"""Base and size of the allocation of `device` holding `ptr`."""
function cuda_pointer_base(ptr::Ptr, device::Integer)
    base = Ref{Ptr{Cvoid}}(C_NULL)
    size = Ref{Csize_t}(0)
    st = ccall((:ss_cuda_pointer_base, libstorage_sharing()), Cint, (Ptr{Cvoid}, Int32, Ptr{Ptr{Cvoid}}, Ptr{Csize_t}),
               ptr, device, base, size)
    check("ss_cuda_pointer_base", st)
    return (base=base[], size=Int(size[]))
end

"""`nbytes` of device memory on `device`, shareable with `cuda_share`."""
function cuda_malloc(device::Integer, nbytes::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_cuda_alloc, libstorage_sharing()), Cint, (Int32, Csize_t, Ptr{Ptr{Cvoid}}), device, nbytes, out)
    check("ss_cuda_alloc", st)
    return out[]
end

"""Frees memory from `cuda_malloc`."""
function cuda_free(device::Integer, ptr::Ptr)
    st = ccall((:ss_cuda_free, libstorage_sharing()), Cint, (Int32, Ptr{Cvoid}), device, ptr)
    check("ss_cuda_free", st)
end

"""The tuple as one line of text."""
function cuda_ipc_handle_to_text(handle::CudaIpcHandle)
    buf = zeros(UInt8, SS_CUDA_HANDLE_TEXT_MAX)
    st = GC.@preserve buf ccall((:ss_cuda_ipc_handle_to_text, libstorage_sharing()), Cint,
                                (Ptr{CudaIpcHandle}, Ptr{UInt8}, Csize_t), Ref(handle), buf, length(buf))
    check("ss_cuda_ipc_handle_to_text", st)
    return GC.@preserve buf unsafe_string(pointer(buf))
end

"""Parses `cuda_ipc_handle_to_text`'s form."""
function cuda_ipc_handle_from_text(text::AbstractString)
    out = Ref(CudaIpcHandle())
    st = ccall((:ss_cuda_ipc_handle_from_text, libstorage_sharing()), Cint, (Cstring, Ptr{CudaIpcHandle}), text, out)
    check("ss_cuda_ipc_handle_from_text", st)
    return out[]
end

"""The device of the weights pool a handle (its bytes) names: `(device_type, device)`,
`device_type` 0 = CUDA (then `device` is its index), 1 = the host backend."""
function cuda_pool_handle_device(handle::AbstractVector{UInt8})
    bytes = Vector{UInt8}(handle)
    device_type = Ref{Int32}(0)
    device = Ref{Int32}(0)
    st = GC.@preserve bytes ccall((:ss_cuda_pool_handle_device, libstorage_sharing()), Cint,
                                  (Ptr{UInt8}, Csize_t, Ptr{Int32}, Ptr{Int32}), bytes, length(bytes), device_type, device)
    check("ss_cuda_pool_handle_device", st)
    return (device_type = device_type[], device = device[])
end
