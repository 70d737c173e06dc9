/* Tests of include/storage_sharing/torch.hpp against the real libtorch and
 * stock Python PyTorch processes (tests/libtorch/peer.py):
 *
 *   libtorch_interop PYTHON PEER_PY
 *
 * Each test prints "ok - NAME" or "FAIL - NAME: why"; the last line is
 * "libtorch: N passed, M failed". The program also runs copies of itself
 * (a victim to kill -9, a holder, an arena consumer) through /proc/self/exe. */
#include <ATen/ATen.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <storage_sharing/torch.hpp>

extern char **environ;

namespace ss = storage_sharing;
namespace sst = storage_sharing::libtorch;

namespace {

std::string g_python, g_peer;

[[noreturn]] void fail(const std::string &why) { throw std::runtime_error(why); }
void expect(bool ok, const std::string &why) {
    if (!ok) fail(why);
}

/* ---- the shared recipe (the same as peer.py's) ---- */

const std::map<std::string, c10::ScalarType> kDtypes = {
    {"float32", at::kFloat}, {"float64", at::kDouble}, {"int16", at::kShort},
    {"int32", at::kInt},     {"int64", at::kLong},     {"bfloat16", at::kBFloat16},
};
std::string dtype_name(c10::ScalarType t) {
    for (const auto &[name, type] : kDtypes)
        if (type == t) return name;
    fail(std::string("no name for dtype ") + c10::toString(t));
}
at::Tensor recipe_full(c10::ScalarType dtype) { return at::arange(60, at::kLong).to(dtype).reshape({6, 10}); }
at::Tensor recipe_view(const at::Tensor &full) { return full.slice(0, 1, 5).slice(1, 2, 8, 2); }

/* ---- key=value lines ---- */

using Words = std::map<std::string, std::string>;
Words parse_words(const std::string &line) {
    Words w;
    std::istringstream in(line);
    std::string word;
    while (in >> word) {
        auto eq = word.find('=');
        if (eq != std::string::npos) w[word.substr(0, eq)] = word.substr(eq + 1);
    }
    return w;
}
std::vector<int64_t> parse_ints(const std::string &text) {
    std::vector<int64_t> out;
    std::istringstream in(text);
    std::string item;
    while (std::getline(in, item, ',')) out.push_back(std::stoll(item));
    return out;
}
std::string join(c10::IntArrayRef xs) {
    std::ostringstream out;
    for (size_t i = 0; i < xs.size(); i++) out << (i ? "," : "") << xs[i];
    return out.str();
}
std::string view_words(const at::Tensor &v) {
    return "dtype=" + dtype_name(v.scalar_type()) + " offset=" + std::to_string(v.storage_offset()) +
           " sizes=" + join(v.sizes()) + " strides=" + join(v.strides());
}
std::string filename_words(const ss::SharedFilename &s) {
    return "manager=" + s.manager + " name=" + s.name + " nbytes=" + std::to_string(s.nbytes);
}
/* The view the words describe, over `storage`, checked against the recipe. */
at::Tensor rebuild_and_check(c10::Storage storage, const Words &w) {
    c10::ScalarType dtype = kDtypes.at(w.at("dtype"));
    auto sizes = parse_ints(w.at("sizes")), strides = parse_ints(w.at("strides"));
    at::Tensor t = sst::tensor_from_storage(std::move(storage), dtype, sizes, strides, std::stoll(w.at("offset")));
    at::Tensor expected = recipe_view(recipe_full(dtype));
    expect(t.scalar_type() == dtype, "dtype");
    expect(t.sizes() == expected.sizes(), "sizes " + join(t.sizes()));
    expect(t.strides() == expected.strides(), "strides " + join(t.strides()));
    expect(t.storage_offset() == expected.storage_offset(), "storage offset");
    expect(at::equal(t, expected), "values differ");
    return t;
}

/* ---- child processes ---- */

struct Child {
    pid_t pid = -1;
    FILE *in = nullptr;  /* its stdin */
    FILE *out = nullptr; /* its stdout */

