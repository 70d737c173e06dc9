// The C++ arena layer: RAII views, exceptions with the status, a storage in
// the arena, a block shared and opened in one process (by name).
#include <cstring>
#include <type_traits>

#include "check.hpp"

namespace ss = storage_sharing;

int main() {
    ss_arena_options o = ss::arena_options_default();
    o.strategy = SS_ARENA_BY_NAME;
    o.segment_size = std::size_t{4} << 20;
    ss::Arena a = ss::Arena::open(o);
    void *p = a.alloc(1000);
    std::memset(p, 7, 1000);
    ss_arena_handle h = a.share(p);
    {
        ss::ArenaView v = ss::ArenaView::open(h);
        CHECK(v.size() >= 1000 && v.data_as<unsigned char>()[999] == 7);
        a.free(p);
        CHECK(a.stats().deferred_blocks == 1);
    }
    CHECK(a.collect().recycled_blocks == 1);
    expect_error([&] { a.free(p); }, SS_ERR_INVALID_ARGUMENT);
    expect_error([&] { ss::ArenaView::open(h); }, SS_ERR_INVALID_ARGUMENT);
    static_assert(!std::is_copy_constructible_v<ss::Arena>, "Arena is move-only");
    static_assert(!std::is_copy_constructible_v<ss::ArenaView>, "ArenaView is move-only");
    ss::Storage s = a.new_storage(std::size_t{2} << 20);
    CHECK(s.is_shared() && s.nbytes() == (std::size_t{2} << 20));
    return 0;
}
