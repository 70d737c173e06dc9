/* Tests of storage_sharing::libtorch::Weights (torch.hpp) against a real
 * producer process: a copy of this program ("producer KIND") builds a
 * host-backend pool through the C API, exports it and prints the handle;
 * this process opens it as at::Tensor views, checks the values, follows
 * the producer's in-place updates and sees it die.
 *
 *   libtorch_pool_weights
 *
 * Each test prints "ok - NAME" or "FAIL - NAME: why"; the last line is
 * "libtorch pool weights: N passed, M failed".
 *
 * The producer's pool (every storage 512-byte aligned by the pool):
 *   "full"  float32 6x10, arange(60) + 100 * step   } one storage
 *   "view"  full[1:5, 2:8:2] (offset 12, 4x3, 10,2) }
 *   "bias"  bfloat16 1000, (i % 7) + step
 *   "step"  int64 0-dim, the update count (0 at export)
 * Commands on its stdin: "update N TIMEOUT_MS" (begin_update, write step N,
 * publish; answers "status=S version=V"), "quit". */
#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <storage_sharing/torch.hpp>

extern char **environ;

namespace ss = storage_sharing;
namespace sst = storage_sharing::libtorch;

namespace {

[[noreturn]] void fail(const std::string &why) { throw std::runtime_error(why); }
void expect(bool ok, const std::string &why) {
    if (!ok) fail(why);
}

/* ---- the producer (a copy of this program) ---- */

void check_c(ss_status status, const char *what) {
    if (status != SS_OK) {
        std::fprintf(stderr, "producer: %s failed with status %d\n", what, static_cast<int>(status));
        std::exit(3);
    }
}

struct ProducerPool {
    ss_cuda_pool *pool = nullptr;
    float *full = nullptr;
    std::uint16_t *bias = nullptr; /* bfloat16 bits */
    std::int64_t *step = nullptr;

    void write(std::int64_t n) {
        for (int i = 0; i < 60; i++) full[i] = static_cast<float>(i + 100 * n);
        for (int i = 0; i < 1000; i++) {
            /* Small integers are exact in bfloat16: the float's upper half. */
            float v = static_cast<float>(i % 7 + n);
            std::uint32_t bits = 0;
            std::memcpy(&bits, &v, sizeof bits);
            bias[i] = static_cast<std::uint16_t>(bits >> 16);
        }
        *step = n;
    }
};

void add_tensor(ss_cuda_pool *pool, const char *name, const void *storage, std::size_t nbytes, std::int32_t dtype,
                std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides, std::int64_t offset) {
    ss_tensor_desc d{};
    d.struct_size = sizeof d;
    d.storage_ptr = storage;
    d.storage_nbytes = nbytes;
    d.dtype = dtype;
    d.ndim = sizes.size();
    d.sizes = sizes.data();
    d.strides = strides.data();
    d.storage_offset = offset;
    check_c(ss_cuda_pool_add_tensor(pool, name, &d), name);
}

int run_producer(const std::string &kind) {
    ss_cuda_pool_options opts = SS_CUDA_POOL_OPTIONS_INIT;
    opts.device_type = SS_POOL_DEVICE_HOST;
    opts.kind = kind == "legacy" ? SS_POOL_KIND_LEGACY : SS_POOL_KIND_VMM;
    opts.segment_size = 1 << 20;
    ProducerPool p;
    check_c(ss_cuda_pool_new(&opts, &p.pool), "ss_cuda_pool_new");
    void *a = nullptr, *b = nullptr, *c = nullptr;
    check_c(ss_cuda_pool_alloc(p.pool, 60 * sizeof(float), &a), "alloc full");
    check_c(ss_cuda_pool_alloc(p.pool, 1000 * 2, &b), "alloc bias");
    check_c(ss_cuda_pool_alloc(p.pool, 8, &c), "alloc step");
    p.full = static_cast<float *>(a);
    p.bias = static_cast<std::uint16_t *>(b);
    p.step = static_cast<std::int64_t *>(c);
    p.write(0);
    add_tensor(p.pool, "full", a, 60 * sizeof(float), static_cast<std::int32_t>(at::kFloat), {6, 10}, {10, 1}, 0);
    add_tensor(p.pool, "view", a, 60 * sizeof(float), static_cast<std::int32_t>(at::kFloat), {4, 3}, {10, 2}, 12);
    add_tensor(p.pool, "bias", b, 1000 * 2, static_cast<std::int32_t>(at::kBFloat16), {1000}, {1}, 0);
    add_tensor(p.pool, "step", c, 8, static_cast<std::int32_t>(at::kLong), {}, {}, 0);

    std::vector<std::uint8_t> handle(256);
    std::size_t len = 0;
    ss_status st = ss_cuda_pool_export(p.pool, handle.data(), handle.size(), &len);
    if (st == SS_ERR_BUFFER_TOO_SMALL) {
        handle.resize(len);
        st = ss_cuda_pool_export(p.pool, handle.data(), handle.size(), &len);
    }
    check_c(st, "ss_cuda_pool_export");
    std::ostringstream hex;
    for (std::size_t i = 0; i < len; i++) {
        char byte[3];
        std::snprintf(byte, sizeof byte, "%02x", handle[i]);
        hex << byte;
    }
    std::printf("handle=%s\n", hex.str().c_str());
    std::fflush(stdout);

    std::string cmd;
    while (std::cin >> cmd) {
        if (cmd == "quit") break;
        if (cmd == "update") {
            std::int64_t n = 0, timeout_ms = 0;
            std::cin >> n >> timeout_ms;
            ss_status begin = ss_cuda_pool_begin_update(p.pool, timeout_ms);
            std::uint64_t version = 0;
            if (begin == SS_OK) {
                p.write(n);
                check_c(ss_cuda_pool_publish(p.pool, 0, &version), "ss_cuda_pool_publish");
            }
            std::printf("status=%d version=%llu\n", static_cast<int>(begin), static_cast<unsigned long long>(version));
            std::fflush(stdout);
        }
    }
    ss_cuda_pool_free(p.pool);
    return 0;
}

/* ---- the consumer side (this process) ---- */

struct Producer {
    pid_t pid = -1;
    FILE *in = nullptr;
    FILE *out = nullptr;
    std::vector<std::uint8_t> handle;