    void say(const std::string &line) {
        std::fputs((line + "\n").c_str(), in);
        std::fflush(in);
    }
    std::string hear() {
        char *buf = nullptr;
        size_t cap = 0;
        ssize_t n = getline(&buf, &cap, out);
        std::string line = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
        std::free(buf);
        if (line.empty()) fail("child " + std::to_string(pid) + " closed its stdout");
        return line;
    }
    int wait() {
        if (in) std::fclose(in), in = nullptr;
        int status = 0;
        if (pid > 0) waitpid(pid, &status, 0);
        pid = -1;
        if (out) std::fclose(out), out = nullptr;
        return status;
    }
    void kill9() {
        if (pid > 0) ::kill(pid, SIGKILL);
        wait();
    }
    ~Child() {
        if (pid > 0) kill9();
    }
};

/* Runs argv with pipes on stdin/stdout; `keep_fd` (>= 0) is inherited. */
void spawn(Child &c, const std::vector<std::string> &args, int keep_fd = -1) {
    int to[2], from[2];
    if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0) fail("pipe2");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from[1], 1);
    if (keep_fd >= 0) fcntl(keep_fd, F_SETFD, 0);
    std::vector<char *> argv;
    for (const auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
    argv.push_back(nullptr);
    int rc = posix_spawn(&c.pid, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (keep_fd >= 0) fcntl(keep_fd, F_SETFD, FD_CLOEXEC);
    close(to[0]);
    close(from[1]);
    if (rc != 0) fail("posix_spawn " + args[0] + ": " + std::strerror(rc));
    c.in = fdopen(to[1], "w");
    c.out = fdopen(from[0], "r");
}
void spawn_peer(Child &c, const std::vector<std::string> &args, int keep_fd = -1) {
    std::vector<std::string> all{g_python, g_peer};
    all.insert(all.end(), args.begin(), args.end());
    spawn(c, all, keep_fd);
}
void spawn_self(Child &c, const std::vector<std::string> &args, int keep_fd = -1) {
    std::vector<std::string> all{"/proc/self/exe"};
    all.insert(all.end(), args.begin(), args.end());
    all[0] = std::string(realpath("/proc/self/exe", nullptr));
    spawn(c, all, keep_fd);
}

bool shm_exists(const std::string &name) { return access(("/dev/shm" + name).c_str(), F_OK) == 0; }

/* The pid of the process listening on a manager's socket (SO_PEERCRED);
 * the connection is closed at once (the daemon drops it). */
pid_t manager_pid(const std::string &socket_path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
    if (connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0) {
        close(fd);
        fail("connect " + socket_path + ": " + std::strerror(errno));
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len);
    close(fd);
    return cred.pid;
}
bool process_gone(pid_t pid) {
    if (::kill(pid, 0) != 0) return true;
    FILE *f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
    if (!f) return true;
    char state = '?';
    int scanned = std::fscanf(f, "%*d (%*[^)]) %c", &state);
    std::fclose(f);
    return scanned == 1 && (state == 'Z' || state == 'X');
}
/* Waits (hang guard 30 s, the managers linger 2 s) for a daemon to exit. */
void expect_daemon_exits(pid_t pid, const std::string &what) {
    for (int i = 0; i < 300 && !process_gone(pid); i++) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    expect(process_gone(pid), what + " (pid " + std::to_string(pid) + ") still runs");
}

template <class F>
ss::Error expect_error(F &&f, const std::string &what) {
    try {
        f();
    } catch (const ss::Error &e) {
        return e;
    }
    fail(what + " did not throw");
}

/* ======================= the tests ======================= */

void test_allocator_born_shared() {
    for (sst::Strategy strategy : {sst::Strategy::FileSystem, sst::Strategy::FileDescriptor}) {
        at::Tensor t = sst::empty_shared({6, 10}, at::kFloat, strategy);
        expect(sst::is_shared(t.storage()), "empty_shared is not shared");
        void *before = t.data_ptr();
        if (strategy == sst::Strategy::FileSystem) {
            ss::SharedFilename s = sst::share_filename(t.storage());
            expect(s.nbytes == 240 && s.name.rfind("/torch_", 0) == 0, "share_filename values " + s.name);
            expect(shm_exists(s.name), "segment missing");
        } else {
            ss::SharedFd s = sst::share_fd(t.storage());
            expect(s.fd >= 0 && s.nbytes == 240, "share_fd values");
        }
        expect(t.data_ptr() == before, "sharing a storage born shared copied it");
    }
    /* at::empty itself, under the scoped CPU allocator. */
    at::Tensor t;
    {
        sst::ScopedCpuAllocator scope(sst::Strategy::FileDescriptor);
        t = at::empty({128}, at::kDouble);
    }
    expect(sst::is_shared(t.storage()), "at::empty under ScopedCpuAllocator is not shared");
    at::Tensor heap = at::empty({128}, at::kDouble);
    expect(!sst::is_shared(heap.storage()), "the CPU allocator was not restored");
    expect(t.storage().allocator() == &sst::SharedAllocator::get(sst::Strategy::FileDescriptor), "allocator");
    void *before = t.data_ptr();
    sst::share_fd(t.storage());
    expect(t.data_ptr() == before, "at::empty storage was copied when shared");
}

void test_heap_storage_moves_in_place() {
    at::Tensor full = recipe_full(at::kDouble);
    at::Tensor view = recipe_view(full);
    void *before = full.data_ptr();
    ss::SharedFd s = sst::share_fd(view.storage());
    expect(s.nbytes == 480, "nbytes " + std::to_string(s.nbytes));
    expect(full.data_ptr() != before && sst::is_shared(full.storage()), "not moved into shared memory");
    expect(view.data_ptr() == static_cast<double *>(full.data_ptr()) + 12, "the view did not follow its storage");
    expect(at::equal(full, recipe_full(at::kDouble)), "values changed in the move");
    /* Shared by fd, then by name: PyTorch moves it again (another kind of segment). */
    ss::SharedFilename f = sst::share_filename(full.storage());
    expect(f.nbytes == 480 && at::equal(full, recipe_full(at::kDouble)), "second move");
    expect(sst::share_filename(full.storage()).name == f.name, "sharing twice made a second segment");
}

void test_cpp_to_python_filename() {
    at::Tensor full = recipe_full(at::kDouble);
    at::Tensor view = recipe_view(full);
    ss::SharedFilename s = sst::share_filename(view.storage());
    sst::shared_incref(view.storage()); /* in flight */
    Child py;
    spawn_peer(py, {"from-cpp-filename"});
    py.say(filename_words(s) + " " + view_words(view));
    Words reply = parse_words(py.hear());
    expect(reply["status"] == "ok", "python: " + reply["status"]);
    expect(reply["nbytes"] == "480" && reply["is_shared"] == "1", "python's storage");
    expect(full[1][2].item<double>() == 1000, "python's write is not seen");
    expect(sst::shared_refcount(full.storage()) == 2, "count while python holds it");
    py.say("bye");
    expect(py.wait() == 0, "python failed");
    expect(sst::shared_refcount(full.storage()) == 1, "python's release did not reach the count");
    std::string name = s.name;
    full.reset();
    view.reset();
    expect(!shm_exists(name), "segment left after the last holder");
}

void test_python_to_cpp_filename() {
    Child py;
    spawn_peer(py, {"to-cpp-filename", "int32"});
    Words w = parse_words(py.hear());
    std::string name = w.at("name");
    c10::Storage a = sst::open_shared_filename(w.at("manager"), name, std::stoull(w.at("nbytes")));
    sst::shared_decref(a); /* cancels the reference in flight */
    expect(a.nbytes() == 240 && !a.resizable(), "opened storage size/resizable");
    at::Tensor t = rebuild_and_check(a, w);
    t[0][0] = 1000;
    py.say("written");
    Words reply = parse_words(py.hear());
    expect(reply["status"] == "ok", "python: " + reply["status"]);
    /* Weak references and the DataPtr deleter: a second open adds one to
     * the count; when the first one's last strong reference goes, its weak
     * reference expires and the count drops back. */
    c10::Storage b = sst::open_shared_filename(w.at("manager"), name, std::stoull(w.at("nbytes")));
    expect(sst::shared_refcount(b) == 3, "count with python and two opens: " + std::to_string(sst::shared_refcount(b)));
    c10::weak_intrusive_ptr<c10::StorageImpl> weak = a.getWeakStorageImpl();
    expect(!weak.expired(), "weak expired early");
    t.reset();
    a = c10::Storage();
    expect(weak.expired(), "weak reference did not expire");
    expect(sst::shared_refcount(b) == 2, "count after the first storage went");
    b = c10::Storage();
    py.say("bye");
    expect(py.wait() == 0, "python failed");
    expect(!shm_exists(name), "segment left after every holder released it");
}

/* A connected pair of Unix stream sockets: [0] ours, [1] the child's. */
std::pair<ss::unique_fd, ss::unique_fd> socket_pair() {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) fail("socketpair");
    return {ss::unique_fd(sv[0]), ss::unique_fd(sv[1])};
}

