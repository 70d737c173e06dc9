# Storages (ss_storage, ss_weak), sharing them by fd or by name, descriptor
# passing and the manager daemon. Included by StorageSharing.jl.

"""
    SharedStorage

One strong reference to a storage (`ss_storage`): a byte buffer that can
move into shared memory and be opened by other processes. Release it with
`close`; the bytes go with the last reference.
"""
mutable struct SharedStorage
    handle::Ptr{Cvoid}
    function SharedStorage(handle::Ptr{Cvoid})
        s = new(handle)
        finalizer(free_storage!, s)
        return s
    end
end

function free_storage!(s::SharedStorage)
    h = s.handle
    s.handle = C_NULL
    h == C_NULL || ccall((:ss_storage_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

function live_handle(s::SharedStorage, op::String)
    s.handle == C_NULL && throw(SSError(op, SS_ERR_CLOSED, "the storage was closed"))
    return s.handle
end

"""`n` zero bytes on the heap (resizable until shared)."""
function new_storage(n::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_storage_new, libstorage_sharing()), Cint, (Csize_t, Ptr{Ptr{Cvoid}}), n, out)
    check("ss_storage_new", st)
    return SharedStorage(out[])
end

"""A new fd-backed shared storage of `n` zero bytes (ATen flags 86)."""
function storage_using_fd(n::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_storage_new_using_fd, libstorage_sharing()), Cint, (Csize_t, Ptr{Ptr{Cvoid}}), n, out)
    check("ss_storage_new_using_fd", st)
    return SharedStorage(out[])
end

"""A new managed shared storage of `n` zero bytes (ATen flags 6)."""
function storage_using_filename(n::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_storage_new_using_filename, libstorage_sharing()), Cint, (Csize_t, Ptr{Ptr{Cvoid}}), n, out)
    check("ss_storage_new_using_filename", st)
    return SharedStorage(out[])
end

"""
    open_shared_fd(fd, n) -> SharedStorage

Opens a storage shared by fd (a duplicate of `fd` is mapped: the caller
still closes `fd`).
"""
function open_shared_fd(fd::Integer, n::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_storage_new_shared_fd, libstorage_sharing()), Cint, (Cint, Csize_t, Ptr{Ptr{Cvoid}}), fd, n, out)
    check("ss_storage_new_shared_fd", st)
    return SharedStorage(out[])
end

"""
    open_shared_filename(manager, name, n) -> SharedStorage

Opens a storage shared by name (`manager` "" = this process's own). Under
torch.multiprocessing's protocol call `shared_decref!` after opening.
"""
function open_shared_filename(manager::AbstractString, name::AbstractString, n::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = ccall((:ss_storage_new_shared_filename, libstorage_sharing()), Cint,
               (Cstring, Cstring, Csize_t, Ptr{Ptr{Cvoid}}), manager, name, n, out)
    check("ss_storage_new_shared_filename", st)
    return SharedStorage(out[])
end
open_shared_filename(shared::NamedTuple) = open_shared_filename(shared.manager, shared.name, shared.nbytes)

"""A second strong reference to the same bytes (close both)."""
function storage_ref(s::SharedStorage)
    h = live_handle(s, "ss_storage_ref")
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve s ccall((:ss_storage_ref, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), h, out)
    check("ss_storage_ref", st)
    return SharedStorage(out[])
end

"""Start of the bytes (`C_NULL` when empty); changes when a heap storage is shared."""
function data(s::SharedStorage)
    h = live_handle(s, "ss_storage_data")
    return GC.@preserve s ccall((:ss_storage_data, libstorage_sharing()), Ptr{UInt8}, (Ptr{Cvoid},), h)
end

function Base.length(s::SharedStorage)
    s.handle == C_NULL && return 0
    return Int(GC.@preserve s ccall((:ss_storage_nbytes, libstorage_sharing()), Csize_t, (Ptr{Cvoid},), s.handle))
end

"""The bytes as an array that does not own them: use inside `GC.@preserve s`, retake after sharing."""
bytes(s::SharedStorage) = unsafe_wrap(Array, data(s), length(s); own=false)

"""Whether the bytes are in shared memory."""
function isshared(s::SharedStorage)
    h = live_handle(s, "ss_storage_is_shared")
    return GC.@preserve s ccall((:ss_storage_is_shared, libstorage_sharing()), Bool, (Ptr{Cvoid},), h)
end

"""Resizes a heap storage (a shared one throws `SS_ERR_UNSUPPORTED`)."""
function Base.resize!(s::SharedStorage, n::Integer)
    h = live_handle(s, "ss_storage_resize")
    st = GC.@preserve s ccall((:ss_storage_resize, libstorage_sharing()), Cint, (Ptr{Cvoid}, Csize_t), h, n)
    check("ss_storage_resize", st)
    return s
end

"""
    share_fd(s) -> (fd, nbytes)

Moves the bytes into a nameless fd-backed segment (once). The fd stays the
storage's: send it or dup it, never close it.
"""
function share_fd(s::SharedStorage)
    h = live_handle(s, "ss_storage_share_fd")
    fd = Ref{Cint}(-1)
    n = Ref{Csize_t}(0)
    st = GC.@preserve s ccall((:ss_storage_share_fd, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Cint}, Ptr{Csize_t}),
                              h, fd, n)
    check("ss_storage_share_fd", st)
    return (fd=Int(fd[]), nbytes=Int(n[]))
