// The C++ layer over storages, descriptor passing and CUDA IPC
// (storage_sharing.hpp): ownership, exceptions, and sharing with a forked
// process both ways, by fd and by name, with /dev/shm checked afterwards.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "check.hpp"

namespace ss = storage_sharing;

template <class T>
constexpr bool move_only_v = !std::is_copy_constructible_v<T> && !std::is_copy_assignable_v<T> &&
                             std::is_nothrow_move_constructible_v<T> && std::is_nothrow_move_assignable_v<T>;
static_assert(move_only_v<ss::Storage> && move_only_v<ss::Weak> && move_only_v<ss::unique_fd>, "move-only");
static_assert(move_only_v<ss::CudaSent> && move_only_v<ss::CudaReceived> && move_only_v<ss::CudaMemory>,
              "move-only");

static bool fd_open(int fd) { return fcntl(fd, F_GETFD) >= 0; }

static unsigned char pattern(std::size_t i, int seed) { return static_cast<unsigned char>(i * 31 + seed); }
static void fill(ss::Storage &s, int seed) {
    for (std::size_t i = 0; i < s.nbytes(); i++) s.data_as<unsigned char>()[i] = pattern(i, seed);
}
static bool matches(const ss::Storage &s, int seed) {
    for (std::size_t i = 0; i < s.nbytes(); i++)
        if (s.data_as<unsigned char>()[i] != pattern(i, seed)) return false;
    return true;
}

static void wait_child_ok(pid_t pid) {
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// Runs `body` in a forked child; an exception or failed CHECK fails it.
template <class F>
static pid_t fork_child(F body) {
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int code = 0;
        try {
            body();
        } catch (const std::exception &e) {
            std::fprintf(stderr, "child: %s\n", e.what());
            code = 3;
        }
        _exit(code);
    }
    return pid;
}

static void test_refs_weak_and_moves() {
    ss::Weak w;
    {
        ss::Storage a = ss::Storage::create(1000);
        CHECK(a && a.nbytes() == 1000 && !a.is_shared() && a.data_as<unsigned char>()[999] == 0);
        ss::Storage b = a.ref();
        CHECK(b.get() != a.get() && b.data() == a.data());
        w = a.weak();
        CHECK(!w.expired());
        ss::Storage moved = std::move(a);
        CHECK(!a && a.get() == nullptr && a.nbytes() == 0 && a.data() == nullptr);  // NOLINT: moved-from
        moved.resize(10);
        CHECK(b.nbytes() == 10);
        ss::Storage up = w.upgrade();
        CHECK(up.data() == b.data());
    }
    CHECK(w.expired());
    ss::Error e = expect_error([&] { w.upgrade(); }, SS_ERR_NOT_FOUND);
    CHECK(std::string(e.what()).rfind("ss_weak_upgrade: ", 0) == 0);
    ss::Storage empty = ss::Storage::create(0);
    CHECK(empty.data() == nullptr && empty.nbytes() == 0);
    expect_error([&] { empty.share_fd(); }, SS_ERR_INVALID_ARGUMENT);
    ss_storage *raw = ss::Storage::create(8).release();
    ss::Storage owner(raw);
    CHECK(owner.get() == raw && owner.nbytes() == 8);
}

static void test_errors() {
    ss::Storage heap = ss::Storage::create(64);
    expect_error([&] { heap.shared_incref(); }, SS_ERR_UNSUPPORTED);
    expect_error([&] { heap.shared_refcount(); }, SS_ERR_UNSUPPORTED);
    expect_error([&] { heap.shared_fd(); }, SS_ERR_NOT_FOUND);
    ss::Error e = expect_error(
        [] { ss::Storage::open_shared_filename("/nonexistent/manager.sock", "/torch_1_2_3", 10); }, SS_ERR_NOT_FOUND);
    CHECK(e.detail().find("/nonexistent/manager.sock") != std::string::npos);
    expect_error([] { ss::Storage::open_shared_fd(-1, 10); }, SS_ERR_INVALID_ARGUMENT);
    ss::Storage fdbacked = ss::Storage::new_using_fd(4096);
    CHECK(fdbacked.is_shared() && fd_open(fdbacked.shared_fd()));
    expect_error([&] { fdbacked.resize(1); }, SS_ERR_UNSUPPORTED);
    expect_error([&] { ss::Storage::open_shared_fd(fdbacked.shared_fd(), 1 << 20); }, SS_ERR_SIZE_MISMATCH);
    ss::Storage null_handle;
    expect_error([&] { null_handle.ref(); }, SS_ERR_NULL_POINTER);
}