void test_cpp_to_python_fd() {
    at::Tensor full = recipe_full(at::kFloat);
    at::Tensor view = recipe_view(full);
    ss::SharedFd s = sst::share_fd(view.storage());
    auto [ours, theirs] = socket_pair();
    Child py;
    spawn_peer(py, {"from-cpp-fd", std::to_string(theirs.get())}, theirs.get());
    theirs.reset();
    ss::send_fds(ours.get(), "nbytes=" + std::to_string(s.nbytes) + " " + view_words(view), {s.fd});
    Words reply = parse_words(py.hear());
    expect(reply["status"] == "ok" && reply["nbytes"] == "240", "python: " + reply["status"]);
    expect(full[1][2].item<float>() == 1000, "python's write is not seen");
    py.say("bye");
    expect(py.wait() == 0, "python failed");
}

void test_python_to_cpp_fd() {
    auto [ours, theirs] = socket_pair();
    Child py;
    spawn_peer(py, {"to-cpp-fd", std::to_string(theirs.get()), "int64"}, theirs.get());
    theirs.reset();
    ss::FdMessage msg = ss::recv_fds(ours.get(), 4096, 1);
    expect(msg.fds.size() == 1, "no descriptor came");
    Words w = parse_words(msg.payload);
    c10::Storage storage = sst::open_shared_fd(msg.fds[0].get(), std::stoull(w.at("nbytes")));
    msg.fds.clear(); /* the storage mapped a duplicate */
    at::Tensor t = rebuild_and_check(storage, w);
    t[0][0] = 1000;
    py.say("written");
    Words reply = parse_words(py.hear());
    expect(reply["status"] == "ok", "python: " + reply["status"]);
    py.say("bye");
    expect(py.wait() == 0, "python failed");
    expect(at::equal(t, recipe_view(recipe_full(at::kLong)).index_put_({0, 0}, 1000)), "values after python left");
}