end

"""The descriptor of an fd-backed storage (`SS_ERR_NOT_FOUND` otherwise)."""
function shared_fd(s::SharedStorage)
    h = live_handle(s, "ss_storage_get_shared_fd")
    fd = Ref{Cint}(-1)
    st = GC.@preserve s ccall((:ss_storage_get_shared_fd, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Cint}), h, fd)
    check("ss_storage_get_shared_fd", st)
    return Int(fd[])
end

"""
    share_filename(s) -> (manager=..., name=..., nbytes=...)

Moves the bytes into a managed refcounted segment (once): what
`open_shared_filename` takes in another process. Call `shared_incref!`
before sending it.
"""
function share_filename(s::SharedStorage)
    h = live_handle(s, "ss_storage_share_filename")
    manager = zeros(UInt8, 108)
    name = zeros(UInt8, 64)
    n = Ref{Csize_t}(0)
    st = GC.@preserve s manager name ccall((:ss_storage_share_filename, libstorage_sharing()), Cint,
                                           (Ptr{Cvoid}, Ptr{UInt8}, Csize_t, Ptr{UInt8}, Csize_t, Ptr{Csize_t}),
                                           h, manager, length(manager), name, length(name), n)
    check("ss_storage_share_filename", st)
    return (manager=unsafe_string(pointer(manager)), name=unsafe_string(pointer(name)), nbytes=Int(n[]))
end

