#include <cstdio>
#include <cstring>
#include <storage_sharing.hpp>

namespace ss = storage_sharing;

int main() {
    try {
        std::string name = ss::new_process_wide_shm_handle();
        ss::Map map = ss::Map::open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 4096);
        std::strcpy(map.data_as<char>(), "hello");
        std::printf("%s: %zu bytes, refcount %d\n", name.c_str(), map.size(), map.refcount());
    } catch (const ss::Error &e) {  // e.status(), e.detail()
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
}