// Parent -> child by fd: the parent shares and sends the descriptor; the
// child opens, checks, answers in the last byte.
static void test_fd_parent_to_child() {
    ss::Storage s = ss::Storage::create(1 << 20);
    fill(s, 5);
    void *heap = s.data();
    ss::SharedFd shared = s.share_fd();
    CHECK(shared.nbytes == s.nbytes() && s.is_shared() && s.shared_fd() == shared.fd && s.data() != heap);
    CHECK(s.share_fd().fd == shared.fd && matches(s, 5));
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    ss::unique_fd mine(sv[0]), theirs(sv[1]);
    pid_t pid = fork_child([&] {
        mine.reset();
        ss::FdMessage msg = ss::recv_fds(theirs.get(), 32, 2);
        CHECK(msg.fds.size() == 1 && (fcntl(msg.fds[0].get(), F_GETFD) & FD_CLOEXEC));
        ss::Storage r = ss::Storage::open_shared_fd(msg.fds[0].get(), std::stoul(msg.payload));
        CHECK(r.is_shared() && matches(r, 5));
        r.data_as<unsigned char>()[r.nbytes() - 1] = 0xEE;
        ss::send_fds(theirs.get(), "k");
    });
    theirs.reset();
    ss::send_fds(mine.get(), std::to_string(shared.nbytes), {shared.fd});
    CHECK(fd_open(shared.fd));  // still the storage's
    ss::FdMessage ack = ss::recv_fds(mine.get(), 4, 0);
    CHECK(ack.payload == "k" && ack.fds.empty());
    wait_child_ok(pid);
    CHECK(s.data_as<unsigned char>()[s.nbytes() - 1] == 0xEE);
    ss::FdMessage closed = ss::recv_fds(mine.get(), 4, 0);
    CHECK(closed.peer_closed());
}

// Child -> parent by fd: the child makes the storage and sends its fd.
static void test_fd_child_to_parent() {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    ss::unique_fd mine(sv[0]), theirs(sv[1]);
    const std::size_t n = 300000;
    pid_t pid = fork_child([&] {
        mine.reset();
        ss::Storage s = ss::Storage::new_using_fd(n);
        fill(s, 9);
        ss::send_fds(theirs.get(), std::to_string(n), {s.shared_fd()});
        ss::FdMessage ack = ss::recv_fds(theirs.get(), 4, 0);
        CHECK(ack.payload == "k" && s.data_as<unsigned char>()[0] == 0x42);
    });
    theirs.reset();
    ss::FdMessage msg = ss::recv_fds(mine.get(), 32, 1);
    CHECK(msg.fds.size() == 1 && std::stoul(msg.payload) == n);
    ss::Storage r = ss::Storage::open_shared_fd(msg.fds[0].get(), n);
    int received = msg.fds[0].get();
    msg.fds.clear();  // the storage mapped a duplicate; ours is closed here
    CHECK(!fd_open(received));
    CHECK(matches(r, 9));
    r.data_as<unsigned char>()[0] = 0x42;
    ss::send_fds(mine.get(), "k");
    wait_child_ok(pid);
}

// Parent -> child by name, with the in-flight reference of torch.multiprocessing.
static void test_name_parent_to_child() {
    ss::Storage s = ss::Storage::create(70000);
    fill(s, 3);
    ss::SharedFilename shared = s.share_filename();
    CHECK(shared.nbytes == 70000 && shared.name.rfind("/torch_", 0) == 0 && shm_exists(shared.name));
    CHECK(shared.manager.find("manager.sock") != std::string::npos);
    CHECK(s.shared_refcount() == 1);
    CHECK(s.share_filename().name == shared.name);  // already managed: same segment
    s.shared_incref();                             // in flight
    pid_t pid = fork_child([&] {
        ss::Storage r = ss::Storage::open_shared_filename(shared);
        r.shared_decref();
        CHECK(r.shared_refcount() == 2 && matches(r, 3));
        r.data_as<unsigned char>()[0] = 0xEE;
    });
    wait_child_ok(pid);
    CHECK(s.data_as<unsigned char>()[0] == 0xEE && s.shared_refcount() == 1);
    s = ss::Storage();
    CHECK(!shm_exists(shared.name));
}