    explicit Producer(const std::string &kind) {
        int to[2], from[2];
        if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0) fail("pipe2");
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, to[0], 0);
        posix_spawn_file_actions_adddup2(&fa, from[1], 1);
        std::string self = realpath("/proc/self/exe", nullptr);
        std::vector<char *> argv{self.data(), const_cast<char *>("producer"), const_cast<char *>(kind.c_str()), nullptr};
        int rc = posix_spawn(&pid, self.c_str(), &fa, nullptr, argv.data(), environ);
        posix_spawn_file_actions_destroy(&fa);
        close(to[0]);
        close(from[1]);
        if (rc != 0) fail(std::string("posix_spawn: ") + std::strerror(rc));
        in = fdopen(to[1], "w");
        out = fdopen(from[0], "r");
        std::string line = hear();
        expect(line.rfind("handle=", 0) == 0, "the producer printed '" + line + "', not its handle");
        std::string hex = line.substr(7);
        for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
            handle.push_back(static_cast<std::uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
        }
    }
    Producer(const Producer &) = delete;
    Producer &operator=(const Producer &) = delete;
    ~Producer() {
        if (pid > 0) {
            say("quit");
            wait();
        }
    }

    void say(const std::string &line) {
        std::fputs((line + "\n").c_str(), in);
        std::fflush(in);
    }
    std::string hear() {
        char buf[4096];
        if (!std::fgets(buf, sizeof buf, out)) fail("the producer closed its stdout");
        std::string line(buf);
        while (!line.empty() && line.back() == '\n') line.pop_back();
        return line;
    }
    /* Asks for update `n`; the begin_update status and the new version. */
    std::pair<int, std::uint64_t> update(std::int64_t n, std::int64_t timeout_ms) {
        say("update " + std::to_string(n) + " " + std::to_string(timeout_ms));
        int status = -1;
        unsigned long long version = 0;
        std::string line = hear();
        if (std::sscanf(line.c_str(), "status=%d version=%llu", &status, &version) != 2) {
            fail("the producer answered '" + line + "'");
        }
        return {status, version};
    }
    void wait() {
        if (in) std::fclose(in), in = nullptr;
        int status = 0;
        if (pid > 0) waitpid(pid, &status, 0);
        pid = -1;
        if (out) std::fclose(out), out = nullptr;
    }
    void kill9() {
        if (pid > 0) ::kill(pid, SIGKILL);
        wait();
    }
};

