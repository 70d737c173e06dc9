# Content store: hashing, writing and reading content-addressed snapshots
# of storages and tensors (ours or PyTorch's format). Included by
# StorageSharing.jl.

const SS_HASH_FAST = Cint(0)
const SS_HASH_STABLE = Cint(1)
const SS_HASH_HEX_MAX = 41
const SS_CONTENT_FORMAT_NATIVE = Cint(0)
const SS_CONTENT_FORMAT_TORCH = Cint(1)
const SS_DTYPE_UINT8 = Cint(0)
const SS_DTYPE_INT8 = Cint(1)
const SS_DTYPE_INT16 = Cint(2)
const SS_DTYPE_INT32 = Cint(3)
const SS_DTYPE_INT64 = Cint(4)
const SS_DTYPE_FLOAT16 = Cint(5)
const SS_DTYPE_FLOAT32 = Cint(6)
const SS_DTYPE_FLOAT64 = Cint(7)
const SS_DTYPE_COMPLEX32 = Cint(8)
const SS_DTYPE_COMPLEX64 = Cint(9)
const SS_DTYPE_COMPLEX128 = Cint(10)
const SS_DTYPE_BOOL = Cint(11)
const SS_DTYPE_BFLOAT16 = Cint(15)
const SS_DTYPE_FLOAT8_E5M2 = Cint(23)
const SS_DTYPE_FLOAT8_E4M3FN = Cint(24)
const SS_DTYPE_UINT16 = Cint(27)
const SS_DTYPE_UINT32 = Cint(28)
const SS_DTYPE_UINT64 = Cint(29)

"""
    hash_bytes(data, mode=SS_HASH_FAST) -> String

The hex digest of `data`'s bytes: `SS_HASH_FAST` (XXH3-128 tree, 32
characters) or `SS_HASH_STABLE` (SHA-1, PyTorch's stable hash).
"""
function hash_bytes(data::DenseArray, mode::Integer=SS_HASH_FAST)
    buf = zeros(UInt8, SS_HASH_HEX_MAX)
    st = GC.@preserve data buf ccall((:ss_content_hash_bytes, libstorage_sharing()), Cint,
                                     (Ptr{Cvoid}, Csize_t, Cint, Ptr{UInt8}, Csize_t),
                                     pointer(data), sizeof(data), mode, pointer(buf), length(buf))
    check("ss_content_hash_bytes", st)
    return unsafe_string(pointer(buf))
end