void test_python_queue_consumer() {
    at::Tensor full = sst::empty_shared({6, 10}, at::kBFloat16);
    full.copy_(recipe_full(at::kBFloat16));
    at::Tensor view = recipe_view(full);
    ss::SharedFilename s = sst::share_filename(view.storage());
    sst::shared_incref(view.storage());
    Child py;
    spawn_peer(py, {"queue-consumer"});
    py.say(filename_words(s) + " " + view_words(view));
    Words reply = parse_words(py.hear());
    expect(reply["status"] == "ok", "python: " + reply["status"] + " got " + reply["got"] + " want " + reply["want"]);
    expect(full[1][2].item<float>() == 1000, "the queue consumer's write is not seen");
    py.say("bye");
    expect(py.wait() == 0, "python failed");
    expect(sst::shared_refcount(full.storage()) == 1, "count after python and its consumer left");
}

/* kill -9 of the C++ side: a copy of this program shares a tensor by name
 * (our manager), Python opens it; both are killed. The manager must
 * remove the segment and exit. */
void test_kill9_cpp_side() {
    Child victim, py;
    spawn_self(victim, {"victim"});
    std::string line = victim.hear();
    Words w = parse_words(line);
    pid_t daemon = manager_pid(w.at("manager"));
    spawn_peer(py, {"hold-filename"});
    py.say(line);
    expect(parse_words(py.hear())["status"] == "held", "python did not hold it");
    expect(shm_exists(w.at("name")), "segment missing while held");
    victim.kill9();
    py.kill9();
    expect_daemon_exits(daemon, "our manager");
    expect(!shm_exists(w.at("name")), "segment left in /dev/shm after kill -9");
}

/* kill -9 of the Python side: Python shares by name (torch_shm_manager),
 * a copy of this program opens it; Python is killed; the copy still
 * reads the values, releases them and exits. PyTorch's manager must
 * remove the segment and exit. */
void test_kill9_python_side() {
    Child py, holder;
    spawn_peer(py, {"share-and-hold", "float32"});
    std::string line = py.hear();
    Words w = parse_words(line);
    pid_t daemon = manager_pid(w.at("manager"));
    spawn_self(holder, {"holder"});
    holder.say(line);
    expect(parse_words(holder.hear())["status"] == "held", "the holder did not open it");
    py.kill9();
    holder.say("go");
    expect(parse_words(holder.hear())["status"] == "released", "the holder failed after python died");
    expect(holder.wait() == 0, "holder exit status");
    expect_daemon_exits(daemon, "torch_shm_manager");
    expect(!shm_exists(w.at("name")), "segment left in /dev/shm after kill -9");
}

void test_arena_tensor_cpp_to_cpp() {
    sst::ArenaAllocator arena;
    at::Tensor full = arena.empty({6, 10}, at::kLong);
    full.copy_(recipe_full(at::kLong));
    at::Tensor view = recipe_view(full);
    sst::ArenaTensorHandle h = arena.share(view);
    expect(h.ndim == 2 && h.storage_offset == 12 && h.sizes[1] == 3 && h.strides[0] == 10, "handle view");
    auto [ours, theirs] = socket_pair();
    Child consumer;
    spawn_self(consumer, {"arena-consumer", std::to_string(theirs.get())}, theirs.get());
    theirs.reset();
    int fd = arena.segment_fd(h);
    ss::send_fds(ours.get(), &h, sizeof h, &fd, 1);
    Words reply = parse_words(consumer.hear());
    expect(reply["status"] == "ok", "consumer: " + reply["status"]);
    expect(full[1][2].item<int64_t>() == 1000, "the consumer's write is not seen");
    consumer.say("bye");
    expect(consumer.wait() == 0, "consumer exit status");
    /* A tensor from elsewhere is refused. */
    at::Tensor heap = at::zeros({4});
    ss::Error e = expect_error([&] { arena.share(heap); }, "sharing a heap tensor through the arena");
    expect(e.status() == SS_ERR_INVALID_ARGUMENT, "status");
}

void test_cuda_without_gpu() {
    if (ss::cuda_available()) {
        std::printf("# CUDA is available: the no-CUDA errors are not checked here\n");
        return;
    }
    ss_cuda_ipc_handle h{};
    h.mem_handle_len = 66;
    h.size_bytes = 64;
    ss::Error e = expect_error([&] { sst::open_cuda(h); }, "open_cuda without CUDA");
    expect(e.status() == SS_ERR_CUDA_UNAVAILABLE, std::string("open_cuda status ") + e.what());
    /* A storage that says it is on CUDA (no CUDA call is needed to make one). */
    static char fake[64];
    c10::Storage cuda_storage(c10::Storage::use_byte_size_t(), sizeof fake,
                              c10::DataPtr(fake, c10::Device(c10::DeviceType::CUDA, 0)), nullptr, false);
    e = expect_error([&] { sst::share_cuda(cuda_storage); }, "share_cuda without CUDA");
    expect(e.status() == SS_ERR_CUDA_UNAVAILABLE, std::string("share_cuda status ") + e.what());
    expect(cuda_storage.data_ptr().get() == fake, "a failed share_cuda changed the storage");
    e = expect_error([&] { sst::share_cuda(at::zeros({4}).storage()); }, "share_cuda of a CPU storage");
    expect(e.status() == SS_ERR_INVALID_ARGUMENT, "CPU storage status");
}

