// Every C++ wrapper that passes a std::string to the C API as a C string
// refuses one with a NUL byte inside (the C side would see it cut short:
// "key\0one" and "key\0two" would be the same key) with Error
// SS_ERR_INVALID_ARGUMENT naming the argument, and writes nothing.
#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "check.hpp"

namespace ss = storage_sharing;
using namespace std::string_literals;

// Runs f, which must refuse argument `what` for its NUL byte.
template <class F>
static void expect_nul_refused(F f, const std::string &what) {
    ss::Error e = expect_error(f, SS_ERR_INVALID_ARGUMENT);
    const std::string text = e.what();
    if (text.find(what + " has a NUL byte") == std::string::npos) {
        std::fprintf(stderr, "error does not name %s's NUL byte: %s\n", what.c_str(), text.c_str());
        std::exit(1);
    }
}

static bool path_exists(const std::string &p) {
    struct stat st;
    return stat(p.c_str(), &st) == 0;
}

static std::string temp_dir() {
    const char *base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/ss-nul-args-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    CHECK(mkdtemp(buf.data()) != nullptr);
    return buf.data();
}

static void store(const std::string &dir) {
    expect_nul_refused([&] { ss::Store::open_file(dir + "/s\0x"s); }, "path");
    CHECK(!path_exists(dir + "/s"));
    expect_nul_refused([] { ss::Store::open_tcp("127.0.0.1\0x"s, 1, false, 1, 100); }, "host");
    ss::Store s = ss::Store::open_file(dir + "/store");
    const std::int64_t before = s.num_keys();
    expect_nul_refused([&] { s.set("key\0one"s, "1"s); }, "key");
    expect_nul_refused([&] { s.set("key\0two"s, std::vector<uint8_t>{2}); }, "key");
    expect_nul_refused([&] { s.get("key\0one"s, 10); }, "key");
    expect_nul_refused([&] { s.get_string("key\0one"s, 10); }, "key");
    expect_nul_refused([&] { s.add("key\0one"s, 5); }, "key");
    expect_nul_refused([&] { s.compare_set("key\0one"s, "", "x"); }, "key");
    expect_nul_refused([&] { s.delete_key("key\0one"s); }, "key");
    expect_nul_refused([&] { s.wait({"ok", "key\0one"s}, 10); }, "keys[1]");
    expect_nul_refused([&] { s.check_keys({"key\0one"s}); }, "keys[0]");
    CHECK(s.num_keys() == before);
    CHECK(!s.check_keys({"key"}));
    // The plain key still works, and the refused ones never reached it.
    s.set("key", "plain"s);
    CHECK(s.get_string("key") == "plain");
}

static void content(const std::string &dir) {
    expect_nul_refused([&] { ss::ContentWriter w(dir + "/c\0x"s); }, "path");
    CHECK(!path_exists(dir + "/c"));
    const std::string root = dir + "/content";
    const double v[2] = {1.0, 2.0};
    {
        ss::ContentWriter w(root);
        w.set_durable(false);
        w.write_tensor("tb", v, sizeof v, SS_DTYPE_FLOAT64, 0, {2}, {1});
        expect_nul_refused([&] { w.write_tensor("t\0a"s, v, sizeof v, SS_DTYPE_FLOAT64, 0, {2}, {1}); }, "name");
        expect_nul_refused([&] { w.write_tensor("tb\0b"s, v, sizeof v, SS_DTYPE_FLOAT64, 0, {2}, {1}); }, "name");
        CHECK(w.counts().tensors_written == 1);
    }
    expect_nul_refused([&] { ss::ContentReader r(root + "\0x"s); }, "path");
    ss::ContentReader r(root);
    CHECK((r.list_tensors() == std::vector<std::string>{"tb"}));
    expect_nul_refused([&] { r.read_tensor("tb\0x"s); }, "name");
    const std::string hash = r.list_storages().at(0);
    expect_nul_refused([&] { r.read_storage(hash + "\0x"s); }, "hash");
}

static void symm(const std::string &dir) {
    expect_nul_refused([&] { ss::symm_set_group_info_file("g\0a"s, 0, 1, dir + "/sg"); }, "group");
    CHECK(!path_exists(dir + "/sg"));
    expect_nul_refused([&] { ss::symm_set_group_info_file("g", 0, 1, dir + "/sg\0x"s); }, "store_dir");
    CHECK(!path_exists(dir + "/sg"));
    ss::Store st = ss::Store::open_file(dir + "/symm-store");
    expect_nul_refused([&] { ss::symm_set_group_info("g\0a"s, 0, 1, st.get()); }, "group");
    ss::symm_set_group_info_file("g", 0, 1, dir + "/symm");
    // "g\0b" is not "g": refused, not an AlreadyExists for "g".
    expect_nul_refused([&] { ss::symm_set_group_info("g\0b"s, 0, 1, st.get()); }, "group");
    expect_nul_refused([] { ss::symm_get_group_info("g\0a"s); }, "group");
    expect_nul_refused([] { ss::symm_set_backend("cpu\0x"s); }, "name");
    expect_nul_refused([] { ss::SymmBlock::alloc(64, "g\0a"s); }, "group");
    expect_nul_refused([] { ss::SymmBlock::alloc_persistent(64, 7, "g\0a"s); }, "group");
    ss::SymmBlock b = ss::SymmBlock::alloc(64, "g");
    expect_nul_refused([&] { b.rendezvous("g\0a"s, 1000); }, "group");
}

static void others() {
    expect_nul_refused([] { ss::Map::open("/ss_nul\0x"s, SS_MAPPED_SHAREDMEM, 4096); }, "name");
    expect_nul_refused([] { ss::Map::open_fd(-1, SS_MAPPED_SHAREDMEM, 4096, "/n\0x"s); }, "name");
    expect_nul_refused([] { ss::Map::open_refcounted("/ss_nul\0x"s, SS_MAPPED_SHAREDMEM, 4096); }, "name");
    expect_nul_refused([] { ss::Storage::open_shared_filename("m\0x"s, "/n", 64); }, "manager");
    expect_nul_refused([] { ss::Storage::open_shared_filename("", "/n\0x"s, 64); }, "name");
    expect_nul_refused([] { ss::shm_manager_set_binary("/bin/true\0x"s); }, "path");
    expect_nul_refused([] { ss::cuda_release_ipc_counter("c\0x"s, 0); }, "counter_name");
    expect_nul_refused([] { ss::cuda_ipc_handle_from_text("00\0x"s); }, "text");
}

int main() {
    const std::string dir = temp_dir();
    store(dir);
    content(dir);
    symm(dir);
    others();
    const std::string cmd = "rm -rf '" + dir + "'";
    CHECK(std::system(cmd.c_str()) == 0);
    std::puts("test_nul_args_raii: ok");
    return 0;
}
