// The C++ layer over symmetric memory (storage_sharing.hpp): a forked pair
// of ranks through a file store, ownership of blocks, and the exceptions
// for bad ranks, ranges, channels and groups.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "check.hpp"

namespace ss = storage_sharing;

static_assert(!std::is_copy_constructible_v<ss::SymmBlock> && std::is_nothrow_move_constructible_v<ss::SymmBlock>,
              "SymmBlock is move-only");

static int rank_main(const std::string &dir, int rank) {
    ss::symm_set_group_info_file("cxx", rank, 2, dir);
    ss::SymmGroupInfo info = ss::symm_get_group_info("cxx");
    if (info.rank != rank || info.world_size != 2) return 10;
    ss::SymmBlock block = ss::SymmBlock::alloc(256 * sizeof(std::uint32_t), "cxx");
    if (block.size() != 256 * sizeof(std::uint32_t)) return 11;
    ss::SymmMem mem = block.rendezvous("", 20000);
    auto *own = static_cast<std::uint32_t *>(block.data());
    for (std::uint32_t i = 0; i < 256; i++) own[i] = i * 3u + static_cast<std::uint32_t>(rank);
    mem.barrier(0, 20000);
    const int peer = 1 - rank;
    auto *theirs = static_cast<const std::uint32_t *>(mem.buffer_ptr(peer));
    for (std::uint32_t i = 0; i < 256; i++)
        if (theirs[i] != i * 3u + static_cast<std::uint32_t>(peer)) return 12;
    mem.barrier(0, 20000);
    if (rank == 0) {
        auto *slot = static_cast<std::uint32_t *>(mem.get_buffer(1, 4, 40));
        *slot = 0xC0FFEEu;
        mem.put_signal(1, 2, 20000);
    } else {
        mem.wait_signal(0, 2, 20000);
        if (own[10] != 0xC0FFEEu) return 13;
    }
    mem.barrier(0, 20000);
    // After the last sync every signal sent to us was consumed: own pad is 0.
    for (std::size_t i = 0; i < mem.signal_pad_size() / 4; i++)
        if (mem.signal_pad_ptr(rank)[i] != 0) return 14;
    block.free();
    return 0;
}

static void errors() {
    char dir[] = "/tmp/symm-cxx-solo-XXXXXX";
    CHECK(mkdtemp(dir) != nullptr);
    ss::symm_set_group_info_file("cxx-solo", 0, 1, dir);
    expect_error([&] { ss::symm_set_group_info_file("cxx-solo", 0, 1, dir); }, SS_ERR_ALREADY_EXISTS);
    expect_error([] { ss::symm_get_group_info("nope"); }, SS_ERR_NOT_FOUND);
    if (!ss_cuda_available()) /* no driver or device: the reason, typed */
        expect_error([] { ss::SymmBlock::alloc(64, "", SS_DEVICE_CUDA); }, SS_ERR_CUDA_UNAVAILABLE);
    ss::SymmBlock block = ss::SymmBlock::alloc(100, "cxx-solo");
    ss::SymmMem mem = block.rendezvous("", 10000);
    if (block.rendezvous("cxx-solo", 10000).get() != mem.get()) {
        std::fprintf(stderr, "a second rendezvous gave another object\n");
        std::exit(1);
    }
    expect_error([&] { mem.buffer_ptr(1); }, SS_ERR_INVALID_ARGUMENT);
    CHECK(mem.buffer_ptrs_dev()[0] == mem.buffer_ptr(0)); /* a CPU block: a host array */
    CHECK(mem.signal_pad_ptrs_dev()[0] == static_cast<void *>(mem.signal_pad_ptr(0)));
    CHECK(!mem.has_multicast());
    expect_error([&] { mem.multicast_ptr(); }, SS_ERR_UNSUPPORTED);
    ss::Error e = expect_error([&] { mem.get_buffer(0, 60, 50); }, SS_ERR_INVALID_ARGUMENT);
    CHECK(std::strstr(e.what(), "the requested size (110 bytes) exceeds the allocated size (100 bytes)") != nullptr);
    expect_error([&] { mem.barrier(-1, 10); }, SS_ERR_INVALID_ARGUMENT);
    e = expect_error([&] { mem.wait_signal(0, 4, 30); }, SS_ERR_TIMEOUT);
    CHECK(std::strstr(e.what(), "rank 0 failed to receive signal from rank 0 on channel 4") != nullptr);
    ss::SymmBlock moved = std::move(block);
    CHECK(block.data() == nullptr && moved.data() != nullptr);
    moved.free();
    expect_error([&] { ss::SymmBlock::alloc(100).rendezvous("nope", 10); }, SS_ERR_NOT_FOUND);
    std::string rm = std::string("rm -rf ") + dir;
    CHECK(std::system(rm.c_str()) == 0);
}

int main() {
    char dir[] = "/tmp/symm-cxx-XXXXXX";
    CHECK(mkdtemp(dir) != nullptr);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        int rc = 1;
        try {
            rc = rank_main(dir, 1);
        } catch (const ss::Error &err) {
            std::fprintf(stderr, "rank 1: %s\n", err.what());
        }
        _exit(rc);
    }
    int rc0 = rank_main(dir, 0);
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child);
    CHECK(rc0 == 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    std::string rm = std::string("rm -rf ") + dir;
    CHECK(std::system(rm.c_str()) == 0);
    errors();
    std::puts("test_symm_raii: ok");
    return 0;
}