function free_writer_handle(h::Ptr{Cvoid})
    ccall((:ss_content_writer_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
end
function free_reader_handle(h::Ptr{Cvoid})
    ccall((:ss_content_reader_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
end
function free_tensor_handle(h::Ptr{Cvoid})
    ccall((:ss_content_tensor_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
end
function free_storage_handle(h::Ptr{Cvoid})
    ccall((:ss_content_storage_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
end

# Handles of this file: freed by `close`, or by a finalizer if forgotten.
for (T, free) in ((:ContentWriter, :free_writer_handle), (:ContentReader, :free_reader_handle),
                  (:ContentTensor, :free_tensor_handle), (:ContentStorage, :free_storage_handle))
    @eval begin
        mutable struct $T
            handle::Ptr{Cvoid}
            function $T(h::Ptr{Cvoid})
                x = new(h)
                finalizer(close, x)
                return x
            end
        end
        function Base.close(x::$T)
            h = x.handle
            x.handle = C_NULL
            h == C_NULL || $free(h)
            return nothing
        end
        function live_handle(x::$T, op::String)
            x.handle == C_NULL && throw(SSError(op, SS_ERR_CLOSED, string($(string(T)), " was closed")))
            return x.handle
        end
    end
end

"""
    content_writer(path, format=SS_CONTENT_FORMAT_NATIVE) -> ContentWriter

Opens (creating) the store in folder `path`; an existing store is added to.
"""
function content_writer(path::AbstractString, format::Integer=SS_CONTENT_FORMAT_NATIVE)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_writer_open, libstorage_sharing()), Cint, (Cstring, Cint, Ptr{Ptr{Cvoid}}), path, format, out)
    check("ss_content_writer_open", st)
    return ContentWriter(out[])
end

"""Stores `data`'s bytes once per distinct content; returns the hash."""
function write_storage(w::ContentWriter, data::DenseArray)
    buf = zeros(UInt8, SS_HASH_HEX_MAX)
    h = live_handle(w, "ss_content_writer_write_storage")
    st = GC.@preserve data buf ccall((:ss_content_writer_write_storage, libstorage_sharing()), Cint,
                                     (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Ptr{UInt8}, Csize_t),
                                     h, pointer(data), sizeof(data), pointer(buf), length(buf))
    check("ss_content_writer_write_storage", st)
    return unsafe_string(pointer(buf))
end

"""
    write_tensor(w, name, data, dtype, offset, shape, stride)

Stores `data`'s bytes as the storage and an entry `name` viewing it as
`dtype` (an `SS_DTYPE_*`) with `offset`, `shape`, `stride` in elements, in
C (row-major) order as PyTorch counts them.
"""
function write_tensor(w::ContentWriter, name::AbstractString, data::DenseArray, dtype::Integer, offset::Integer,
                      shape::AbstractVector{<:Integer}, stride::AbstractVector{<:Integer})
    length(shape) == length(stride) ||
        throw(SSError("ss_content_writer_write_tensor", SS_ERR_INVALID_ARGUMENT, "shape and stride lengths differ"))
    sh = Vector{Int64}(shape)
    sd = Vector{Int64}(stride)
    h = live_handle(w, "ss_content_writer_write_tensor")
    st = GC.@preserve data sh sd ccall((:ss_content_writer_write_tensor, libstorage_sharing()), Cint,
                                       (Ptr{Cvoid}, Cstring, Ptr{Cvoid}, Csize_t, Cint, Int64, Csize_t, Ptr{Int64}, Ptr{Int64}),
                                       h, name, pointer(data), sizeof(data), dtype, offset, length(sh), pointer(sh), pointer(sd))
    check("ss_content_writer_write_tensor", st)
    return nothing
end

"""Whether files are fsynced around their rename (default true; PyTorch never fsyncs)."""
function set_durable!(w::ContentWriter, on::Bool)
    st = ccall((:ss_content_writer_set_durable, libstorage_sharing()), Cint, (Ptr{Cvoid}, Bool),
               live_handle(w, "ss_content_writer_set_durable"), on)
    check("ss_content_writer_set_durable", st)
    return w
end

"""`(storages_written, storages_deduplicated, tensors_written)` so far."""
function writer_counts(w::ContentWriter)
    a, b, c = Ref{UInt64}(0), Ref{UInt64}(0), Ref{UInt64}(0)
    st = ccall((:ss_content_writer_counts, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{UInt64}, Ptr{UInt64}, Ptr{UInt64}),
               live_handle(w, "ss_content_writer_counts"), a, b, c)
    check("ss_content_writer_counts", st)
    return (a[], b[], c[])
end

"""Opens the store in folder `path` for reading (format detected)."""
function content_reader(path::AbstractString)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_reader_open, libstorage_sharing()), Cint, (Cstring, Ptr{Ptr{Cvoid}}), path, out)
    check("ss_content_reader_open", st)
    return ContentReader(out[])
end

"""The store's format, `SS_CONTENT_FORMAT_*`."""
reader_format(r::ContentReader) =
    ccall((:ss_content_reader_format, libstorage_sharing()), Cint, (Ptr{Cvoid},), live_handle(r, "ss_content_reader_format"))

"""Whether storages are checked against their hash before they are handed out."""
function set_verify!(r::ContentReader, on::Bool)
    st = ccall((:ss_content_reader_set_verify, libstorage_sharing()), Cint, (Ptr{Cvoid}, Bool),
               live_handle(r, "ss_content_reader_set_verify"), on)
    check("ss_content_reader_set_verify", st)
    return r
end

"""The tensor entry `name` with its storage mapped read-only."""
function read_tensor(r::ContentReader, name::AbstractString)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_reader_read_tensor, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Ptr{Ptr{Cvoid}}),
               live_handle(r, "ss_content_reader_read_tensor"), name, out)
    check("ss_content_reader_read_tensor", st)
    return ContentTensor(out[])
end

"""The storage named `hash`, mapped read-only."""
function read_storage(r::ContentReader, hash::AbstractString)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_reader_read_storage, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Ptr{Ptr{Cvoid}}),
               live_handle(r, "ss_content_reader_read_storage"), hash, out)
    check("ss_content_reader_read_storage", st)
    return ContentStorage(out[])
