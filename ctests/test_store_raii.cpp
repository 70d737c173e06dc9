// The C++ Store wrapper: file and TCP stores, references, errors as
// exceptions, and Store::adopt over a C++ object (as a framework would wrap
// its own c10d store), including a value longer than the first buffer.
#include <chrono>
#include <condition_variable>
#include <memory>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>

#include "check.hpp"
#include "storage_sharing.hpp"

namespace ss = storage_sharing;

// The call must throw an Error with `status` whose message contains `part`.
#define EXPECT_ERROR(call, status, part)                                                   \
    do {                                                                                   \
        ss::Error e_ = expect_error([&] { (void)(call); }, (status));                      \
        if (std::string(e_.what()).find(part) == std::string::npos) {                      \
            std::fprintf(stderr, "%s:%d: message lacks %s: %s\n", __FILE__, __LINE__,      \
                         std::string(part).c_str(), e_.what());                            \
            std::exit(1);                                                                  \
        }                                                                                  \
    } while (0)

namespace {

// The "framework's" store: a map under a mutex, waits on a condition.
struct MapStore {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::string, std::vector<uint8_t>> data;
    int *deleted;
    explicit MapStore(int *d) : deleted(d) {}
    ~MapStore() { ++*deleted; }

    void set(const std::string &k, const std::vector<uint8_t> &v) {
        std::lock_guard<std::mutex> l(mu);
        data[k] = v;
        cv.notify_all();
    }
    bool wait_keys(std::unique_lock<std::mutex> &l, const std::vector<std::string> &keys, int64_t ms) {
        auto ready = [&] {
            for (const auto &k : keys)
                if (!data.count(k)) return false;
            return true;
        };
        if (ms == 0) {
            cv.wait(l, ready);
            return true;
        }
        return cv.wait_for(l, std::chrono::milliseconds(ms), ready);
    }
    std::vector<uint8_t> get(const std::string &k, int64_t ms) {
        std::unique_lock<std::mutex> l(mu);
        if (!wait_keys(l, {k}, ms)) throw ss::Error(SS_ERR_TIMEOUT, "get", k);
        return data[k];
    }
    int64_t add(const std::string &k, int64_t delta) {
        std::lock_guard<std::mutex> l(mu);
        auto &v = data[k];
        int64_t n = v.empty() ? 0 : std::stoll(std::string(v.begin(), v.end()));
        n += delta;
        std::string t = std::to_string(n);
        v.assign(t.begin(), t.end());
        cv.notify_all();
        return n;
    }
    void wait(const std::vector<std::string> &keys, int64_t ms) {
        std::unique_lock<std::mutex> l(mu);
        if (!wait_keys(l, keys, ms)) throw ss::Error(SS_ERR_TIMEOUT, "wait", "keys");
    }
};

void exercise(const ss::Store &s) {
    std::string big(5000, 'z');
    s.set("grp/0/0", big);
    CHECK(s.get_string("grp/0/0", 1000) == big);
    CHECK(s.add("n", 4) == 4);
    CHECK(s.add("n", -1) == 3);
    s.wait({"grp/0/0", "n"}, 1000);
    EXPECT_ERROR(s.wait({"grp/0/0", "missing/7"}, 50), SS_ERR_TIMEOUT, "\"missing/7\"");
    EXPECT_ERROR(s.get("absent", 20), SS_ERR_TIMEOUT, "\"absent\"");
    ss::Store r = s.ref();
    std::thread t([&r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        r.set("late", std::string("ok"));
    });
    CHECK(s.get_string("late") == "ok");
    t.join();
}

}  // namespace

int main() {
    char dir[] = "/tmp/ss-cxx-store-XXXXXX";
    CHECK(mkdtemp(dir) != nullptr);
    {
        ss::Store f = ss::Store::open_file(dir);
        exercise(f);
        EXPECT_ERROR(f.tcp_port(), SS_ERR_UNSUPPORTED, "not a TCPStore");
        const int64_t before = f.num_keys();
        CHECK(f.check_keys({"grp/0/0", "n"}) && !f.check_keys({"n", "missing/7"}));
        const std::string long_value(300, 'v');
        std::vector<uint8_t> got = f.compare_set("cas", "", long_value);
        CHECK(std::string(got.begin(), got.end()) == long_value);
        got = f.compare_set("cas", "x", "y");  // longer than both: asked again
        CHECK(std::string(got.begin(), got.end()) == long_value);
        CHECK(f.num_keys() == before + 1);
        CHECK(f.delete_key("cas") && !f.delete_key("cas"));
    }
    {
        // PyTorch's FileStore file; its only user (world_size 1) removes it.
        const std::string path = std::string(dir) + "/torch_file_store";
        {
            ss::Store t = ss::Store::open_torch_file(path, 1, 10000);
            exercise(t);
            CHECK(t.check_keys({"n"}) && !t.check_keys({"missing/7"}));
            CHECK(t.delete_key("n") && !t.delete_key("n"));
            CHECK(access(path.c_str(), F_OK) == 0);
        }
        CHECK(access(path.c_str(), F_OK) != 0);
        EXPECT_ERROR(ss::Store::open_torch_file(dir, -1, 1000), SS_ERR_INVALID_ARGUMENT, "folder");
    }
    std::string rm = std::string("rm -rf ") + dir;
    CHECK(std::system(rm.c_str()) == 0);

    {
        ss::Store m = ss::Store::open_tcp("127.0.0.1", 0, true, 0, 10000);
        ss::Store c = ss::Store::open_tcp("127.0.0.1", m.tcp_port(), false, 0, 10000);
        exercise(c);
        CHECK(m.get_string("late", 1000) == "ok");
        EXPECT_ERROR(ss::Store::open_tcp("127.0.0.1", m.tcp_port(), true, 0, 1000), SS_ERR_BUSY,
                     "127.0.0.1:" + std::to_string(m.tcp_port()));
    }

    int deleted = 0;
    {
        ss::Store a = ss::Store::adopt(std::make_unique<MapStore>(&deleted));
        exercise(a);
        ss::Store b = a.ref();
        a.close();
        CHECK(deleted == 0);
        CHECK(b.add("n", 0) == 3);
    }
    CHECK(deleted == 1);
    std::printf("test_store_raii: ok\n");
    return 0;
}
