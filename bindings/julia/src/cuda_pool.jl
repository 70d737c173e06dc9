# GPU weights pool (ss_cuda_pool_*, ss_cuda_weights_*). Included by
# StorageSharing.jl. Device pointers and streams are plain integers or
# `Ptr{Cvoid}` values that Julia never dereferences for a CUDA pool.

const SS_POOL_DEVICE_CUDA = 0
const SS_POOL_DEVICE_HOST = 1
const SS_POOL_KIND_VMM = 0
const SS_POOL_KIND_LEGACY = 1

"""`ss_cuda_pool_options`: device (`SS_POOL_DEVICE_*`), kind (`SS_POOL_KIND_*`), segment size, consumer slots."""
struct CudaPoolOptions
    struct_size::Csize_t
    device_type::Int32
    device::Int32
    kind::Int32
    segment_size::Csize_t
    max_consumers::Csize_t
end

"""`ss_tensor_desc`: one tensor to add to a pool's manifest."""
struct TensorDesc
    struct_size::Csize_t
    storage_ptr::Ptr{Cvoid}
    storage_nbytes::Csize_t
    dtype::Int32
    ndim::Csize_t
    sizes::Ptr{Int64}
    strides::Ptr{Int64}
    storage_offset::Int64
end

"""`ss_cuda_weights_tensor_info`: one tensor of an opened pool (its pointers lent by the weights)."""
struct CudaWeightsTensorInfo
    name::Ptr{UInt8}
    data_ptr::Ptr{Cvoid}
    storage_nbytes::Csize_t
    dtype::Int32
    ndim::Csize_t
    sizes::Ptr{Int64}
    strides::Ptr{Int64}
    storage_offset::Int64
    storage_index::Csize_t
end

"""A producer's pool (`ss_cuda_pool`); `close` releases it."""
mutable struct CudaPool
    handle::Ptr{Cvoid}
    function CudaPool(h::Ptr{Cvoid})
        p = new(h)
        finalizer(close, p)
        return p
    end
end