end

# Copies an ss_content_list into Julia strings and frees it.
function take_list(l::Ptr{Cvoid})
    n = ccall((:ss_content_list_len, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), l)
    items = [unsafe_string(ccall((:ss_content_list_get, libstorage_sharing()), Cstring, (Ptr{Cvoid}, Csize_t), l, i))
             for i in 0:n-1]
    ccall((:ss_content_list_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), l)
    return items
end

"""Names of every tensor entry, sorted."""
function list_tensors(r::ContentReader)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_reader_list_tensors, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
               live_handle(r, "ss_content_reader_list_tensors"), out)
    check("ss_content_reader_list_tensors", st)
    return take_list(out[])
end

"""Hashes of every storage, sorted."""
function list_storages(r::ContentReader)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_reader_list_storages, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
               live_handle(r, "ss_content_reader_list_storages"), out)
    check("ss_content_reader_list_storages", st)
    return take_list(out[])
end

"""`(objects_checked, problems)`: one `"object: why"` string per corrupt object."""
function verify(r::ContentReader)
    checked = Ref{UInt64}(0)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_content_reader_verify, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{UInt64}, Ptr{Ptr{Cvoid}}),
               live_handle(r, "ss_content_reader_verify"), checked, out)
    check("ss_content_reader_verify", st)
    return (checked[], take_list(out[]))
end

tensor_dtype(t::ContentTensor) =
    ccall((:ss_content_tensor_dtype, libstorage_sharing()), Cint, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_dtype"))
tensor_offset(t::ContentTensor) =
    ccall((:ss_content_tensor_offset, libstorage_sharing()), Int64, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_offset"))

function tensor_ndim(t::ContentTensor)
    return Int(ccall((:ss_content_tensor_ndim, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_ndim")))
end

"""Sizes, in PyTorch's (row-major) order."""
function tensor_shape(t::ContentTensor)
    n = tensor_ndim(t)
    p = ccall((:ss_content_tensor_shape, libstorage_sharing()), Ptr{Int64}, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_shape"))
    return n == 0 ? Int64[] : copy(unsafe_wrap(Array, p, n))
end

"""Strides in elements, in PyTorch's order."""
function tensor_stride(t::ContentTensor)
    n = tensor_ndim(t)
    p = ccall((:ss_content_tensor_stride, libstorage_sharing()), Ptr{Int64}, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_stride"))
    return n == 0 ? Int64[] : copy(unsafe_wrap(Array, p, n))
end

tensor_storage_hash(t::ContentTensor) = unsafe_string(ccall((:ss_content_tensor_storage_hash, libstorage_sharing()), Cstring,
                                                            (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_storage_hash")))

"""PyTorch's lazy conjugate bit: the values are the conjugates of the stored bytes."""
tensor_conj(t::ContentTensor) =
    ccall((:ss_content_tensor_conj, libstorage_sharing()), Bool, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_conj"))
"""PyTorch's lazy negative bit: the values are the negations of the stored bytes."""
tensor_neg(t::ContentTensor) =
    ccall((:ss_content_tensor_neg, libstorage_sharing()), Bool, (Ptr{Cvoid},), live_handle(t, "ss_content_tensor_neg"))

"""
    tensor_bytes(t) -> Vector{UInt8}

The whole storage's bytes, wrapping the read-only mapping (no copy): do not
write to it, and keep `t` open while using it.
"""
function tensor_bytes(t::ContentTensor)
    h = live_handle(t, "ss_content_tensor_data")
    p = ccall((:ss_content_tensor_data, libstorage_sharing()), Ptr{Cvoid}, (Ptr{Cvoid},), h)
    n = ccall((:ss_content_tensor_nbytes, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), h)
    return n == 0 ? UInt8[] : unsafe_wrap(Array, Ptr{UInt8}(p), Int(n))
end

"""The storage's bytes, wrapping the read-only mapping (see `tensor_bytes`)."""
function storage_bytes(s::ContentStorage)
    h = live_handle(s, "ss_content_storage_data")
    p = ccall((:ss_content_storage_data, libstorage_sharing()), Ptr{Cvoid}, (Ptr{Cvoid},), h)
    n = ccall((:ss_content_storage_nbytes, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), h)
    return n == 0 ? UInt8[] : unsafe_wrap(Array, Ptr{UInt8}(p), Int(n))
end
