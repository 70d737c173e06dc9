// From C++: a name with a NUL inside is refused
// (never cut short at the NUL), and SHARED with SHAREDMEM is refused
// without touching the user's file.
#include <cstdio>
#include <string>

#include "check.hpp"

namespace ss = storage_sharing;

static void test_embedded_nul_is_refused() {
    std::string prefix = ss::new_process_wide_shm_handle();
    std::string cut = prefix + std::string(1, '\0') + "b";
    int create = SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE;
    ss::Error e = expect_error([&] { ss::Map::open(cut, create, 16); }, SS_ERR_INVALID_ARGUMENT);
    CHECK(e.detail().find("NUL") != std::string::npos);
    CHECK(!shm_exists(prefix));
    expect_error([&] { ss::Map::open_refcounted(cut, create, 16); }, SS_ERR_INVALID_ARGUMENT);
    CHECK(!shm_exists(prefix));
    ss::Map existing = ss::Map::open(prefix, create, 16);
    expect_error([&] { ss::Map::open(cut, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 16); }, SS_ERR_INVALID_ARGUMENT);
    expect_error([&] { ss::Map::open_fd(0, SS_MAPPED_FROMFD, 16, cut); }, SS_ERR_INVALID_ARGUMENT);
}

static void test_shared_with_sharedmem_keeps_the_file() {
    char path[] = "/tmp/ss-ctest-names-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK(write(fd, "keep", 4) == 4);
    close(fd);
    expect_error([&] { ss::Map::open(path, SS_MAPPED_SHARED | SS_MAPPED_SHAREDMEM, 4); }, SS_ERR_INVALID_ARGUMENT);
    expect_error([&] { ss::Map::open_refcounted(path, SS_MAPPED_SHARED | SS_MAPPED_SHAREDMEM, 4); },
                 SS_ERR_INVALID_ARGUMENT);
    expect_error([&] { ss::Map::open(path, SS_MAPPED_SHARED | SS_MAPPED_UNLINK, 4); }, SS_ERR_INVALID_ARGUMENT);
    CHECK(access(path, F_OK) == 0);
    CHECK(unlink(path) == 0);
}

int main() {
    test_embedded_nul_is_refused();
    test_shared_with_sharedmem_keeps_the_file();
    std::puts("test_names_raii: ok");
    return 0;
}