// Child -> parent by name: the child shares, sends the three values over
// a socket and keeps its storage until the parent has opened it.
static void test_name_child_to_parent() {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    ss::unique_fd mine(sv[0]), theirs(sv[1]);
    pid_t pid = fork_child([&] {
        mine.reset();
        ss::Storage s = ss::Storage::new_using_filename(5000);
        fill(s, 7);
        ss::SharedFilename shared = s.share_filename();
        s.shared_incref();
        ss::send_fds(theirs.get(), shared.manager + "\n" + shared.name + "\n" + std::to_string(shared.nbytes));
        ss::FdMessage ack = ss::recv_fds(theirs.get(), 4, 0);
        CHECK(ack.payload == "k" && s.data_as<unsigned char>()[4999] == 0x42 && s.shared_refcount() == 2);
    });
    theirs.reset();
    ss::FdMessage msg = ss::recv_fds(mine.get(), 256, 0);
    std::size_t a = msg.payload.find('\n'), b = msg.payload.rfind('\n');
    CHECK(a != std::string::npos && b > a);
    std::string name = msg.payload.substr(a + 1, b - a - 1);
    ss::Storage r = ss::Storage::open_shared_filename(msg.payload.substr(0, a), name, std::stoul(msg.payload.substr(b + 1)));
    r.shared_decref();
    CHECK(r.nbytes() == 5000 && matches(r, 7));
    r.data_as<unsigned char>()[4999] = 0x42;
    ss::send_fds(mine.get(), "k");
    wait_child_ok(pid);
    CHECK(r.shared_refcount() == 1 && shm_exists(name));
    r = ss::Storage();
    CHECK(!shm_exists(name));
}

static void test_fd_passing_errors() {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    ss::unique_fd a(sv[0]), b(sv[1]);
    expect_error([&] { ss::send_fds(a.get(), ""); }, SS_ERR_INVALID_ARGUMENT);
    std::vector<int> too_many(254, a.get());
    expect_error([&] { ss::send_fds(a.get(), "x", too_many); }, SS_ERR_INVALID_ARGUMENT);
    // Two descriptors to a receiver that takes one: an error, nothing left open.
    int probe = dup(0);
    CHECK(probe >= 0);
    close(probe);  // the lowest free number: a leaked descriptor would take it
    ss::send_fds(a.get(), "x", {a.get(), b.get()});
    expect_error([&] { ss::recv_fds(b.get(), 8, 1); }, SS_ERR_BUFFER_TOO_SMALL);
    int after = dup(0);
    CHECK(after == probe);
    close(after);
    expect_error([] { ss::recv_fds(-1, 8, 1); }, SS_ERR_CLOSED);  // EBADF
    ss::unique_fd moved = std::move(a);
    CHECK(!a && moved && fd_open(moved.get()));  // NOLINT: moved-from
    int raw = moved.get();
    moved.reset();
    CHECK(!fd_open(raw));
}

static void test_manager_spawn() {
    std::string path = ss::shm_manager_spawn();
    CHECK(path.find("manager.sock") != std::string::npos);
    // A storage opened through that manager by its path works like the default.
    ss::Storage s = ss::Storage::new_using_filename(100);
    ss::SharedFilename shared = s.share_filename();
    ss::Storage r = ss::Storage::open_shared_filename(path, shared.name, shared.nbytes);
    CHECK(r.data() != s.data() && r.shared_refcount() == 2);
    r = ss::Storage();
    s = ss::Storage();
    CHECK(!shm_exists(shared.name));
}

// What runs without a GPU: the unavailable status as an exception, the
// tuple's text form, and the counter release of a PyTorch-layout file.
static void test_cuda_without_gpu() {
    ss::Error e = expect_error([] { ss::cuda_driver_info(); }, SS_ERR_CUDA_UNAVAILABLE);
    CHECK(e.detail().rfind("CUDA is not available: ", 0) == 0);
    int dummy = 0;
    expect_error([&] { ss::cuda_share(&dummy, 4, 0); }, SS_ERR_CUDA_UNAVAILABLE);
    ss_cuda_ipc_handle h{};
    expect_error([&] { ss::CudaReceived::open(h); }, SS_ERR_CUDA_UNAVAILABLE);
    expect_error([] { ss::CudaMemory::allocate(0, 64); }, SS_ERR_CUDA_UNAVAILABLE);
    expect_error([&] { ss::cuda_pointer_base(&dummy, 0); }, SS_ERR_CUDA_UNAVAILABLE);
    CHECK(ss::cuda_ipc_collect() == 0 && ss::cuda_limbo_size() == 0);
    ss::CudaSent none_sent;
    CHECK(!none_sent.close());  // nothing to release
    ss::CudaReceived none_received;
    none_received.close();
    ss::CudaMemory none_memory;
    none_memory.free();
}