void test_errors() {
    ss::Error e = expect_error([] { sst::open_shared_filename("", "/torch_no_such_segment_here", 64); }, "missing name");
    expect(e.status() == SS_ERR_NOT_FOUND, std::string("missing segment: ") + e.what());
    e = expect_error([] { sst::share_fd(c10::Storage()); }, "undefined storage");
    expect(e.status() == SS_ERR_NULL_POINTER, "undefined storage status");
    e = expect_error([] { sst::shared_incref(at::zeros({4}).storage()); }, "incref of a heap storage");
    expect(e.status() == SS_ERR_NULL_POINTER || e.status() == SS_ERR_UNSUPPORTED, "incref status");
    e = expect_error([] { sst::open_shared_fd(-1, 64); }, "bad fd");
    expect(e.status() != SS_OK, "bad fd status");
}

/* ---- C15: views checked against their storage ---- */

void test_view_bounds_checked() {
    c10::Storage small = at::zeros({4}, at::kFloat).storage(); /* 16 bytes */
    using Ints = std::vector<int64_t>;
    auto refused = [&](Ints sizes, Ints strides, int64_t offset, c10::ScalarType dtype, const std::string &what) {
        try {
            (void)sst::tensor_from_storage(small, dtype, sizes, strides, offset);
        } catch (const ss::Error &e) {
            expect(e.status() == SS_ERR_INVALID_ARGUMENT, what + ": status " + e.what());
            return;
        } catch (const c10::Error &e) {
            fail(what + ": c10::Error, not storage_sharing::Error: " + e.what_without_backtrace());
        }
        fail(what + ": no error");
    };
    const int64_t big = INT64_MAX;
    refused({1 << 20}, {1}, 0, at::kFloat, "a 1M-element view of 16 bytes");
    refused({4}, {1}, 1, at::kFloat, "offset 1 pushes the last element out");
    refused({2}, {3}, 1, at::kFloat, "a stride past the end");
    refused({4}, {1}, 0, at::kDouble, "8-byte elements");
    refused({}, {}, 4, at::kFloat, "a scalar at offset 4");
    refused({-1}, {1}, 0, at::kFloat, "a negative size");
    refused({2}, {-1}, 1, at::kFloat, "a negative stride");
    refused({1}, {1}, -1, at::kFloat, "a negative offset");
    refused({big}, {big}, 0, at::kFloat, "(size - 1) * stride overflowing");
    refused({2, 2}, {big / 2 + 1, big / 2 + 1}, 0, at::kFloat, "the sum of steps overflowing");
    refused({1}, {1}, big, at::kFloat, "the offset in bytes overflowing");
    refused({2}, {1, 1}, 0, at::kFloat, "sizes and strides of different lengths");
    refused({1}, {1}, 0, static_cast<c10::ScalarType>(99), "dtype 99");
    refused({1}, {1}, 0, c10::ScalarType::Undefined, "an undefined dtype");
    refused({1}, {1}, 0, at::kQInt8, "a quantized dtype");
    /* What fits is accepted, exactly to the last byte; an empty view needs no bytes, as in set_. */
    expect(sst::tensor_from_storage(small, at::kFloat, {4}, {1}, 0).numel() == 4, "the exact fit");
    expect(sst::tensor_from_storage(small, at::kFloat, {2, 2}, {0, 3}, 0).numel() == 4, "a broadcast view");
    expect(sst::tensor_from_storage(small, at::kFloat, {}, {}, 3).numel() == 1, "a scalar at the last element");
    expect(sst::tensor_from_storage(small, at::kFloat, {0, 5}, {5, 1}, 100).numel() == 0, "an empty view");
}

/* The handles a hostile producer could send: each changes one field of an
 * honest share. The consumer (a copy of this program) opens each and says
 * what happened; none may open. */
struct Tamper {
    const char *name;
    void (*apply)(sst::ArenaTensorHandle &);
};
const std::vector<Tamper> kTampers = {
    {"sizes", [](sst::ArenaTensorHandle &h) { h.sizes[0] = 1 << 20; }},
    {"block_size", [](sst::ArenaTensorHandle &h) { h.block.size += 1 << 20; }},
    {"offset", [](sst::ArenaTensorHandle &h) { h.storage_offset = INT64_MAX / 2; }},
    {"stride", [](sst::ArenaTensorHandle &h) { h.strides[0] = -10; }},
    {"ndim", [](sst::ArenaTensorHandle &h) { h.ndim = sst::kMaxArenaTensorDims + 1; }},
    {"dtype", [](sst::ArenaTensorHandle &h) { h.dtype = 99; }},
    {"dtype_undefined", [](sst::ArenaTensorHandle &h) { h.dtype = static_cast<int32_t>(c10::ScalarType::Undefined); }},
    {"dtype_quantized", [](sst::ArenaTensorHandle &h) { h.dtype = static_cast<int32_t>(at::kQInt8); }},
};

