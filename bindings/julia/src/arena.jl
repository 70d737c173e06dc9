# The shareable CPU arena (ss_arena): blocks born in shared memory, shared
# in O(1) with a plain-bytes handle, opened by other processes as views.
# Included by StorageSharing.jl.

const SS_ARENA_BY_FD = 1
const SS_ARENA_BY_NAME = 2
const SS_ARENA_NAME_LEN = 48

"""
    ArenaOptions

`ss_arena_options`: segment size, strategy (`SS_ARENA_BY_FD` or
`SS_ARENA_BY_NAME`), hold slots per segment, large-block threshold.
"""
struct ArenaOptions
    struct_size::Csize_t
    segment_size::Csize_t
    strategy::UInt32
    max_holds::UInt32
    large_threshold::Csize_t
end

"""
    ArenaHandle

`ss_arena_handle`: a shared block (segment, offset, size, hold). Plain
bytes: send them to the process that opens it with `arena_open_remote`.
"""
struct ArenaHandle
    strategy::UInt32
    producer_pid::Int32
    producer_start::UInt64
    segment_id::UInt64
    segment_size::UInt64
    offset::UInt64
    size::UInt64
    hold_slot::UInt32
    hold_generation::UInt32
    segment_name::NTuple{48,UInt8}
end

"""`ss_arena_stats`: segments, live blocks, deferred blocks, segment bytes."""
struct ArenaStats
    segments::Csize_t
    live_blocks::Csize_t
    deferred_blocks::Csize_t
    segment_bytes::Csize_t
end

"""A producer's arena (`ss_arena`); release with `close`."""
mutable struct SharedArena
    handle::Ptr{Cvoid}
    function SharedArena(h::Ptr{Cvoid})
        a = new(h)
        finalizer(close, a)
        return a
    end
end

"""A consumer's view of a shared block (`ss_arena_view`); `close` releases its hold."""
mutable struct ArenaView
    handle::Ptr{Cvoid}
    function ArenaView(h::Ptr{Cvoid})
        v = new(h)
        finalizer(close, v)
        return v
    end
end

function Base.close(a::SharedArena)
    h = a.handle
    a.handle = C_NULL
    h == C_NULL || ccall((:ss_arena_close, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

function Base.close(v::ArenaView)
    h = v.handle
    v.handle = C_NULL
    h == C_NULL || ccall((:ss_arena_view_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

function live_arena(a::SharedArena, op::String)
    a.handle == C_NULL && throw(SSError(op, SS_ERR_CLOSED, "the arena was closed"))
    return a.handle
end

"""The default options (64 MiB segments by fd, 4096 holds, 1 MiB large threshold)."""
function arena_options_default()
    out = Ref{ArenaOptions}()
    check("ss_arena_options_default", ccall((:ss_arena_options_default, libstorage_sharing()), Cint, (Ptr{ArenaOptions},), out))
    return out[]
end

"""
    open_arena(; segment_size, strategy, max_holds, large_threshold) -> SharedArena

A new arena; unset options keep their defaults.
"""
function open_arena(; segment_size=nothing, strategy=nothing, max_holds=nothing, large_threshold=nothing)
    d = arena_options_default()
    o = Ref(ArenaOptions(d.struct_size, something(segment_size, d.segment_size), something(strategy, d.strategy),
                         something(max_holds, d.max_holds), something(large_threshold, d.large_threshold)))
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check("ss_arena_open", ccall((:ss_arena_open, libstorage_sharing()), Cint, (Ptr{ArenaOptions}, Ptr{Ptr{Cvoid}}), o, out))
    return SharedArena(out[])
end

"""A block of `size` bytes aligned to `align` (at most 4096), as a pointer."""
function arena_alloc(a::SharedArena, size::Integer, align::Integer=64)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_arena_alloc, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Csize_t, Ptr{Ptr{Cvoid}}),
               live_arena(a, "ss_arena_alloc"), size, align, out)
    check("ss_arena_alloc", st)
    return out[]
end

"""Frees a block; one a consumer holds is reused only once released."""
function arena_free(a::SharedArena, p::Ptr{Cvoid})
    check("ss_arena_dealloc", ccall((:ss_arena_dealloc, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Cvoid}), live_arena(a, "ss_arena_dealloc"), p))
    return nothing
end

"""Shares a block in O(1): the handle another process opens once."""
function arena_share(a::SharedArena, p::Ptr{Cvoid})
    out = Ref{ArenaHandle}()
    st = ccall((:ss_arena_share, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{ArenaHandle}), live_arena(a, "ss_arena_share"), p, out)
    check("ss_arena_share", st)
    return out[]
end

"""Cancels a share whose handle will never be opened."""
function arena_unshare(a::SharedArena, h::ArenaHandle)
    st = ccall((:ss_arena_unshare, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{ArenaHandle}), live_arena(a, "ss_arena_unshare"), Ref(h))
    check("ss_arena_unshare", st)
    return nothing
end

"""The descriptor of a by-fd segment (owned by the arena): send it once per peer."""
function arena_segment_fd(a::SharedArena, segment_id::Integer)
    out = Ref{Cint}(-1)
    st = ccall((:ss_arena_segment_fd, libstorage_sharing()), Cint, (Ptr{Cvoid}, UInt64, Ptr{Cint}), live_arena(a, "ss_arena_segment_fd"), segment_id, out)
    check("ss_arena_segment_fd", st)
    return out[]
end

"""Reclaims dead consumers' holds; returns `(reclaimed_holds, recycled_blocks)`."""
function arena_collect(a::SharedArena)
    held = Ref{Csize_t}(0)
    recycled = Ref{Csize_t}(0)
    st = ccall((:ss_arena_collect, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Csize_t}, Ptr{Csize_t}), live_arena(a, "ss_arena_collect"), held, recycled)
    check("ss_arena_collect", st)
    return (Int(held[]), Int(recycled[]))
