# Key-value stores (ss_store): the file store, PyTorch's TCPStore protocol,
# and stores a host provides through callbacks. Included by StorageSharing.jl.

"""
    KVStore

One reference to a key-value store (`ss_store`, c10d's "Store"). Release it
with `close`; the store closes with its last reference. Timeouts are in
milliseconds, `0` waits forever.
"""
mutable struct KVStore
    handle::Ptr{Cvoid}
    function KVStore(handle::Ptr{Cvoid})
        s = new(handle)
        finalizer(free_store!, s)
        return s
    end
end

function free_store!(s::KVStore)
    h = s.handle
    s.handle = C_NULL
    h == C_NULL || ccall((:ss_store_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

function live_handle(s::KVStore, op::String)
    s.handle == C_NULL && throw(SSError(op, SS_ERR_CLOSED, "the store was closed"))
    return s.handle
end

"""Drops this reference (twice does nothing)."""
Base.close(s::KVStore) = free_store!(s)
Base.isopen(s::KVStore) = s.handle != C_NULL

"""
    store_file_open(path; lock_timeout_ms=nothing) -> KVStore

The store in folder `path` (created if missing), shared by the processes
of one host that open the same path. Use a fresh folder per job. A write
waits for the folder's lock at most `lock_timeout_ms` (0: as long as the
holder keeps it; default 300 s), then throws a timeout `SSError`.
"""
function store_file_open(path::AbstractString; lock_timeout_ms::Union{Nothing,Integer}=nothing)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    if lock_timeout_ms === nothing
        st = ccall((:ss_store_file_open, libstorage_sharing()), Cint, (Cstring, Ptr{Ptr{Cvoid}}), path, out)
        check("ss_store_file_open", st)
    else
        st = ccall((:ss_store_file_open_with_lock_timeout, libstorage_sharing()), Cint, (Cstring, Int64, Ptr{Ptr{Cvoid}}),
                   path, lock_timeout_ms, out)
        check("ss_store_file_open_with_lock_timeout", st)
    end
    return KVStore(out[])
end

"""
    store_torch_file_open(path, world_size, timeout_ms) -> KVStore

A store over PyTorch's `FileStore` file at `path`, shared with
`torch.distributed.FileStore(path, world_size)` of the same host
(`world_size` -1: the file is never removed; `timeout_ms` 0: wait forever).
"""
function store_torch_file_open(path::AbstractString, world_size::Integer, timeout_ms::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_store_torch_file_open, libstorage_sharing()), Cint, (Cstring, Cint, Int64, Ptr{Ptr{Cvoid}}),
               path, world_size, timeout_ms, out)
    check("ss_store_torch_file_open", st)
    return KVStore(out[])
end

"""A second reference to the same store (close both)."""
function store_ref(s::KVStore)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_store_ref, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
               live_handle(s, "ss_store_ref"), out)
    check("ss_store_ref", st)
    return KVStore(out[])
end

"""Sets `key` to `value` (bytes or a string)."""
function store_set(s::KVStore, key::AbstractString, value::Union{AbstractString,Vector{UInt8}})
    bytes = value isa AbstractString ? Vector{UInt8}(codeunits(value)) : value
    st = GC.@preserve bytes ccall((:ss_store_set, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Ptr{Cvoid}, Csize_t),
                                  live_handle(s, "ss_store_set"), key, pointer(bytes), length(bytes))
    check("ss_store_set", st)
end

"""
    store_get(s, key; timeout_ms=0) -> Vector{UInt8}

The value of `key`, waiting until it is set (`SS_ERR_TIMEOUT` on expiry).
"""
function store_get(s::KVStore, key::AbstractString; timeout_ms::Integer=0)
    buf = zeros(UInt8, 256)
    len = Ref{Csize_t}(0)
    while true
        st = GC.@preserve buf ccall((:ss_store_get, libstorage_sharing()), Cint,
                                    (Ptr{Cvoid}, Cstring, Int64, Ptr{Cvoid}, Csize_t, Ptr{Csize_t}),
                                    live_handle(s, "ss_store_get"), key, timeout_ms, pointer(buf), length(buf), len)
        if st == SS_ERR_BUFFER_TOO_SMALL && len[] > length(buf)
            resize!(buf, len[])   # the value grew past our buffer: ask again
            continue
        end
        check("ss_store_get", st)
        return resize!(buf, len[])
    end
end

"""Adds `delta` to the integer under `key` (missing = 0); the new value."""
function store_add(s::KVStore, key::AbstractString, delta::Integer)
    out = Ref{Int64}(0)
    st = ccall((:ss_store_add, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Int64, Ptr{Int64}),
               live_handle(s, "ss_store_add"), key, delta, out)
    check("ss_store_add", st)
    return out[]
end

"""Whether every key is set now (no waiting)."""
function store_check(s::KVStore, keys::AbstractVector{<:AbstractString})
    any(k -> occursin('\0', k), keys) && throw(ArgumentError("a key contains a NUL byte"))
    cstrs = String[String(k) for k in keys]
    all_set = Ref{Bool}(false)
    GC.@preserve cstrs begin
        ptrs = Ptr{UInt8}[pointer(c) for c in cstrs]
        st = ccall((:ss_store_check, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{UInt8}}, Csize_t, Ptr{Bool}),
                   live_handle(s, "ss_store_check"), ptrs, length(ptrs), all_set)
    end
    check("ss_store_check", st)
    return all_set[]
end