void test_arena_handle_bounds_checked() {
    sst::ArenaAllocator arena;
    at::Tensor full = arena.empty({6, 10}, at::kLong);
    full.copy_(recipe_full(at::kLong));
    at::Tensor view = recipe_view(full);
    /* One share per tampered handle (each carries its own hold), then an honest one. */
    std::vector<sst::ArenaTensorHandle> handles, originals;
    for (const Tamper &t : kTampers) {
        originals.push_back(arena.share(view));
        handles.push_back(originals.back());
        t.apply(handles.back());
    }
    handles.push_back(arena.share(view));
    auto [ours, theirs] = socket_pair();
    Child consumer;
    spawn_self(consumer, {"arena-tampered", std::to_string(theirs.get())}, theirs.get());
    theirs.reset();
    int fd = arena.segment_fd(handles[0]);
    ss::send_fds(ours.get(), handles.data(), handles.size() * sizeof handles[0], &fd, 1);
    Words reply = parse_words(consumer.hear());
    std::string not_refused;
    for (const Tamper &t : kTampers) {
        const std::string &got = reply[t.name];
        if (got.rfind("refused:", 0) != 0) not_refused += std::string(" ") + t.name + ":" + got;
    }
    expect(not_refused.empty(), "forged handles not refused:" + not_refused);
    expect(reply["honest"] == "ok", "the honest handle after the forged ones: " + reply["honest"]);
    /* Every hold the consumer adopted is back (it dropped the honest tensor
     * before replying); the forged block size never got past the library,
     * so that share is still in flight and is cancelled here. Then the
     * block is free, not deferred. */
    for (size_t i = 0; i < kTampers.size(); i++) {
        if (std::string(kTampers[i].name) == "block_size") arena.unshare(originals[i]);
    }
    full.reset();
    view.reset();
    ss_arena_stats stats{};
    ss::check(ss_arena_stats_get(arena.arena(), &stats), "ss_arena_stats_get");
    expect(stats.live_blocks == 0 && stats.deferred_blocks == 0,
           "holds left on the block: " + std::to_string(stats.live_blocks) + " live, " +
               std::to_string(stats.deferred_blocks) + " deferred");
    consumer.say("bye");
    expect(consumer.wait() == 0, "consumer exit status");
}

/* ---- C16: storages in shared memory cannot be resized away ---- */

/* resize_ to more bytes must throw and leave the bytes where receivers see them. */
void expect_resize_refused(const at::Tensor &t, const std::string &what) {
    expect(!t.storage().resizable(), what + ": the storage is resizable");
    const void *before = t.storage().data();
    size_t nbytes = t.storage().nbytes();
    bool threw = false;
    /* On an alias: a refused resize_ leaves its tensor with the new sizes
     * (as in PyTorch), and `t` is written to afterwards. */
    at::Tensor alias = t.alias();
    try {
        alias.resize_({4096});
    } catch (const c10::Error &) {
        threw = true;
    }
    expect(threw, what + ": resize_ did not throw");
    expect(t.storage().data() == before && t.storage().nbytes() == nbytes && t.numel() == 4,
           what + ": resize_ moved the bytes");
}

void test_shared_storages_not_resizable() {
    for (sst::Strategy strategy : {sst::Strategy::FileSystem, sst::Strategy::FileDescriptor}) {
        expect_resize_refused(sst::empty_shared({4}, at::kFloat, strategy), "empty_shared");
    }
    /* Born under the scope, then shared: a receiver maps it, then a resize
     * is refused and a write still reaches the receiver. */
    at::Tensor t;
    {
        sst::ScopedCpuAllocator scope(sst::Strategy::FileSystem);
        t = at::zeros({4}, at::kFloat);
    }
    ss::SharedFilename s = sst::share_filename(t.storage());
    c10::Storage receiver = sst::open_shared_filename(s);
    expect_resize_refused(t, "at::zeros in a ScopedCpuAllocator, shared by name");
    t.fill_(7);
    expect(static_cast<const float *>(receiver.data())[3] == 7, "the receiver does not see the write after resize_");
    {
        sst::ScopedCpuAllocator scope(sst::Strategy::FileDescriptor);
        t = at::zeros({4}, at::kFloat);
    }
    sst::share_fd(t.storage());
    expect_resize_refused(t, "at::zeros in a ScopedCpuAllocator, shared by fd");
    /* A heap storage moved into shared memory by sharing. */
    at::Tensor heap = at::zeros({4}, at::kFloat);
    sst::share_fd(heap.storage());
    expect_resize_refused(heap, "a heap storage moved by share_fd");
}

/* ---- C17: empty storages, ScopedCpuAllocator on two threads ---- */

void test_empty_storages_like_pytorch() {
    Child py;
    spawn_peer(py, {"empty-storages"});
    Words torch_says = parse_words(py.hear());
    /* By fd: PyTorch's (-1, 0), and the storage is left as it is. */
    c10::Storage empty = at::empty({0}, at::kFloat).storage();
    ss::SharedFd fd = sst::share_fd(empty);
    expect(torch_says["fd"] == "-1" && torch_says["fd_nbytes"] == "0", "PyTorch's empty share_fd changed");
    expect(fd.fd == -1 && fd.nbytes == 0, "share_fd of an empty storage: (" + std::to_string(fd.fd) + ", " +
                                              std::to_string(fd.nbytes) + ")");
    /* By name: a segment of the header alone, opened with 0 bytes both ways. */
    expect(torch_says["nbytes"] == "0" && !torch_says["name"].empty(), "PyTorch's empty share_filename changed");
    c10::Storage theirs = sst::open_shared_filename(torch_says["manager"], torch_says["name"], 0);
    expect(theirs.nbytes() == 0, "PyTorch's empty segment opened with bytes");
    c10::Storage mine = at::empty({0}, at::kFloat).storage();
    ss::SharedFilename named = sst::share_filename(mine);
    expect(named.nbytes == 0 && shm_exists(named.name), "share_filename of an empty storage: " + named.name);
    expect(sst::share_filename(mine).name == named.name, "sharing it twice made a second segment");
    py.say(filename_words(named));
    Words reply = parse_words(py.hear());
    expect(reply["status"] == "ok" && reply["nbytes"] == "0", "python opening ours: " + reply["status"]);
    py.say("bye");
    expect(py.wait() == 0, "python failed");
    mine = c10::Storage();
    expect(!shm_exists(named.name), "the empty segment outlived its last holder");
}