end

"""The arena's counts."""
function arena_stats(a::SharedArena)
    out = Ref{ArenaStats}()
    check("ss_arena_stats_get", ccall((:ss_arena_stats_get, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{ArenaStats}), live_arena(a, "ss_arena_stats_get"), out))
    return out[]
end

"""Consumer: maps a by-fd segment from `fd` (taken over on success)."""
function arena_import_segment_fd(h::ArenaHandle, fd::Integer)
    check("ss_arena_import_segment_fd", ccall((:ss_arena_import_segment_fd, libstorage_sharing()), Cint, (Ptr{ArenaHandle}, Cint), Ref(h), fd))
    return nothing
end

"""Consumer: opens a shared block as a view (its hold is the view's)."""
function arena_open_remote(h::ArenaHandle)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check("ss_arena_view_open", ccall((:ss_arena_view_open, libstorage_sharing()), Cint, (Ptr{ArenaHandle}, Ptr{Ptr{Cvoid}}), Ref(h), out))
    return ArenaView(out[])
end

"""The view's bytes (valid until `close(v)`)."""
function data(v::ArenaView)
    p = ccall((:ss_arena_view_data, libstorage_sharing()), Ptr{Cvoid}, (Ptr{Cvoid},), v.handle)
    n = ccall((:ss_arena_view_size, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), v.handle)
    return unsafe_wrap(Array, Ptr{UInt8}(p), n)
end

"""Shares the block at `p` and sends it over the Unix socket `sock` (with the segment's fd once per peer)."""
function arena_send(a::SharedArena, sock::Integer, p::Ptr{Cvoid})
    check("ss_arena_send", ccall((:ss_arena_send, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cint, Ptr{Cvoid}), live_arena(a, "ss_arena_send"), sock, p))
    return nothing
end

"""Receives a block sent with `arena_send` and opens it."""
function arena_recv(sock::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check("ss_arena_recv", ccall((:ss_arena_recv, libstorage_sharing()), Cint, (Cint, Ptr{Ptr{Cvoid}}), sock, out))
    return ArenaView(out[])
end

"""A storage of `n` bytes in a new block of the arena (shared memory from birth)."""
function storage_in_arena(a::SharedArena, n::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_storage_new_in_arena, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t, Ptr{Ptr{Cvoid}}), live_arena(a, "ss_storage_new_in_arena"), n, out)
    check("ss_storage_new_in_arena", st)
    return SharedStorage(out[])
end

"""Consumer: unmaps idle cached segments of retired or dead producers; returns how many went."""
function arena_trim_remote_cache()
    released = Ref{Csize_t}(0)
    check("ss_arena_remote_cache_trim", ccall((:ss_arena_remote_cache_trim, libstorage_sharing()), Cint, (Ptr{Csize_t},), released))
    return Int(released[])
end

"""Consumer: how many remote segments this process has mapped."""
function arena_remote_cache_size()
    n = Ref{Csize_t}(0)
    check("ss_arena_remote_cache_size", ccall((:ss_arena_remote_cache_size, libstorage_sharing()), Cint, (Ptr{Csize_t},), n))
    return Int(n[])
end