static void test_cuda_text_and_counter() {
    ss_cuda_ipc_handle h{};
    h.device = 1;
    h.mem_handle_len = SS_CUDA_MEM_HANDLE_MAX;
    for (std::size_t i = 0; i < SS_CUDA_MEM_HANDLE_MAX; i++) h.mem_handle[i] = static_cast<std::uint8_t>(i);
    h.size_bytes = 4096;
    h.offset_bytes = 512;
    std::strcpy(h.ref_counter_handle, "/torch_1_2_3");
    h.ref_counter_offset = 7;
    h.event_sync_required = true;
    std::string text = ss::cuda_ipc_handle_to_text(h);
    ss_cuda_ipc_handle back = ss::cuda_ipc_handle_from_text(text);
    CHECK(back.device == 1 && back.mem_handle_len == h.mem_handle_len && back.size_bytes == 4096 &&
          back.offset_bytes == 512 && back.ref_counter_offset == 7 && back.event_sync_required &&
          std::memcmp(back.mem_handle, h.mem_handle, SS_CUDA_MEM_HANDLE_MAX) == 0 &&
          std::strcmp(back.ref_counter_handle, "/torch_1_2_3") == 0);
    expect_error([] { ss::cuda_ipc_handle_from_text("not a tuple"); }, SS_ERR_INVALID_ARGUMENT);

    std::string name = ss::new_process_wide_shm_handle();
    {
        ss::Map counters = ss::Map::open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE,
                                                    SS_CUDA_COUNTER_SLOTS * sizeof(std::int64_t));
        std::int64_t *slots = counters.data_as<std::int64_t>();
        slots[5] = 1;
        ss::cuda_release_ipc_counter(name, 5);
        CHECK(slots[5] == 0);
        ss::Error e = expect_error([&] { ss::cuda_release_ipc_counter(name, 5); }, SS_ERR_BAD_REFCOUNT);
        CHECK(std::string(e.what()).rfind("ss_cuda_ipc_counter_release: ", 0) == 0);
        expect_error([&] { ss::cuda_release_ipc_counter(name, SS_CUDA_COUNTER_SLOTS); }, SS_ERR_INVALID_ARGUMENT);
    }
    CHECK(!shm_exists(name));
    ss::Error gone = expect_error([&] { ss::cuda_release_ipc_counter(name, 0); }, SS_ERR_PEER_GONE);
    CHECK(gone.detail().find(name) != std::string::npos);
}

static int deleted = 0;
static void count_delete(void *ctx, void *) { *static_cast<int *>(ctx) += 1; }

// With a GPU: a forked consumer (started before this process touches
// CUDA) opens the tuple, the producer sees the counter go 1 -> 0.
static void test_cuda_round_trip() {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    ss::unique_fd mine(sv[0]), theirs(sv[1]);
    pid_t pid = fork_child([&] {
        mine.reset();
        ss::FdMessage msg = ss::recv_fds(theirs.get(), SS_CUDA_HANDLE_TEXT_MAX, 0);
        ss::CudaReceived r = ss::CudaReceived::open(ss::cuda_ipc_handle_from_text(msg.payload));
        CHECK(r.size() == 1 << 20 && r.data() != nullptr);
        ss::send_fds(theirs.get(), "opened");
        ss::FdMessage go = ss::recv_fds(theirs.get(), 8, 0);
        CHECK(go.payload == "close");
        r.close();
        ss::send_fds(theirs.get(), "closed");
    });
    theirs.reset();
    ss::CudaMemory mem = ss::CudaMemory::allocate(0, 1 << 20);
    CHECK(ss::cuda_pointer_base(mem.get(), 0).base == mem.get());
    ss::CudaShare share = ss::cuda_share(mem.get(), mem.size(), 0, nullptr, count_delete, &deleted);
    ss::send_fds(mine.get(), ss::cuda_ipc_handle_to_text(share.handle));
    CHECK(ss::recv_fds(mine.get(), 8, 0).payload == "opened");
    CHECK(share.sent.counter() == 1);
    ss::send_fds(mine.get(), "close");
    CHECK(ss::recv_fds(mine.get(), 8, 0).payload == "closed");
    wait_child_ok(pid);
    CHECK(share.sent.counter() == 0);
    CHECK(!share.sent.close() && deleted == 1);
    mem.free();
    std::printf("test_storage_raii: CUDA round trip through a forked consumer passed\n");
}

int main() {
    signal(SIGPIPE, SIG_IGN);
    test_refs_weak_and_moves();
    test_errors();
    test_fd_parent_to_child();
    test_fd_child_to_parent();
    test_name_parent_to_child();
    test_name_child_to_parent();
    test_fd_passing_errors();
    test_manager_spawn();
    test_cuda_text_and_counter();
    // Whether CUDA works is probed in a child, so that this process only
    // initialises CUDA after forking its consumer.
    pid_t probe = fork();
    CHECK(probe >= 0);
    if (probe == 0) _exit(ss::cuda_available() ? 0 : 3);
    int status = 0;
    CHECK(waitpid(probe, &status, 0) == probe && WIFEXITED(status));
    if (WEXITSTATUS(status) == 0) {
        test_cuda_round_trip();
    } else {
        CHECK(!ss::cuda_available());
        std::printf("CUDA unavailable here: %s\n", ss::cuda_unavailable_reason().c_str());
        test_cuda_without_gpu();
    }
    std::printf("test_storage_raii: all checks passed\n");
    return 0;
}