"""Adds one to a storage shared by name's header count (the reference in flight)."""
function shared_incref!(s::SharedStorage)
    h = live_handle(s, "ss_storage_shared_incref")
    st = GC.@preserve s ccall((:ss_storage_shared_incref, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
    check("ss_storage_shared_incref", st)
end

"""Subtracts one from the header count (the name is never removed here)."""
function shared_decref!(s::SharedStorage)
    h = live_handle(s, "ss_storage_shared_decref")
    st = GC.@preserve s ccall((:ss_storage_shared_decref, libstorage_sharing()), Cint, (Ptr{Cvoid},), h)
    check("ss_storage_shared_decref", st)
end

"""The header count of a storage shared by name."""
function shared_refcount(s::SharedStorage)
    h = live_handle(s, "ss_storage_shared_refcount")
    n = Ref{Int32}(0)
    st = GC.@preserve s ccall((:ss_storage_shared_refcount, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Int32}), h, n)
    check("ss_storage_shared_refcount", st)
    return n[]
end

"""Drops this strong reference; twice does nothing."""
Base.close(s::SharedStorage) = free_storage!(s)
Base.isopen(s::SharedStorage) = s.handle != C_NULL

"""
    WeakStorage

A weak reference (`ss_weak`): does not keep the bytes alive.
"""
mutable struct WeakStorage
    handle::Ptr{Cvoid}
    function WeakStorage(handle::Ptr{Cvoid})
        w = new(handle)
        finalizer(free_weak!, w)
        return w
    end
end

function free_weak!(w::WeakStorage)
    h = w.handle
    w.handle = C_NULL
    h == C_NULL || ccall((:ss_weak_free, libstorage_sharing()), Cvoid, (Ptr{Cvoid},), h)
    return nothing
end

"""A weak reference to `s`."""
function weak_ref(s::SharedStorage)
    h = live_handle(s, "ss_storage_weak_ref")
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve s ccall((:ss_storage_weak_ref, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), h, out)
    check("ss_storage_weak_ref", st)
    return WeakStorage(out[])
end

"""A new strong reference while the storage lives; `SS_ERR_NOT_FOUND` after."""
function upgrade(w::WeakStorage)
    w.handle == C_NULL && throw(SSError("ss_weak_upgrade", SS_ERR_CLOSED, "the weak reference was closed"))
    out = Ref{Ptr{Cvoid}}(C_NULL)
    st = GC.@preserve w ccall((:ss_weak_upgrade, libstorage_sharing()), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
                              w.handle, out)
    check("ss_weak_upgrade", st)
    return SharedStorage(out[])
end

"""Whether no strong reference is left (true once closed)."""
expired(w::WeakStorage) = GC.@preserve w ccall((:ss_weak_expired, libstorage_sharing()), Bool, (Ptr{Cvoid},), w.handle)

Base.close(w::WeakStorage) = free_weak!(w)

"""
    send_fds(sock, payload, fds)

Sends `payload` (at least one byte) and the descriptors `fds` (they stay
open here) over the connected Unix socket `sock`.
"""
function send_fds(sock::Integer, payload::Vector{UInt8}, fds::Vector{Cint}=Cint[])
    st = GC.@preserve payload fds ccall((:ss_fds_send, libstorage_sharing()), Cint,
                                        (Cint, Ptr{Cvoid}, Csize_t, Ptr{Cint}, Csize_t),
                                        sock, payload, length(payload), fds, length(fds))
    check("ss_fds_send", st)
end

"""
    recv_fds(sock, maxlen, maxfds) -> (payload, fds)

Receives one message (an empty payload: the peer closed) and its
descriptors, owned by the caller (close-on-exec).
"""
function recv_fds(sock::Integer, maxlen::Integer, maxfds::Integer)
    buf = zeros(UInt8, maxlen)
    fds = fill(Cint(-1), maxfds)
    n = Ref{Csize_t}(0)
    nfds = Ref{Csize_t}(0)
    st = GC.@preserve buf fds ccall((:ss_fds_recv, libstorage_sharing()), Cint,
                                    (Cint, Ptr{Cvoid}, Csize_t, Ptr{Csize_t}, Ptr{Cint}, Csize_t, Ptr{Csize_t}),
                                    sock, buf, length(buf), n, fds, length(fds), nfds)
    check("ss_fds_recv", st)
    return (payload=buf[1:n[]], fds=fds[1:nfds[]])
end

"""Uses the daemon binary at `path` when a manager must be started."""
function set_manager_binary(path::AbstractString)
    st = ccall((:ss_shm_manager_set_binary, libstorage_sharing()), Cint, (Cstring,), path)
    check("ss_shm_manager_set_binary", st)
end

"""Starts a new manager daemon; returns its socket path (a manager handle)."""
function spawn_manager()
    buf = zeros(UInt8, 108)
    st = GC.@preserve buf ccall((:ss_shm_manager_spawn, libstorage_sharing()), Cint, (Ptr{UInt8}, Csize_t),
                                buf, length(buf))
    check("ss_shm_manager_spawn", st)
    return GC.@preserve buf unsafe_string(pointer(buf))
end
