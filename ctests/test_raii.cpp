// The C++ RAII layer (storage_sharing.hpp): ownership, moves, exceptions,
// and a second process, with /dev/shm checked after every scope.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "check.hpp"

namespace ss = storage_sharing;

static_assert(!std::is_copy_constructible_v<ss::Map> && !std::is_copy_assignable_v<ss::Map>, "Map is move-only");
static_assert(std::is_nothrow_move_constructible_v<ss::Map> && std::is_nothrow_move_assignable_v<ss::Map>,
              "moving a Map cannot throw");
static_assert(std::is_copy_constructible_v<ss::MapView>, "views are cheap borrowed copies");
static_assert(std::is_base_of_v<std::runtime_error, ss::Error>, "errors are std exceptions");

static void test_destructor_unmaps_and_removes_name() {
    std::string name = ss::new_process_wide_shm_handle();
    CHECK(name.rfind("/torch_", 0) == 0);
    {
        ss::Map m = ss::Map::open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 4096);
        CHECK(m && m.size() == 4096 && m.filename() == name && !m.is_refcounted() && m.fd() == -1);
        m.data_as<char>()[0] = 'a';
        ss::Map again = ss::Map::open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE | SS_MAPPED_KEEPFD, 4096);
        CHECK(again.data_as<char>()[0] == 'a' && again.fd() >= 0);
        CHECK(shm_exists(name));
    }
    CHECK(!shm_exists(name));
}

static void test_moves_transfer_ownership() {
    std::string n1 = ss::new_process_wide_shm_handle(), n2 = ss::new_process_wide_shm_handle();
    ss::Map a = ss::Map::open(n1, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 100);
    void *data = a.data();
    ss::Map b = std::move(a);
    CHECK(!a && a.get() == nullptr && a.data() == nullptr && a.size() == 0);  // NOLINT: checking moved-from state
    CHECK(b && b.data() == data && b.size() == 100);
    ss::Map c = ss::Map::open(n2, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 100);
    c = std::move(b);  // c's old map (n2) is released here
    CHECK(!shm_exists(n2) && shm_exists(n1));
    CHECK(c.data() == data && c.filename() == n1);
    ss::Map &alias = c;
    c = std::move(alias);  // self-move keeps the map
    CHECK(c.data() == data);
    ss::Map empty;
    CHECK(!empty && empty.size() == 0);
    empty.close();  // nothing to close: no error
    c = std::move(empty);
    CHECK(!c && !shm_exists(n1));
}

static void test_errors_carry_status_and_message() {
    std::string name = ss::new_process_wide_shm_handle();
    ss::Error e = expect_error([&] { ss::Map::open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 10); },
                               SS_ERR_NOT_FOUND);
    CHECK(std::string(e.what()).rfind("ss_map_open: ", 0) == 0);
    CHECK(e.detail().find(name) != std::string::npos);
    CHECK(std::strcmp(e.status_text(), "not found") == 0);
    expect_error([&] { ss::Map::open(name, SS_MAPPED_SHAREDMEM, 0); }, SS_ERR_INVALID_ARGUMENT);
    expect_error([&] { ss::Map::open_refcounted(name, SS_MAPPED_SHARED, 10); }, SS_ERR_UNSUPPORTED);
    expect_error([&] { ss::Map::share_memory(nullptr, 10); }, SS_ERR_NULL_POINTER);
    expect_error([&] { ss::Map::new_fd_storage(0); }, SS_ERR_INVALID_ARGUMENT);
    ss::Map plain = ss::Map::open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 10);
    e = expect_error([&] { plain.refcount(); }, SS_ERR_UNSUPPORTED);
    CHECK(std::string(e.what()).rfind("ss_map_refcount: ", 0) == 0);
    expect_error([&] { ss::Map::open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 10); }, SS_ERR_ALREADY_EXISTS);
    plain.close();
    plain.close();  // twice is fine
    CHECK(plain && plain.data() == nullptr);
    CHECK(!shm_exists(name));
}