"""
    store_compare_set(s, key, expected, desired) -> Vector{UInt8}

c10d's compare-and-set: `desired` after a swap, else the current value
(`expected` when the key is missing).
"""
function store_compare_set(s::KVStore, key::AbstractString, expected, desired)
    e = expected isa AbstractString ? Vector{UInt8}(codeunits(expected)) : expected
    d = desired isa AbstractString ? Vector{UInt8}(codeunits(desired)) : desired
    buf = zeros(UInt8, max(length(e), length(d), 1))
    len = Ref{Csize_t}(0)
    while true
        st = GC.@preserve e d buf ccall((:ss_store_compare_set, libstorage_sharing()), Cint,
                                        (Ptr{Cvoid}, Cstring, Ptr{Cvoid}, Csize_t, Ptr{Cvoid}, Csize_t, Ptr{Cvoid}, Csize_t, Ptr{Csize_t}),
                                        live_handle(s, "ss_store_compare_set"), key, pointer(e), length(e), pointer(d),
                                        length(d), pointer(buf), length(buf), len)
        if st == SS_ERR_BUFFER_TOO_SMALL && len[] > length(buf)
            resize!(buf, len[])   # a longer current value: ask again (no second swap)
            continue
        end
        check("ss_store_compare_set", st)
        return resize!(buf, len[])
    end
end

"""Deletes `key`; whether it was set."""
function store_delete_key(s::KVStore, key::AbstractString)
    existed = Ref{Bool}(false)
    st = ccall((:ss_store_delete_key, libstorage_sharing()), Cint, (Ptr{Cvoid}, Cstring, Ptr{Bool}),
               live_handle(s, "ss_store_delete_key"), key, existed)
    check("ss_store_delete_key", st)
    return existed[]
end

"""How many keys are set (a TCPStore counts `init/` too)."""
function store_num_keys(s::KVStore)
    n = Ref{Int64}(0)
    st = ccall((:ss_store_num_keys, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Int64}), live_handle(s, "ss_store_num_keys"), n)
    check("ss_store_num_keys", st)
    return n[]
end

"""Waits until every key is set (`SS_ERR_TIMEOUT` names the missing ones)."""
function store_wait(s::KVStore, keys::AbstractVector{<:AbstractString}; timeout_ms::Integer=0)
    any(k -> occursin('\0', k), keys) && throw(ArgumentError("a key contains a NUL byte"))
    cstrs = String[String(k) for k in keys]   # Julia strings end with a NUL
    GC.@preserve cstrs begin
        ptrs = Ptr{UInt8}[pointer(c) for c in cstrs]
        st = ccall((:ss_store_wait, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{UInt8}}, Csize_t, Int64),
                   live_handle(s, "ss_store_wait"), ptrs, length(ptrs), timeout_ms)
    end
    check("ss_store_wait", st)
end

"""
    store_tcp_open(host, port; is_master=false, world_size=0, timeout_ms=0) -> KVStore

Joins (or with `is_master` serves) a PyTorch c10d `TCPStore` at
`host:port`; port 0 with `is_master` picks a free port (`store_tcp_port`).
With `world_size > 0` the master returns once that many ranks joined.
"""
function store_tcp_open(host::AbstractString, port::Integer; is_master::Bool=false, world_size::Integer=0,
                        timeout_ms::Integer=0)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_store_tcp_open, libstorage_sharing()), Cint, (Cstring, Cint, Bool, Cint, Int64, Ptr{Ptr{Cvoid}}),
               host, port, is_master, world_size, timeout_ms, out)
    check("ss_store_tcp_open", st)
    return KVStore(out[])
end

"""The port of a TCPStore (the one its server picked for port 0)."""
function store_tcp_port(s::KVStore)
    out = Ref{Cint}(0)
    st = ccall((:ss_store_tcp_port, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Cint}),
               live_handle(s, "ss_store_tcp_port"), out)
    check("ss_store_tcp_port", st)
    return Int(out[])
end

"""
    StoreCallbacks(set, get, add, wait, free_ctx)

The table of `ss_store_callbacks`: C function pointers (from `@cfunction`,
`free_ctx` may be `C_NULL`) with the signatures of `ss_store_set_fn` ...
in `storage_sharing.h`. Each returns an `ss_status` code as a `Cint`.
"""
struct StoreCallbacks
    struct_size::Csize_t
    set::Ptr{Cvoid}
    get::Ptr{Cvoid}
    add::Ptr{Cvoid}
    wait::Ptr{Cvoid}
    free_ctx::Ptr{Cvoid}
end

StoreCallbacks(set, get, add, wait, free_ctx) =
    StoreCallbacks(Csize_t(sizeof(StoreCallbacks)), set, get, add, wait, free_ctx)

"""
    store_from_callbacks(cb::StoreCallbacks, ctx::Ptr{Cvoid}) -> KVStore

A store whose operations call the host's functions with `ctx`; `free_ctx`
runs once when the last reference is closed. The functions may be called
from any thread: keep them to code that is safe there.
"""
function store_from_callbacks(cb::StoreCallbacks, ctx::Ptr{Cvoid})
    out = Ref{Ptr{Cvoid}}(C_NULL)
    table = Ref(cb)
    st = ccall((:ss_store_callbacks_open, libstorage_sharing()), Cint,
               (Ptr{StoreCallbacks}, Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), table, ctx, out)
    check("ss_store_callbacks_open", st)
    return KVStore(out[])
end
