# Tests of the Julia module, for a machine with Julia:
#   STORAGE_SHARING_LIB=<prefix>/lib/libstorage_sharing.so julia --project=bindings/julia bindings/julia/test/runtests.jl
# (Julia cannot be installed on this project's CI machines; there,
# tests/bindings_julia.rs checks every ccall against the C header.)
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
end
