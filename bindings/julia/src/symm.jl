# Symmetric memory (ss_symm_*): groups, allocation, rendezvous, and the
# rendezvoused object's buffers and signals. Included by StorageSharing.jl.

const SS_DEVICE_CPU = Cint(0)
const SS_DEVICE_CUDA = Cint(1)

"""
    SymmMem

A rendezvoused symmetric block (`ss_symm_mem`): every rank's buffer and
signal pad. Owned by its allocation: valid until `symm_free` of the block,
never closed by itself.
"""
struct SymmMem
    handle::Ptr{Cvoid}
end

# A group name as the C API takes it: NUL-terminated, or C_NULL for none.
function group_arg(group::Union{Nothing,AbstractString})
    group === nothing && return nothing
    occursin('\0', group) && throw(ArgumentError("the group name contains a NUL byte"))
    return String(group)
end
cptr(s::Union{Nothing,String}) = s === nothing ? Ptr{UInt8}(C_NULL) : pointer(s)

"""
    symm_set_group_info(group, rank, world_size, store::KVStore)

Registers `group`: this process is `rank` of `world_size`, meeting the
others through `store` (the group keeps its own reference; a second call
for the same name throws `SS_ERR_ALREADY_EXISTS`).
"""
function symm_set_group_info(group::AbstractString, rank::Integer, world_size::Integer, store::KVStore)
    st = ccall((:ss_symm_set_group_info, libstorage_sharing()), Cint, (Cstring, Cint, Cint, Ptr{Cvoid}),
               group, rank, world_size, live_handle(store, "ss_symm_set_group_info"))
    check("ss_symm_set_group_info", st)
end

"""`(rank, world_size)` of a registered group."""
function symm_get_group_info(group::AbstractString)
    rank = Ref{Cint}(0)
    ws = Ref{Cint}(0)
    st = ccall((:ss_symm_get_group_info, libstorage_sharing()), Cint, (Cstring, Ptr{Cint}, Ptr{Cint}), group, rank, ws)
    check("ss_symm_get_group_info", st)
    return (Int(rank[]), Int(ws[]))
end

"""Chooses the allocation backend by name (before the first allocation)."""
function symm_set_backend(name::AbstractString)
    st = ccall((:ss_symm_set_backend, libstorage_sharing()), Cint, (Cstring,), name)
    check("ss_symm_set_backend", st)
end

"""
    symm_get_signal_pad_size() -> Int

The signal pad size, in bytes, of the blocks allocated from now on
(default 9216).
"""
function symm_get_signal_pad_size()
    out = Ref{Csize_t}(0)
    st = ccall((:ss_symm_get_signal_pad_size, libstorage_sharing()), Cint, (Ptr{Csize_t},), out)
    check("ss_symm_get_signal_pad_size", st)
    return Int(out[])
end

"""
    symm_set_signal_pad_size(size)

Sets the signal pad size of the blocks to come: a positive multiple of 4,
before the process's first allocation (every rank sets the same).
"""
function symm_set_signal_pad_size(size::Integer)
    st = ccall((:ss_symm_set_signal_pad_size, libstorage_sharing()), Cint, (Csize_t,), size)
    check("ss_symm_set_signal_pad_size", st)
end

"""
    symm_alloc(size; device_type=SS_DEVICE_CPU, device_idx=0, group=nothing) -> Ptr{Cvoid}

A symmetric block whose buffer holds `size` bytes; returns the buffer's
address. Free it with `symm_free`.
"""
function symm_alloc(size::Integer; device_type::Integer=SS_DEVICE_CPU, device_idx::Integer=0,
                    group::Union{Nothing,AbstractString}=nothing)
    g = group_arg(group)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve g ccall((:ss_symm_alloc, libstorage_sharing()), Cint,
                              (Cint, Int32, Csize_t, Ptr{UInt8}, Ptr{Ptr{Cvoid}}), device_type, device_idx, size, cptr(g), out)
    check("ss_symm_alloc", st)
    return out[]
end

"""
    symm_alloc_persistent(size, alloc_id; device_type, device_idx, group) -> Ptr{Cvoid}

The persistent block `alloc_id`: the same block again once the previous use
was freed (`SS_ERR_BUSY` while it is not, `SS_ERR_SIZE_MISMATCH` for another size).
"""
function symm_alloc_persistent(size::Integer, alloc_id::Integer; device_type::Integer=SS_DEVICE_CPU,
                               device_idx::Integer=0, group::Union{Nothing,AbstractString}=nothing)
    g = group_arg(group)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve g ccall((:ss_symm_alloc_persistent, libstorage_sharing()), Cint,
                              (Cint, Int32, Csize_t, Ptr{UInt8}, UInt64, Ptr{Ptr{Cvoid}}),
                              device_type, device_idx, size, cptr(g), alloc_id, out)
    check("ss_symm_alloc_persistent", st)
    return out[]
end

"""The size asked for when `ptr` was allocated."""
function symm_get_alloc_size(ptr::Ptr{Cvoid})
    out = Ref{Csize_t}(0)
    st = ccall((:ss_symm_get_alloc_size, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Csize_t}), ptr, out)
    check("ss_symm_get_alloc_size", st)
    return Int(out[])
end