/* Steps two threads take in turn. */
class Turns {
public:
    void wait_for(int step) {
        std::unique_lock<std::mutex> lock(mutex_);
        if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return step_ >= step; })) fail("a thread hung");
    }
    void done(int step) {
        std::lock_guard<std::mutex> lock(mutex_);
        step_ = step;
        cv_.notify_all();
    }

private:
    std::mutex mutex_;
    std::condition_variable cv_;
    int step_ = 0;
};

void test_scoped_allocator_two_threads() {
    c10::Allocator *original = c10::GetCPUAllocator();
    auto &by_fd = sst::SharedAllocator::get(sst::Strategy::FileDescriptor);
    auto &by_name = sst::SharedAllocator::get(sst::Strategy::FileSystem);
    c10::Allocator *while_b_alone = nullptr;
    /* A begins, B begins, A ends first, then B. */
    Turns turns;
    std::thread a([&] {
        sst::ScopedCpuAllocator scope(sst::Strategy::FileDescriptor);
        turns.done(1);
        turns.wait_for(2);
    });
    std::thread b([&] {
        turns.wait_for(1);
        {
            sst::ScopedCpuAllocator scope(sst::Strategy::FileSystem);
            turns.done(2);
            a.join();
            while_b_alone = c10::GetCPUAllocator();
        }
    });
    b.join();
    c10::Allocator *after = c10::GetCPUAllocator();
    if (after != original) c10::SetCPUAllocator(original, UINT8_MAX); /* for the tests after this one */
    expect(while_b_alone == &by_name, std::string("after A ended, B's scope lost its allocator (") +
                                          (while_b_alone == &by_fd ? "A's" : "the original") + ")");
    expect(after == original, std::string("after both ended, the CPU allocator is ") +
                                  (after == &by_fd ? "A's shared one" : after == &by_name ? "B's shared one" : "another"));
    at::Tensor heap = at::empty({16});
    expect(!sst::is_shared(heap.storage()), "at::empty is still shared after both scopes");
    /* Nested on one thread, ending in order, still works. */
    {
        sst::ScopedCpuAllocator outer(sst::Strategy::FileSystem);
        {
            sst::ScopedCpuAllocator inner(sst::Strategy::FileDescriptor);
            expect(c10::GetCPUAllocator() == &by_fd, "inner scope");
        }
        expect(c10::GetCPUAllocator() == &by_name, "outer scope after the inner ended");
    }
    expect(c10::GetCPUAllocator() == original, "after nested scopes");
}

/* ======================= the copies of this program ======================= */

int run_victim() {
    at::Tensor full = sst::empty_shared({6, 10}, at::kFloat);
    full.copy_(recipe_full(at::kFloat));
    at::Tensor view = recipe_view(full);
    ss::SharedFilename s = sst::share_filename(view.storage());
    sst::shared_incref(view.storage());
    std::printf("%s %s\n", filename_words(s).c_str(), view_words(view).c_str());
    std::fflush(stdout);
    char buf[16];
    while (std::fgets(buf, sizeof buf, stdin)) {
    }
    return 0;
}

int run_holder() {
    char buf[4096];
    if (!std::fgets(buf, sizeof buf, stdin)) return 2;
    Words w = parse_words(buf);
    c10::Storage s = sst::open_shared_filename(w.at("manager"), w.at("name"), std::stoull(w.at("nbytes")));
    sst::shared_decref(s);
    at::Tensor t = rebuild_and_check(s, w);
    std::printf("status=held\n");
    std::fflush(stdout);
    if (!std::fgets(buf, sizeof buf, stdin)) return 2;
    at::Tensor expected = recipe_view(recipe_full(t.scalar_type()));
    if (!at::equal(t, expected)) return 3; /* the mapping outlives its creator */
    t.reset();
    s = c10::Storage();
    std::printf("status=released\n");
    std::fflush(stdout);
    return 0;
}

