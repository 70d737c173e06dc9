/* Share-and-open speed inside one libtorch program: storage_sharing's
 * torch.hpp against what a libtorch user has today, ATen's MapAllocator /
 * RefcountedMapAllocator called directly plus the copy into shared memory.
 * Built on demand (tests/libtorch/run.sh --bench); not a test.
 *
 * One round, for each size and strategy: make a tensor of N bytes and
 * write it (the producer's data), share it, open it a second time (the
 * consumer's mapping, here in the same process), read it, drop both.
 *   ours by fd:    empty_shared(FileDescriptor) -> share_fd (no copy) -> open_shared_fd
 *   ATen by fd:    at::empty -> MapAllocator(flags 86) + memcpy -> MapAllocator(WITH_FD, dup, flags 58)
 *   ours by name:  empty_shared(FileSystem) -> share_filename (no copy; manager) -> open_shared_filename
 *   ATen by name:  at::empty -> RefcountedMapAllocator(flags 6) + memcpy -> RefcountedMapAllocator(flags 10)
 *   libshm by name: at::empty -> THManagedMapAllocator(flags 6) + memcpy -> THManagedMapAllocator(flags 10)
 * ATen's by-name path registers with no manager, so ours pays two manager
 * round trips per round that it does not (and it leaves segments behind
 * on kill -9); libshm's THManagedMapAllocator (torch/lib/libshm.so, what
 * PyTorch itself uses) pays them too, and is the like-for-like column.
 *   libtorch_bench [TORCH_SHM_MANAGER]   (the libshm row needs it) */
#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>
#include <ATen/Parallel.h>
#include <libshm.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include <storage_sharing/torch.hpp>

namespace sst = storage_sharing::libtorch;
using Clock = std::chrono::steady_clock;

namespace {

volatile std::uint8_t g_sink;

void produce(at::Tensor &t) { t.fill_(7); }
void consume(const std::uint8_t *p, std::size_t n) { g_sink = p[0] ^ p[n - 1]; }

void ours_fd(std::size_t n) {
    at::Tensor t = sst::empty_shared({static_cast<int64_t>(n)}, at::kByte, sst::Strategy::FileDescriptor);
    produce(t);
    storage_sharing::SharedFd s = sst::share_fd(t.storage());
    c10::Storage opened = sst::open_shared_fd(s.fd, s.nbytes);
    consume(static_cast<const std::uint8_t *>(opened.data()), n);
}

void aten_fd(std::size_t n) {
    at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::kByte);
    produce(t);
    at::MapAllocator shared(at::NewProcessWideShmHandle(),
                            at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_EXCLUSIVE | at::ALLOCATOR_MAPPED_KEEPFD |
                                at::ALLOCATOR_MAPPED_UNLINK,
                            n);
    std::memcpy(shared.data(), t.data_ptr(), n);
    at::MapAllocator opened(at::WITH_FD, "", ::dup(shared.fd()),
                            at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_NOCREATE | at::ALLOCATOR_MAPPED_KEEPFD |
                                at::ALLOCATOR_MAPPED_FROMFD,
                            n);
    consume(static_cast<const std::uint8_t *>(opened.data()), n);
}

void ours_name(std::size_t n) {
    at::Tensor t = sst::empty_shared({static_cast<int64_t>(n)}, at::kByte, sst::Strategy::FileSystem);
    produce(t);
    storage_sharing::SharedFilename s = sst::share_filename(t.storage());
    sst::shared_incref(t.storage());
    c10::Storage opened = sst::open_shared_filename(s);
    sst::shared_decref(opened);
    consume(static_cast<const std::uint8_t *>(opened.data()), n);
}

void aten_name(std::size_t n) {
    at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::kByte);
    produce(t);
    std::string name = at::NewProcessWideShmHandle();
    at::RefcountedMapAllocator shared(name.c_str(), at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_EXCLUSIVE, n);
    std::memcpy(shared.data(), t.data_ptr(), n);
    shared.incref();
    at::RefcountedMapAllocator opened(name.c_str(), at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_NOCREATE, n);
    opened.decref();
    consume(static_cast<const std::uint8_t *>(opened.data()), n);
}

void libshm_name(std::size_t n) {
    at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::kByte);
    produce(t);
    std::string name = at::NewProcessWideShmHandle();
    at::DataPtr shared =
        THManagedMapAllocator::makeDataPtr("", name.c_str(), at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_EXCLUSIVE, n);
    std::memcpy(shared.get(), t.data_ptr(), n);
    THManagedMapAllocator *ctx = THManagedMapAllocator::fromDataPtr(shared);
    ctx->incref();
    at::DataPtr opened = THManagedMapAllocator::makeDataPtr(ctx->manager_handle(), name.c_str(),
                                                            at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_NOCREATE, n);
    THManagedMapAllocator::fromDataPtr(opened)->decref();
    consume(static_cast<const std::uint8_t *>(opened.get()), n);
}

/* Median microseconds of one round. */
double median_us(const std::function<void(std::size_t)> &round, std::size_t n, int rounds) {
    round(n); /* warm-up */
    std::vector<double> us;
    for (int i = 0; i < rounds; i++) {
        auto t0 = Clock::now();
        round(n);
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    return us[us.size() / 2];
}

}  // namespace

int main(int argc, char **argv) {
    at::set_num_threads(1);
    bool with_libshm = argc > 1;
    if (with_libshm) libshm_init(argv[1]);
    struct Size {
        const char *label;
        std::size_t bytes;
        int rounds;
    };
    const Size sizes[] = {{"4 KiB", 4096, 2001}, {"1 MiB", 1 << 20, 301}, {"256 MiB", 256u << 20, 7}};
    std::printf("%-8s %-14s %14s %14s %10s\n", "size", "strategy", "ours (us)", "theirs (us)", "theirs/ours");
    for (const Size &s : sizes) {
        double of = median_us(ours_fd, s.bytes, s.rounds), af = median_us(aten_fd, s.bytes, s.rounds);
        std::printf("%-8s %-14s %14.1f %14.1f %10.2f\n", s.label, "fd/ATen", of, af, af / of);
        double on = median_us(ours_name, s.bytes, s.rounds), an = median_us(aten_name, s.bytes, s.rounds);
        std::printf("%-8s %-14s %14.1f %14.1f %10.2f\n", s.label, "name/ATen", on, an, an / on);
        if (with_libshm) {
            double ln = median_us(libshm_name, s.bytes, s.rounds);
            std::printf("%-8s %-14s %14.1f %14.1f %10.2f\n", s.label, "name/libshm", on, ln, ln / on);
        }
    }
    return 0;
}