function Base.close(p::CudaPool)
    h = p.handle
    p.handle = C_NULL
    h == C_NULL || ccall((:ss_cuda_pool_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

"""
    cuda_pool_new(; device_type=SS_POOL_DEVICE_CUDA, device=0, kind=SS_POOL_KIND_VMM, segment_size=256 MiB, max_consumers=64)

A new pool (`SS_POOL_DEVICE_HOST` puts it in host RAM).
"""
function cuda_pool_new(; device_type::Integer=SS_POOL_DEVICE_CUDA, device::Integer=0, kind::Integer=SS_POOL_KIND_VMM,
                       segment_size::Integer=256 << 20, max_consumers::Integer=64)
    o = Ref(CudaPoolOptions(sizeof(CudaPoolOptions), device_type, device, kind, segment_size, max_consumers))
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check("ss_cuda_pool_new", ccall((:ss_cuda_pool_new, libstorage_sharing()), Cint, (Ptr{CudaPoolOptions}, Ptr{Ptr{Cvoid}}), o, out))
    return CudaPool(out[])
end

"""A 512-aligned block of `nbytes` in the pool."""
function cuda_pool_alloc(p::CudaPool, nbytes::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check("ss_cuda_pool_alloc", ccall((:ss_cuda_pool_alloc, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Ptr{Ptr{Cvoid}}), p.handle, nbytes, out))
    return out[]
end

cuda_pool_dealloc(p::CudaPool, ptr::Ptr{Cvoid}) =
    check("ss_cuda_pool_dealloc", ccall((:ss_cuda_pool_dealloc, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Cvoid}), p.handle, ptr))

"""Adds tensor `name` (dtype a c10::ScalarType number) over the storage at `ptr`."""
function cuda_pool_add_tensor(p::CudaPool, name::AbstractString, ptr::Ptr{Cvoid}, nbytes::Integer, dtype::Integer,
                              sizes::Vector{Int64}, strides::Vector{Int64}; storage_offset::Integer=0)
    length(sizes) == length(strides) || throw(ArgumentError("sizes and strides differ in length"))
    GC.@preserve sizes strides begin
        d = Ref(TensorDesc(sizeof(TensorDesc), ptr, nbytes, dtype, length(sizes), pointer(sizes), pointer(strides), storage_offset))
        st = ccall((:ss_cuda_pool_add_tensor, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Ptr{TensorDesc}), p.handle, name, d)
    end
    check("ss_cuda_pool_add_tensor", st)
end

"""Exports the pool; returns its handle bytes (give them to consumers)."""
function cuda_pool_export(p::CudaPool)
    buf = zeros(UInt8, 256)
    len = Ref{Csize_t}(0)
    st = ccall((:ss_cuda_pool_export, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{UInt8}, Csize_t, Ptr{Csize_t}), p.handle, buf, length(buf), len)
    check("ss_cuda_pool_export", st)
    return buf[1:len[]]
end

cuda_pool_begin_update(p::CudaPool; timeout_ms::Integer=0) =
    check("ss_cuda_pool_begin_update", ccall((:ss_cuda_pool_begin_update, libstorage_sharing()), Cint, (Ptr{Cvoid}, Int64), p.handle, timeout_ms))

"""Publishes the open update (event on `stream`); returns the new version."""
function cuda_pool_publish(p::CudaPool; stream::Integer=0)
    v = Ref{UInt64}(0)
    check("ss_cuda_pool_publish", ccall((:ss_cuda_pool_publish, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Ptr{UInt64}), p.handle, stream, v))
    return Int(v[])
end

"""A pool opened in this process (`ss_cuda_weights`); `close` releases it."""
mutable struct CudaWeights
    handle::Ptr{Cvoid}
    function CudaWeights(h::Ptr{Cvoid})
        w = new(h)
        finalizer(close, w)
        return w
    end
end

function Base.close(w::CudaWeights)
    h = w.handle
    w.handle = C_NULL
    h == C_NULL || ccall((:ss_cuda_weights_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

"""Opens the pool of handle bytes from `cuda_pool_export` (in another process)."""
function cuda_weights_open(handle::Vector{UInt8}; timeout_ms::Integer=0)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_cuda_weights_open, libstorage_sharing()), Cint, (Ptr{UInt8}, Csize_t, Int64, Ptr{Ptr{Cvoid}}), handle, length(handle), timeout_ms, out)
    check("ss_cuda_weights_open", st)
    return CudaWeights(out[])
end

function cuda_weights_count(w::CudaWeights)
    n = Ref{Csize_t}(0)
    check("ss_cuda_weights_count", ccall((:ss_cuda_weights_count, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Csize_t}), w.handle, n))
    return Int(n[])
end

"""Tensor `i` (0-based): name, data pointer, bytes, dtype, sizes, strides, offset, storage index."""
function cuda_weights_tensor(w::CudaWeights, i::Integer)
    info = Ref{CudaWeightsTensorInfo}()
    st = ccall((:ss_cuda_weights_tensor, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Ptr{CudaWeightsTensorInfo}), w.handle, i, info)
    check("ss_cuda_weights_tensor", st)
    t = info[]
    return (name=unsafe_string(t.name), data=t.data_ptr, nbytes=Int(t.storage_nbytes), dtype=Int(t.dtype),
            sizes=[unsafe_load(t.sizes, k) for k in 1:t.ndim], strides=[unsafe_load(t.strides, k) for k in 1:t.ndim],
            storage_offset=Int(t.storage_offset), storage_index=Int(t.storage_index))
end

function cuda_weights_find(w::CudaWeights, name::AbstractString)
    i = Ref{Csize_t}(0)
    check("ss_cuda_weights_find", ccall((:ss_cuda_weights_find, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Ptr{Csize_t}), w.handle, name, i))
    return Int(i[])
end

"""Holds the current version for reading; returns it."""
function cuda_weights_acquire(w::CudaWeights; stream::Integer=0, timeout_ms::Integer=0)
    v = Ref{UInt64}(0)
    st = ccall((:ss_cuda_weights_acquire, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Int64, Ptr{UInt64}), w.handle, stream, timeout_ms, v)
    check("ss_cuda_weights_acquire", st)
    return Int(v[])
end

"""Whether the producer waits to write, or writes, an update now."""
function cuda_weights_is_update_pending(w::CudaWeights)
    pending = Ref{Bool}(false)
    check("ss_cuda_weights_is_update_pending", ccall((:ss_cuda_weights_is_update_pending, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Bool}), w.handle, pending))
    return pending[]
end

cuda_weights_release(w::CudaWeights; stream::Integer=0) =
    check("ss_cuda_weights_release", ccall((:ss_cuda_weights_release, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t), w.handle, stream))