int run_arena_consumer(int sock) {
    ss::FdMessage msg = ss::recv_fds(sock, sizeof(sst::ArenaTensorHandle), 1);
    if (msg.payload.size() != sizeof(sst::ArenaTensorHandle) || msg.fds.size() != 1) return 2;
    sst::ArenaTensorHandle h;
    std::memcpy(&h, msg.payload.data(), sizeof h);
    ss::ArenaView::import_segment_fd(h.block, msg.fds[0].get());
    (void)msg.fds[0].release();
    at::Tensor t = sst::open_arena_tensor(h);
    at::Tensor expected = recipe_view(recipe_full(at::kLong));
    bool ok = t.scalar_type() == at::kLong && t.sizes() == expected.sizes() && t.strides() == expected.strides() &&
              t.storage_offset() == 12 && at::equal(t, expected);
    t[0][0] = 1000;
    std::printf("status=%s\n", ok ? "ok" : "mismatch");
    std::fflush(stdout);
    char buf[16];
    while (std::fgets(buf, sizeof buf, stdin)) {
    }
    return 0;
}

/* Opens each tampered handle (see kTampers), then the honest last one. */
int run_arena_tampered(int sock) {
    const size_t n = kTampers.size() + 1;
    ss::FdMessage msg = ss::recv_fds(sock, n * sizeof(sst::ArenaTensorHandle), 1);
    if (msg.payload.size() != n * sizeof(sst::ArenaTensorHandle) || msg.fds.size() != 1) return 2;
    std::vector<sst::ArenaTensorHandle> hs(n);
    std::memcpy(hs.data(), msg.payload.data(), msg.payload.size());
    sst::ArenaTensorHandle honest = hs.back();
    ss::ArenaView::import_segment_fd(honest.block, msg.fds[0].get());
    (void)msg.fds[0].release();
    std::string words;
    for (size_t i = 0; i < kTampers.size(); i++) {
        std::string got;
        try {
            at::Tensor t = sst::open_arena_tensor(hs[i]);
            got = "opened"; /* never read: it may reach past the block */
        } catch (const ss::Error &e) {
            got = "refused:" + std::to_string(static_cast<int>(e.status()));
        } catch (const std::exception &e) {
            got = "other-error";
        }
        words += std::string(kTampers[i].name) + "=" + got + " ";
    }
    at::Tensor t = sst::open_arena_tensor(honest);
    bool ok = at::equal(t, recipe_view(recipe_full(at::kLong)));
    t.reset(); /* its hold goes back before the producer counts them */
    std::printf("%shonest=%s\n", words.c_str(), ok ? "ok" : "mismatch");
    std::fflush(stdout);
    char buf[16];
    while (std::fgets(buf, sizeof buf, stdin)) {
    }
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    std::string mode = argc > 1 ? argv[1] : "";
    try {
        if (mode == "victim") return run_victim();
        if (mode == "holder") return run_holder();
        if (mode == "arena-consumer" && argc > 2) return run_arena_consumer(std::atoi(argv[2]));
        if (mode == "arena-tampered" && argc > 2) return run_arena_tampered(std::atoi(argv[2]));
    } catch (const std::exception &e) {
        std::fprintf(stderr, "%s: %s\n", mode.c_str(), e.what());
        return 1;
    }
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s PYTHON PEER_PY\n", argv[0]);
        return 2;
    }
    g_python = argv[1];
    g_peer = argv[2];
    signal(SIGPIPE, SIG_IGN);
    alarm(600); /* a hang guard only */

    const std::vector<std::pair<const char *, std::function<void()>>> tests = {
        {"allocator: storages born in shared memory (empty_shared, at::empty in scope)", test_allocator_born_shared},
        {"share_fd/share_filename move a heap storage in place", test_heap_storage_moves_in_place},
        {"C++ -> Python by file name through our manager", test_cpp_to_python_filename},
        {"Python -> C++ by file name through torch_shm_manager; weak refs", test_python_to_cpp_filename},
        {"C++ -> Python by fd over a Unix socket", test_cpp_to_python_fd},
        {"Python -> C++ by fd over a Unix socket", test_python_to_cpp_fd},
        {"C++ -> Python reductions -> torch.multiprocessing.Queue consumer", test_python_queue_consumer},
        {"kill -9 of the C++ side and its Python peer: nothing left", test_kill9_cpp_side},
        {"kill -9 of the Python side: nothing left", test_kill9_python_side},
        {"arena tensor C++ -> C++ by handle", test_arena_tensor_cpp_to_cpp},
        {"CUDA without a GPU: the library's no-CUDA error", test_cuda_without_gpu},
        {"errors name what was wrong", test_errors},
        {"tensor_from_storage checks the view against the storage (C15)", test_view_bounds_checked},
        {"open_arena_tensor refuses forged handles, then opens an honest one (C15, C17)", test_arena_handle_bounds_checked},
        {"storages in shared memory refuse resize_ (C16)", test_shared_storages_not_resizable},
        {"empty storages share as PyTorch's do (C17)", test_empty_storages_like_pytorch},
        {"ScopedCpuAllocator scopes ending out of order on two threads (C17)", test_scoped_allocator_two_threads},
    };
    int passed = 0, failed = 0;
    for (const auto &[name, test] : tests) {
        try {
            test();
            std::printf("ok - %s\n", name);
            passed++;
        } catch (const std::exception &e) {
            std::printf("FAIL - %s: %s\n", name, e.what());
            failed++;
        }
        std::fflush(stdout);
    }
    std::printf("libtorch: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