"""Frees the block at `ptr` and its `SymmMem` objects."""
function symm_free(ptr::Ptr{Cvoid})
    st = ccall((:ss_symm_free, libstorage_sharing()), Cint, (Ptr{Cvoid},), ptr)
    check("ss_symm_free", st)
end

"""
    symm_rendezvous(ptr; group=nothing, timeout_ms=0) -> SymmMem

Meets the other ranks of `group` (default: the allocation's group); every
rank calls it with a block of the same size. `timeout_ms` 0 waits forever.
"""
function symm_rendezvous(ptr::Ptr{Cvoid}; group::Union{Nothing,AbstractString}=nothing, timeout_ms::Integer=0)
    g = group_arg(group)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve g ccall((:ss_symm_mem_rendezvous, libstorage_sharing()), Cint,
                              (Ptr{Cvoid}, Ptr{UInt8}, Int64, Ptr{Ptr{Cvoid}}), ptr, cptr(g), timeout_ms, out)
    check("ss_symm_mem_rendezvous", st)
    return SymmMem(out[])
end

symm_rank(m::SymmMem) = Int(ccall((:ss_symm_mem_rank, libstorage_sharing()), Cint, (Ptr{Cvoid},), m.handle))
symm_world_size(m::SymmMem) = Int(ccall((:ss_symm_mem_world_size, libstorage_sharing()), Cint, (Ptr{Cvoid},), m.handle))
symm_buffer_size(m::SymmMem) = Int(ccall((:ss_symm_mem_buffer_size, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), m.handle))
symm_signal_pad_size(m::SymmMem) =
    Int(ccall((:ss_symm_mem_signal_pad_size, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), m.handle))

"""The address of rank `rank`'s buffer in this process."""
function symm_buffer_ptr(m::SymmMem, rank::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_symm_mem_buffer_ptr, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Ptr{Ptr{Cvoid}}), m.handle, rank, out)
    check("ss_symm_mem_buffer_ptr", st)
    return out[]
end

"""The address of rank `rank`'s signal pad in this process."""
function symm_signal_pad_ptr(m::SymmMem, rank::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_symm_mem_signal_pad_ptr, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Ptr{Ptr{Cvoid}}), m.handle, rank, out)
    check("ss_symm_mem_signal_pad_ptr", st)
    return out[]
end

"""A device-readable array of `world_size` buffer addresses (CUDA: device memory; CPU: host memory), owned by `m`."""
function symm_buffer_ptrs_dev(m::SymmMem)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_symm_mem_buffer_ptrs_dev, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), m.handle, out)
    check("ss_symm_mem_buffer_ptrs_dev", st)
    return out[]
end

"""The same array for the signal pads."""
function symm_signal_pad_ptrs_dev(m::SymmMem)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_symm_mem_signal_pad_ptrs_dev, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), m.handle, out)
    check("ss_symm_mem_signal_pad_ptrs_dev", st)
    return out[]
end

"""Whether the block has a multicast address."""
symm_has_multicast(m::SymmMem) = ccall((:ss_symm_mem_has_multicast, libstorage_sharing()), Bool, (Ptr{Cvoid},), m.handle)

"""The block's multicast address; throws (SS_ERR_UNSUPPORTED, with the reason) where there is none."""
function symm_multicast_ptr(m::SymmMem)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_symm_mem_multicast_ptr, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), m.handle, out)
    check("ss_symm_mem_multicast_ptr", st)
    return out[]
end

"""`nbytes` at `offset` of rank `rank`'s buffer, bounds-checked, as a `Vector{UInt8}` over that memory (valid until `symm_free`)."""
function symm_get_buffer(m::SymmMem, rank::Integer, nbytes::Integer, offset::Integer=0)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_symm_mem_get_buffer, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Csize_t, Csize_t, Ptr{Ptr{Cvoid}}),
               m.handle, rank, nbytes, offset, out)
    check("ss_symm_mem_get_buffer", st)
    return unsafe_wrap(Array, Ptr{UInt8}(out[]), nbytes)
end

"""Signals every other rank on `channel`, then waits for each."""
function symm_barrier(m::SymmMem; channel::Integer=0, timeout_ms::Integer=0)
    st = ccall((:ss_symm_mem_barrier, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Int64, Ptr{Cvoid}),
               m.handle, channel, timeout_ms, C_NULL)
    check("ss_symm_mem_barrier", st)
end

"""Signals rank `dst` on `channel`."""
function symm_put_signal(m::SymmMem, dst::Integer; channel::Integer=0, timeout_ms::Integer=0)
    st = ccall((:ss_symm_mem_put_signal, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Cint, Int64, Ptr{Cvoid}),
               m.handle, dst, channel, timeout_ms, C_NULL)
    check("ss_symm_mem_put_signal", st)
end

"""Waits for and consumes the signal of rank `src` on `channel`."""
function symm_wait_signal(m::SymmMem, src::Integer; channel::Integer=0, timeout_ms::Integer=0)
    st = ccall((:ss_symm_mem_wait_signal, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Cint, Int64, Ptr{Cvoid}),
               m.handle, src, channel, timeout_ms, C_NULL)
    check("ss_symm_mem_wait_signal", st)
end

"""Marks symmetric memory as finalizing (runs by itself at exit)."""
symm_finalize() = ccall((:ss_symm_finalize, libstorage_sharing()), Cvoid, ())