/* The values the producer writes at step n. */
void check_values(const sst::Weights &w, std::int64_t n) {
    at::Tensor full = at::arange(60, at::kFloat).reshape({6, 10}) + 100 * n;
    expect(at::equal(w.at("full"), full), "full differs from step " + std::to_string(n));
    expect(at::equal(w.at("view"), full.slice(0, 1, 5).slice(1, 2, 8, 2)), "view differs at step " + std::to_string(n));
    at::Tensor bias = (at::arange(1000, at::kLong).remainder(7) + n).to(at::kBFloat16);
    expect(at::equal(w.at("bias"), bias), "bias differs at step " + std::to_string(n));
    expect(w.at("step").item<std::int64_t>() == n, "step is " + std::to_string(w.at("step").item<std::int64_t>()));
}

void expect_error(ss_status want, const std::function<void()> &f, const std::string &what) {
    try {
        f();
    } catch (const ss::Error &e) {
        expect(e.status() == want, what + ": status " + std::to_string(e.status()) + " (" + e.what() + "), expected " +
                                       std::to_string(want));
        return;
    }
    fail(what + ": no error");
}

void test_open_views(const std::string &kind) {
    Producer p(kind);
    sst::Weights w = sst::Weights::open(p.handle, 10000);
    expect(w.device() == c10::Device(c10::DeviceType::CPU), "host backend tensors are on " + w.device().str());
    expect(w.tensors().size() == 4, std::to_string(w.tensors().size()) + " tensors, expected 4");
    {
        auto guard = w.read();
        expect(guard.version() == 1, "the first export is version " + std::to_string(guard.version()));
        check_values(w, 0);
    }
    const at::Tensor &full = w.at("full"), &view = w.at("view");
    expect(full.device().is_cpu() && full.scalar_type() == at::kFloat, "full is " + full.toString());
    expect(view.sizes() == c10::IntArrayRef({4, 3}) && view.strides() == c10::IntArrayRef({10, 2}) &&
               view.storage_offset() == 12,
           "view's geometry");
    /* Views of one producer storage are one storage here. */
    expect(full.storage().is_alias_of(view.storage()) &&
               full.storage().unsafeGetStorageImpl() == view.storage().unsafeGetStorageImpl(),
           "full and view do not share a storage");
    expect(!full.storage().is_alias_of(w.at("bias").storage()), "bias shares full's storage");
    expect(!full.storage().resizable(), "the storage is resizable");
    expect(reinterpret_cast<std::uintptr_t>(full.data_ptr()) % 512 == 0, "full is not 512-byte aligned");
    expect_error(SS_ERR_NOT_FOUND, [&] { (void)w.at("nope"); }, "at(\"nope\")");
}

void test_follows_updates(const std::string &kind) {
    Producer p(kind);
    sst::Weights w = sst::Weights::open(p.handle, 10000);
    at::Tensor full = w.at("full"); /* the same view is read after each update: in place */
    for (std::int64_t n = 1; n <= 3; n++) {
        auto [status, version] = p.update(n, 10000);
        expect(status == SS_OK, "update " + std::to_string(n) + ": status " + std::to_string(status));
        expect(version == static_cast<std::uint64_t>(n) + 1, "update gave version " + std::to_string(version));
        auto guard = w.read(nullptr, 10000);
        expect(guard.version() == version, "read version " + std::to_string(guard.version()));
        check_values(w, n);
        expect(full.data_ptr() == w.at("full").data_ptr() && full[0][0].item<float>() == 100.0f * n,
               "the view kept from the start does not see update " + std::to_string(n));
    }
}

void test_update_waits_for_reader(const std::string &kind) {
    Producer p(kind);
    sst::Weights w = sst::Weights::open(p.handle, 10000);
    {
        auto guard = w.read();
        /* While this process holds version 1, the producer may not write. */
        auto [status, version] = p.update(1, 200);
        expect(status == SS_ERR_TIMEOUT, "update under a reader: status " + std::to_string(status) + ", expected timeout");
        check_values(w, 0);
    }
    auto [status, version] = p.update(1, 10000);
    expect(status == SS_OK && version == 2, "update after release: status " + std::to_string(status));
    auto guard = w.read();
    check_values(w, 1);
    /* An explicit release reports; the destructor then has nothing left. */
    guard.release();
}

