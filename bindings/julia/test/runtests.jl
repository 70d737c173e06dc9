# Tests of the Julia module, for a machine with Julia:
#   STORAGE_SHARING_LIB=<prefix>/lib/libstorage_sharing.so julia --project=bindings/julia bindings/julia/test/runtests.jl
# (Julia cannot be installed on this project's CI machines; there,
# tests/api/julia_bindings_match_header.rs checks every ccall against the C header.)
using Test
using StorageSharing
const SS = StorageSharing

segment_exists(name) = isfile("/dev/shm" * name)

@testset "StorageSharing" begin
    @test occursin(r"^\d+\.\d+\.\d+$", version())

    name = new_segment_name()
    @test startswith(name, "/torch_")
    m = open_map(name, SS.SS_MAPPED_SHAREDMEM | SS.SS_MAPPED_EXCLUSIVE, 4096)
    @test length(m) == 4096 && filename(m) == name && !isrefcounted(m) && fd(m) == -1
    GC.@preserve m begin
        bytes(m)[1:5] .= codeunits("hello")
    end
    m2 = open_map(name, SS.SS_MAPPED_SHAREDMEM | SS.SS_MAPPED_NOCREATE, 4096)
    GC.@preserve m2 @test String(bytes(m2)[1:5]) == "hello"
    @test map_from_data(data(m2)) == m2.handle
    close(m)
    close(m)                      # twice is fine
    @test !isopen(m) && !segment_exists(name)
    close(m2)

    err = try
        open_map(name, SS.SS_MAPPED_SHAREDMEM | SS.SS_MAPPED_NOCREATE, 10); nothing
    catch e
        e
    end
    @test err isa SSError && err.status == SS.SS_ERR_NOT_FOUND && occursin(name, err.message)
    @test_throws SSError fd(m)     # closed

    r = open_refcounted(name, SS.SS_MAPPED_SHAREDMEM | SS.SS_MAPPED_EXCLUSIVE, 100)
    @test refcount(r) == 1
    incref!(r)
    @test refcount(r) == 2 && !decref!(r)
    close(r)
    @test !segment_exists(name)

    s = share_memory(collect(UInt8, 0:255))
    GC.@preserve s @test bytes(s) == collect(UInt8, 0:255)
    @test fd(s) >= 0
    close(s)

    # A forgotten map is freed by its finalizer.
    forgotten = new_segment_name()
    let f = open_map(forgotten, SS.SS_MAPPED_SHAREDMEM | SS.SS_MAPPED_EXCLUSIVE, 64) end
    for _ in 1:100
        GC.gc(true)
        segment_exists(forgotten) || break
        sleep(0.01)
    end
    @test !segment_exists(forgotten)

    # Storages: references, weak references, resizing.
    st = new_storage(1000)
    @test length(st) == 1000 && !isshared(st)
    st2 = storage_ref(st)
    w = weak_ref(st)
    GC.@preserve st st2 begin
        bytes(st)[4] = 0x09
        @test bytes(st2)[4] == 0x09
    end
    resize!(st, 10)
    @test length(st2) == 10 && !expired(w)
    close(st); close(st2)
    @test expired(w)
    err = try upgrade(w); nothing catch e; e end
    @test err isa SSError && err.status == SS.SS_ERR_NOT_FOUND
    close(w)

    # By fd, through a socketpair with send_fds/recv_fds (one process here;
    # the C, C++ and Go tests use two).
    sv = zeros(Cint, 2)
    @test ccall(:socketpair, Cint, (Cint, Cint, Cint, Ptr{Cint}), 1, 1, 0, sv) == 0   # AF_UNIX, SOCK_STREAM
    src = new_storage(4096)
    GC.@preserve src copyto!(bytes(src), codeunits("by fd"))
    shared = share_fd(src)
    @test isshared(src) && shared.nbytes == 4096 && shared_fd(src) == shared.fd
    send_fds(sv[1], Vector{UInt8}("4096"), Cint[shared.fd])
    msg = recv_fds(sv[2], 16, 2)
    @test String(copy(msg.payload)) == "4096" && length(msg.fds) == 1
    r = open_shared_fd(msg.fds[1], 4096)
    ccall(:close, Cint, (Cint,), msg.fds[1])
    GC.@preserve r @test String(bytes(r)[1:5]) == "by fd"
    close(r); close(src)
    send_fds(sv[1], UInt8[0x78], Cint[sv[1], sv[2]])
    err = try recv_fds(sv[2], 8, 1); nothing catch e; e end
    @test err isa SSError && err.status == SS.SS_ERR_BUFFER_TOO_SMALL
    ccall(:close, Cint, (Cint,), sv[1]); ccall(:close, Cint, (Cint,), sv[2])

    # By name, with the in-flight reference.
    s = new_storage(70000)
    GC.@preserve s copyto!(bytes(s), codeunits("by name"))
    info = share_filename(s)
    @test startswith(info.name, "/torch_") && info.nbytes == 70000 && segment_exists(info.name)
    shared_incref!(s)
    o = open_shared_filename(info)
    shared_decref!(o)
    @test shared_refcount(o) == 2
    GC.@preserve o @test String(bytes(o)[1:7]) == "by name"
    close(o)
    @test shared_refcount(s) == 1
    close(s)
    @test !segment_exists(info.name)
    @test endswith(spawn_manager(), "manager.sock")

    # CUDA: the text form and the counter release need no GPU.
    h = cuda_ipc_handle_from_text(cuda_ipc_handle_to_text(CudaIpcHandle()))
    @test h.mem_handle_len == 0 && h.size_bytes == 0
    counters = new_segment_name()
    c = open_refcounted(counters, SS.SS_MAPPED_SHAREDMEM | SS.SS_MAPPED_EXCLUSIVE, SS.SS_CUDA_COUNTER_SLOTS * 8)
    GC.@preserve c unsafe_store!(Ptr{Int64}(data(c)), 1, 6)   # slot 5 = 1
    cuda_release_ipc_counter(counters, 5)
    err = try cuda_release_ipc_counter(counters, 5); nothing catch e; e end
    @test err isa SSError && err.status == SS.SS_ERR_BAD_REFCOUNT
    close(c)
    err = try cuda_release_ipc_counter(counters, 5); nothing catch e; e end
    @test err isa SSError && err.status == SS.SS_ERR_PEER_GONE
    if !cuda_available()
        @test startswith(cuda_unavailable_reason(), "CUDA is not available: ")
        err = try cuda_driver_info(); nothing catch e; e end
        @test err isa SSError && err.status == SS.SS_ERR_CUDA_UNAVAILABLE
        @test cuda_ipc_collect() == 0 && cuda_limbo_size() == 0
    else
        p = cuda_malloc(0, 1 << 20)
        @test cuda_pointer_base(p, 0).base == p
        sh = cuda_share(p, 1 << 20, 0)
        @test sent_counter(sh.sent) == 1
        close(sh.sent)   # in limbo until the slot is released
        counter_name = String(UInt8[b for b in Iterators.takewhile(!iszero, sh.handle.ref_counter_handle)])
        cuda_release_ipc_counter(counter_name, sh.handle.ref_counter_offset)
        @test cuda_ipc_collect() == 1
        cuda_free(0, p)
    end
end