static void test_open_fd_failure_leaves_fd_with_caller() {
    ss::Map s = ss::Map::new_fd_storage(4096);
    CHECK(s.flags() == 86 && s.fd() >= 0);
    int fd = dup(s.fd());
    expect_error([&] { ss::Map::open_fd(fd, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE | SS_MAPPED_FROMFD, 1 << 20); },
                 SS_ERR_SIZE_MISMATCH);
    CHECK(fcntl(fd, F_GETFD) >= 0);
    {
        ss::Map r = ss::Map::open_fd(fd, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE | SS_MAPPED_FROMFD | SS_MAPPED_KEEPFD,
                                     4096, "named-fd");
        CHECK(r.fd() == fd && r.filename() == "named-fd");
    }
    CHECK(fcntl(fd, F_GETFD) < 0);  // the map owned it and closed it
}

static void test_refcounted_across_fork() {
    std::string name = ss::new_process_wide_shm_handle();
    ss::Map m = ss::Map::open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 512);
    CHECK(m.is_refcounted() && m.refcount() == 1);
    std::memset(m.data(), 0x11, 512);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int code = 0;
        try {
            ss::Map c = ss::Map::open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 512);
            if (c.data_as<unsigned char>()[511] != 0x11) code = 2;
            c.data_as<unsigned char>()[0] = 0x22;
            c.incref();  // leaves +1 for the parent to see
        } catch (const ss::Error &) {
            code = 3;
        }
        _exit(code);  // c was destroyed above: its own open is released
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(m.data_as<unsigned char>()[0] == 0x22);
    CHECK(m.refcount() == 2);
    CHECK(!m.decref());
    CHECK(shm_exists(name));
    m.close();
    CHECK(!shm_exists(name));
    expect_error([&] { m.refcount(); }, SS_ERR_CLOSED);
}

static void test_release_and_views() {
    std::string name = ss::new_process_wide_shm_handle();
    unsigned char src[300];
    for (unsigned i = 0; i < sizeof src; i++) src[i] = static_cast<unsigned char>(i);
    ss::Map m = ss::Map::share_memory(src, sizeof src);
    CHECK(std::memcmp(m.data(), src, sizeof src) == 0);
    ss::MapView v = ss::MapView::from_data(m.data_as<unsigned char>() + 299);
    CHECK(v.get() == m.get() && v.size() == sizeof src);
    int local = 0;
    CHECK(!ss::MapView::from_data(&local));
    // Handing the handle to a framework: release, then its deleter frees it.
    ss::Map named = ss::Map::open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 64);
    void *data = named.data();
    ss_map *raw = named.release();
    CHECK(!named && named.data() == nullptr);
    CHECK(ss::MapView::from_data(data).get() == raw);
    ss::free_map_context(raw);
    CHECK(!ss::MapView::from_data(data) && !shm_exists(name));
}

static void test_unique_handle() {
    using H = ss::unique_handle<ss_map, ss_map_free>;
    static_assert(!std::is_copy_constructible_v<H> && std::is_nothrow_move_constructible_v<H>, "move-only");
    ss_map *raw = nullptr;
    CHECK_OK(ss_map_new_shm_fd(128, &raw));
    H h(raw);
    H g = std::move(h);
    CHECK(!h && g.get() == raw);
    g.reset();  // freed here; LeakSanitizer (ASan run) reports it otherwise
    CHECK(!g);
}

int main() {
    CHECK(ss::version() == SS_VERSION_STRING);
    test_destructor_unmaps_and_removes_name();
    test_moves_transfer_ownership();
    test_errors_carry_status_and_message();
    test_open_fd_failure_leaves_fd_with_caller();
    test_refcounted_across_fork();
    test_release_and_views();
    test_unique_handle();
    std::printf("test_raii: all checks passed\n");
    return 0;
}