void test_tensors_outlive_weights(const std::string &kind) {
    Producer p(kind);
    at::Tensor bias;
    {
        sst::Weights w = sst::Weights::open(p.handle, 10000);
        bias = w.at("bias");
    }
    /* The storage's reference keeps the import: its mapping stays. */
    expect(at::equal(bias, at::arange(1000, at::kLong).remainder(7).to(at::kBFloat16)), "bias after the Weights went");
}

/* Names in /dev/shm that start with `prefix`. */
std::vector<std::string> shm_names(const std::string &prefix) {
    std::vector<std::string> out;
    if (DIR *d = opendir("/dev/shm")) {
        while (dirent *e = readdir(d)) {
            if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) out.emplace_back(e->d_name);
        }
        closedir(d);
    }
    return out;
}

void test_producer_killed(const std::string &kind) {
    std::string prefix;
    {
        Producer p(kind);
        prefix = "ss_pool_" + std::to_string(p.pid) + "_";
        sst::Weights w = sst::Weights::open(p.handle, 10000);
        p.kill9();
        expect_error(SS_ERR_PEER_GONE, [&] { (void)w.read(nullptr, 2000); }, "read after the producer died");
        if (kind == "vmm") {
            /* memfd segments are the kernel's: still mapped here, still readable. */
            check_values(w, 0);
        }
    }
    /* With the producer and the last consumer gone, no segment is left by
     * name (Legacy segments are named; a hang guard of 10 s, not a timing). */
    for (int i = 0; i < 100 && !shm_names(prefix).empty(); i++) usleep(100000);
    auto left = shm_names(prefix);
    expect(left.empty(), "left in /dev/shm after the producer was killed: " + (left.empty() ? "" : left[0]));
}

void test_bad_handles() {
    expect_error(SS_ERR_NULL_POINTER, [] { (void)sst::Weights::open(nullptr, 8); }, "a null handle");
    std::vector<std::uint8_t> junk(64, 0xab);
    try {
        (void)sst::Weights::open(junk, 2000);
        fail("a handle of junk bytes opened");
    } catch (const ss::Error &e) {
        expect(e.status() != SS_OK, "junk");
    }
    Producer p("vmm");
    std::vector<std::uint8_t> cut(p.handle.begin(), p.handle.begin() + static_cast<std::ptrdiff_t>(p.handle.size() / 2));
    try {
        (void)sst::Weights::open(cut, 2000);
        fail("a handle cut in half opened");
    } catch (const ss::Error &e) {
        expect(std::string(e.what()).size() > 0, "an error without a message");
    }
    /* The honest handle still opens after the refused ones. */
    sst::Weights w = sst::Weights::open(p.handle, 10000);
    auto guard = w.read();
    check_values(w, 0);
}

}  // namespace

int main(int argc, char **argv) {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "producer" && argc > 2) return run_producer(argv[2]);
    signal(SIGPIPE, SIG_IGN);
    alarm(300); /* a hang guard only */

    std::vector<std::pair<std::string, std::function<void()>>> tests;
    for (std::string kind : {"vmm", "legacy"}) {
        tests.emplace_back("Weights::open gives checked views, one storage per producer storage (" + kind + ")",
                           [kind] { test_open_views(kind); });
        tests.emplace_back("views follow the producer's in-place updates (" + kind + ")",
                           [kind] { test_follows_updates(kind); });
        tests.emplace_back("an update waits for a reader's guard (" + kind + ")",
                           [kind] { test_update_waits_for_reader(kind); });
        tests.emplace_back("tensors outlive the Weights object (" + kind + ")",
                           [kind] { test_tensors_outlive_weights(kind); });
        tests.emplace_back("kill -9 of the producer: PeerGone at the next read (" + kind + ")",
                           [kind] { test_producer_killed(kind); });
    }
    tests.emplace_back("bad handles are refused, then the honest one opens", test_bad_handles);
    int passed = 0, failed = 0;
    for (const auto &[name, test] : tests) {
        try {
            test();
            std::printf("ok - %s\n", name.c_str());
            passed++;
        } catch (const std::exception &e) {
            std::printf("FAIL - %s: %s\n", name.c_str(), e.what());
            failed++;
        }
        std::fflush(stdout);
    }
    std::printf("libtorch pool weights: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
