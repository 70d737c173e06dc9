/* storage-sharing C++ API: a header-only RAII layer over storage_sharing.h.
 * Hand-written (C++17). Handles free themselves, move but never copy, and
 * every failing call throws storage_sharing::Error carrying the ss_status
 * and the library's message.
 *
 * Thread safety is the C API's: const member functions may run on several
 * threads at once; close(), release(), assignment and destruction need
 * exclusive access. */
#ifndef STORAGE_SHARING_HPP
#define STORAGE_SHARING_HPP

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "storage_sharing.h"

namespace storage_sharing {

/* A failed call: status() is the C status code, detail() the library's
 * message (ss_last_error_message()), what() "<function>: <detail>". */
class Error : public std::runtime_error {
public:
    Error(ss_status status, const std::string &function, const std::string &detail)
        : std::runtime_error(function + ": " + detail), status_(status), detail_(detail) {}
    ss_status status() const noexcept { return status_; }
    const std::string &detail() const noexcept { return detail_; }
    /* The fixed text of the status ("not found", ...). */
    const char *status_text() const noexcept { return ss_status_str(static_cast<int>(status_)); }

private:
    ss_status status_;
    std::string detail_;
};

/* Throws Error when `status` is not SS_OK. Call it right after the C call,
 * on the same thread: the message is thread-local. */
inline void check(ss_status status, const char *function) {
    if (status != SS_OK) {
        const char *detail = ss_last_error_message();
        throw Error(status, function, detail && *detail ? detail : ss_status_str(static_cast<int>(status)));
    }
}

/* `s` as a C string for the C API. A NUL byte inside would cut it short
 * there (so "/a\0b" would open "/a"): refused with Error
 * SS_ERR_INVALID_ARGUMENT instead. */
inline const char *c_string_arg(const std::string &s, const char *function, const char *what) {
    std::size_t nul = s.find('\0');
    if (nul != std::string::npos) {
        throw Error(SS_ERR_INVALID_ARGUMENT, function,
                    std::string(what) + " has a NUL byte at " + std::to_string(nul) + ": refused, it would be cut short");
    }
    return s.c_str();
}

/* The library's run-time version ("MAJOR.MINOR.PATCH"); SS_VERSION_STRING is
 * the version this header came with. */
inline std::string version() { return ss_version(); }

/* A fresh process-wide segment name, "/torch_<pid>_<rand>_<n>". */
inline std::string new_process_wide_shm_handle() {
    char buf[64];
    check(ss_shm_name_new(buf, sizeof buf), "ss_shm_name_new");
    return buf;
}

/* Owns one C handle and frees it with Free. Move-only. Every owning class
 * below is one of these plus its member functions, so a new handle type of
 * the C API takes one `unique_handle<ss_x, ss_x_free>`. */
template <class T, void (*Free)(T *)>
class unique_handle {
public:
    unique_handle() noexcept = default;
    explicit unique_handle(T *raw) noexcept : raw_(raw) {}
    unique_handle(const unique_handle &) = delete;
    unique_handle &operator=(const unique_handle &) = delete;
    unique_handle(unique_handle &&other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
    unique_handle &operator=(unique_handle &&other) noexcept {
        if (this != &other) reset(std::exchange(other.raw_, nullptr));
        return *this;
    }
    ~unique_handle() { reset(); }

    T *get() const noexcept { return raw_; }
    /* Gives up ownership: the caller frees the handle. */
    T *release() noexcept { return std::exchange(raw_, nullptr); }
    void reset(T *raw = nullptr) noexcept {
        T *old = std::exchange(raw_, raw);
        if (old) Free(old);
    }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

private:
    T *raw_ = nullptr;
};

/* What a map tells about itself, for owned (Map) and borrowed (MapView)
 * handles alike. */
class MapView {
public:
    MapView() noexcept = default;
    /* Borrows `raw` (may be NULL): the view must not outlive it. */
    explicit MapView(const ss_map *raw) noexcept : raw_(raw) {}

    const ss_map *get() const noexcept { return raw_; }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

    /* Start of the user data; nullptr once closed. */
    void *data() const noexcept { return ss_map_data(raw_); }
    template <class U>
    U *data_as() const noexcept { return static_cast<U *>(data()); }
    /* Bytes of user data (a refcounted map's header not counted). */
    std::size_t size() const noexcept { return ss_map_size(raw_); }
    /* The descriptor kept with SS_MAPPED_KEEPFD, else -1. */
    int fd() const noexcept { return ss_map_fd(raw_); }
    std::string filename() const {
        const char *name = ss_map_filename(raw_);
        return name ? name : "";
    }
    int flags() const noexcept { return ss_map_flags(raw_); }
    bool is_refcounted() const noexcept { return ss_map_is_refcounted(raw_); }

    /* Reference counts of refcounted maps (Error SS_ERR_UNSUPPORTED otherwise). */
    void incref() const { check(ss_map_incref(raw_), "ss_map_incref"); }
    /* Returns whether the count reached 0. */
    bool decref() const {
        bool zero = false;
        check(ss_map_decref(raw_, &zero), "ss_map_decref");
        return zero;
    }
    std::int32_t refcount() const {
        std::int32_t n = 0;
        check(ss_map_refcount(raw_, &n), "ss_map_refcount");
        return n;
    }

    /* The live map whose data holds `ptr`, as ATen's fromDataPtr; an empty
     * view when none does. Borrowed: the owner keeps it alive. */
    static MapView from_data(const void *ptr) noexcept { return MapView(ss_map_lookup(ptr)); }

private:
    const ss_map *raw_ = nullptr;
};

/* An owned mapping: ATen's MapAllocator / RefcountedMapAllocator. Unmapped,
 * and its name removed where ATen would, when destroyed or close()d. */
class Map : public MapView {
public:
    Map() noexcept = default;
    /* Takes ownership of a handle from the C API. */
    explicit Map(ss_map *raw) noexcept : MapView(raw), handle_(raw) {}
    Map(Map &&other) noexcept : MapView(other), handle_(std::move(other.handle_)) {
        static_cast<MapView &>(other) = MapView();
    }
    Map &operator=(Map &&other) noexcept {
        if (this != &other) {
            handle_ = std::move(other.handle_);
            static_cast<MapView &>(*this) = other;
            static_cast<MapView &>(other) = MapView();
        }
        return *this;
    }
    Map(const Map &) = delete;
    Map &operator=(const Map &) = delete;
    ~Map() = default;

    /* MapAllocator(name, flags, size). */
    static Map open(const std::string &name, int flags, std::size_t size) {
        ss_map *raw = nullptr;
        check(ss_map_open(c_string_arg(name, "ss_map_open", "name"), flags, size, &raw), "ss_map_open");
        return Map(raw);
    }
    /* MapAllocator(WITH_FD, name, fd, flags, size): on success the map owns
     * `fd`; on failure (an exception) the caller still does. */
    static Map open_fd(int fd, int flags, std::size_t size, const std::string &name = "") {
        ss_map *raw = nullptr;
        check(ss_map_open_fd(c_string_arg(name, "ss_map_open_fd", "name"), fd, flags, size, &raw), "ss_map_open_fd");
        return Map(raw);
    }
    /* RefcountedMapAllocator(name, flags, size). */
    static Map open_refcounted(const std::string &name, int flags, std::size_t size) {
        ss_map *raw = nullptr;
        check(ss_map_open_refcounted(c_string_arg(name, "ss_map_open_refcounted", "name"), flags, size, &raw),
              "ss_map_open_refcounted");
        return Map(raw);
    }
    /* An anonymous fd-backed segment of `size` zero bytes. */
    static Map new_fd_storage(std::size_t size) {
        ss_map *raw = nullptr;
        check(ss_map_new_shm_fd(size, &raw), "ss_map_new_shm_fd");
        return Map(raw);
    }
    /* share_memory_(): a copy of `nbytes` at `src` in a new fd-backed segment. */
    static Map share_memory(const void *src, std::size_t nbytes) {
        ss_map *raw = nullptr;
        check(ss_map_new_copy(src, nbytes, &raw), "ss_map_new_copy");
        return Map(raw);
    }

    ss_map *get() const noexcept { return handle_.get(); }
    /* Unmaps now and reports a failure (the destructor cannot). The object
     * stays valid, with data() == nullptr. Closing twice does nothing. */
    void close() {
        if (handle_) check(ss_map_close(handle_.get()), "ss_map_close");
    }
    /* Gives up ownership, e.g. to hand the handle to a framework's data
     * pointer with `free_map_context` as its deleter. */
    ss_map *release() noexcept {
        static_cast<MapView &>(*this) = MapView();
        return handle_.release();
    }

private:
    unique_handle<ss_map, ss_map_free> handle_;
};

/* A deleter of the shape `void(void *ctx)` (ATen's DataPtr, C callbacks)
 * for a handle given up by Map::release(). */
inline void free_map_context(void *ctx) noexcept { ss_map_free(static_cast<ss_map *>(ctx)); }

/* ---- Storages (ss_storage, ss_weak) and sharing them between processes ---- */

/* What the receiver of a storage shared by fd needs besides the descriptor. */
struct SharedFd {
    int fd;              /* owned by the storage: send or dup it, never close it */
    std::size_t nbytes;
};

/* The three values ss_storage_new_shared_filename takes in another process. */
struct SharedFilename {
    std::string manager; /* the manager's socket path */
    std::string name;    /* the segment, "/torch_..." */
    std::size_t nbytes;
};

class Weak;

/* One strong reference to a storage (ss_storage). Move-only: a second
 * reference to the same bytes is an explicit ref(). The bytes go with the
 * last reference, in this process or (when shared) in all of them. */
class Storage {
public:
    Storage() noexcept = default;
    /* Takes ownership of a handle from the C API. */
    explicit Storage(ss_storage *raw) noexcept : handle_(raw) {}

    /* `nbytes` zero bytes on the heap (resizable until shared). */
    static Storage create(std::size_t nbytes) {
        ss_storage *raw = nullptr;
        check(ss_storage_new(nbytes, &raw), "ss_storage_new");
        return Storage(raw);
    }
    /* A new fd-backed shared storage of zero bytes (ATen flags 86). */
    static Storage new_using_fd(std::size_t nbytes) {
        ss_storage *raw = nullptr;
        check(ss_storage_new_using_fd(nbytes, &raw), "ss_storage_new_using_fd");
        return Storage(raw);
    }
    /* A new managed shared storage of zero bytes (ATen flags 6). */
    static Storage new_using_filename(std::size_t nbytes) {
        ss_storage *raw = nullptr;
        check(ss_storage_new_using_filename(nbytes, &raw), "ss_storage_new_using_filename");
        return Storage(raw);
    }
    /* Opens a storage shared by fd (a duplicate of `fd` is mapped: the
     * caller still closes `fd`). */
    static Storage open_shared_fd(int fd, std::size_t nbytes) {
        ss_storage *raw = nullptr;
        check(ss_storage_new_shared_fd(fd, nbytes, &raw), "ss_storage_new_shared_fd");
        return Storage(raw);
    }
    /* Opens a storage shared by name ("" manager = this process's own). */
    static Storage open_shared_filename(const std::string &manager, const std::string &name, std::size_t nbytes) {
        ss_storage *raw = nullptr;
        check(ss_storage_new_shared_filename(c_string_arg(manager, "ss_storage_new_shared_filename", "manager"),
                                             c_string_arg(name, "ss_storage_new_shared_filename", "name"), nbytes, &raw),
              "ss_storage_new_shared_filename");
        return Storage(raw);
    }
    static Storage open_shared_filename(const SharedFilename &shared) {
        return open_shared_filename(shared.manager, shared.name, shared.nbytes);
    }

    ss_storage *get() const noexcept { return handle_.get(); }
    /* Gives up ownership: the caller calls ss_storage_free. */
    ss_storage *release() noexcept { return handle_.release(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }

    /* A second strong reference to the same bytes. */
    Storage ref() const {
        ss_storage *raw = nullptr;
        check(ss_storage_ref(handle_.get(), &raw), "ss_storage_ref");
        return Storage(raw);
    }
    inline Weak weak() const;

    /* Start of the bytes (nullptr when empty). Changes when share_fd or
     * share_filename moves a heap storage into shared memory. */
    void *data() const noexcept { return ss_storage_data(handle_.get()); }
    template <class U>
    U *data_as() const noexcept { return static_cast<U *>(data()); }
    std::size_t nbytes() const noexcept { return ss_storage_nbytes(handle_.get()); }
    bool is_shared() const noexcept { return ss_storage_is_shared(handle_.get()); }
    /* Heap storages only (a shared one throws SS_ERR_UNSUPPORTED). */
    void resize(std::size_t nbytes) const { check(ss_storage_resize(handle_.get(), nbytes), "ss_storage_resize"); }

    /* Moves the bytes into a nameless fd-backed segment (once). */
    SharedFd share_fd() const {
        SharedFd out{-1, 0};
        check(ss_storage_share_fd(handle_.get(), &out.fd, &out.nbytes), "ss_storage_share_fd");
        return out;
    }
    /* The descriptor of an fd-backed storage (SS_ERR_NOT_FOUND otherwise). */
    int shared_fd() const {
        int fd = -1;
        check(ss_storage_get_shared_fd(handle_.get(), &fd), "ss_storage_get_shared_fd");
        return fd;
    }
    /* Moves the bytes into a managed refcounted segment (once). Before
     * sending the result, call shared_incref() (the reference in flight);
     * the receiver cancels it with shared_decref() after opening. */
    SharedFilename share_filename() const {
        char manager[108], name[64];
        std::size_t nbytes = 0;
        check(ss_storage_share_filename(handle_.get(), manager, sizeof manager, name, sizeof name, &nbytes),
              "ss_storage_share_filename");
        return SharedFilename{manager, name, nbytes};
    }
    void shared_incref() const { check(ss_storage_shared_incref(handle_.get()), "ss_storage_shared_incref"); }
    void shared_decref() const { check(ss_storage_shared_decref(handle_.get()), "ss_storage_shared_decref"); }
    std::int32_t shared_refcount() const {
        std::int32_t n = 0;
        check(ss_storage_shared_refcount(handle_.get(), &n), "ss_storage_shared_refcount");
        return n;
    }

private:
    unique_handle<ss_storage, ss_storage_free> handle_;
};

/* A weak reference (ss_weak): does not keep the bytes alive. Move-only. */
class Weak {
public:
    Weak() noexcept = default;
    explicit Weak(ss_weak *raw) noexcept : handle_(raw) {}
    ss_weak *get() const noexcept { return handle_.get(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }
    /* Whether every strong reference is gone. */
    bool expired() const noexcept { return ss_weak_expired(handle_.get()); }
    /* A new strong reference; Error SS_ERR_NOT_FOUND once expired. */
    Storage upgrade() const {
        ss_storage *raw = nullptr;
        check(ss_weak_upgrade(handle_.get(), &raw), "ss_weak_upgrade");
        return Storage(raw);
    }

private:
    unique_handle<ss_weak, ss_weak_free> handle_;
};

inline Weak Storage::weak() const {
    ss_weak *raw = nullptr;
    check(ss_storage_weak_ref(handle_.get(), &raw), "ss_storage_weak_ref");
    return Weak(raw);
}

/* ---- Descriptor passing over Unix sockets ---- */

/* An owned file descriptor, closed when destroyed. Move-only. */
class unique_fd {
public:
    unique_fd() noexcept = default;
    explicit unique_fd(int fd) noexcept : fd_(fd) {}
    unique_fd(const unique_fd &) = delete;
    unique_fd &operator=(const unique_fd &) = delete;
    unique_fd(unique_fd &&other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
    unique_fd &operator=(unique_fd &&other) noexcept {
        if (this != &other) reset(std::exchange(other.fd_, -1));
        return *this;
    }
    ~unique_fd() { reset(); }
    int get() const noexcept { return fd_; }
    int release() noexcept { return std::exchange(fd_, -1); }
    void reset(int fd = -1) noexcept {
        int old = std::exchange(fd_, fd);
        if (old >= 0) ::close(old);
    }
    explicit operator bool() const noexcept { return fd_ >= 0; }

private:
    int fd_ = -1;
};

/* Sends `len` payload bytes (at least 1) and the descriptors (they stay
 * open here) over the connected Unix socket `sock`. */
inline void send_fds(int sock, const void *payload, std::size_t len, const int *fds, std::size_t nfds) {
    check(ss_fds_send(sock, payload, len, fds, nfds), "ss_fds_send");
}
inline void send_fds(int sock, const std::string &payload, const std::vector<int> &fds = {}) {
    send_fds(sock, payload.data(), payload.size(), fds.empty() ? nullptr : fds.data(), fds.size());
}

/* One received message: its payload (empty when the peer closed) and the
 * descriptors that came with it, owned here. */
struct FdMessage {
    std::string payload;
    std::vector<unique_fd> fds;
    bool peer_closed() const noexcept { return payload.empty(); }
};

/* Receives one message of at most `max_len` bytes and `max_fds`
 * descriptors (more gives SS_ERR_BUFFER_TOO_SMALL, none left open). */
inline FdMessage recv_fds(int sock, std::size_t max_len, std::size_t max_fds) {
    std::string buf(max_len, '\0');
    std::vector<int> fds(max_fds, -1);
    std::size_t len = 0, nfds = 0;
    check(ss_fds_recv(sock, buf.empty() ? nullptr : &buf[0], buf.size(), &len, fds.empty() ? nullptr : fds.data(),
                      fds.size(), &nfds),
          "ss_fds_recv");
    FdMessage msg;
    buf.resize(len);
    msg.payload = std::move(buf);
    for (std::size_t i = 0; i < nfds; i++) msg.fds.emplace_back(fds[i]);
    return msg;
}

/* ---- The manager daemon ---- */

/* Uses the daemon binary at `path` when a manager must be started. */
inline void shm_manager_set_binary(const std::string &path) {
    check(ss_shm_manager_set_binary(c_string_arg(path, "ss_shm_manager_set_binary", "path")), "ss_shm_manager_set_binary");
}
/* Starts a manager and returns its socket path (a manager handle). */
inline std::string shm_manager_spawn() {
    char buf[108];
    check(ss_shm_manager_spawn(buf, sizeof buf), "ss_shm_manager_spawn");
    return buf;
}

/* ---- CUDA IPC ---- */

/* Whether CUDA can be used here. When false, cuda_unavailable_reason()
 * says why (read it on the same thread, right after). */
inline bool cuda_available() noexcept { return ss_cuda_available(); }
inline std::string cuda_unavailable_reason() { return ss_last_error_message(); }

struct CudaDriverInfo {
    std::int32_t version;      /* 1000 * major + 10 * minor */
    std::int32_t device_count;
};
/* Error SS_ERR_CUDA_UNAVAILABLE (with the reason) without CUDA. */
inline CudaDriverInfo cuda_driver_info() {
    CudaDriverInfo info{0, 0};
    check(ss_cuda_driver_info(&info.version, &info.device_count), "ss_cuda_driver_info");
    return info;
}

namespace detail {
/* The C frees return a status; destructors cannot report it. */
inline void free_cuda_sent(ss_cuda_sent *sent) noexcept { (void)ss_cuda_sent_free(sent, nullptr); }
inline void free_cuda_received(ss_cuda_received *received) noexcept { (void)ss_cuda_received_free(received); }
}  // namespace detail

/* The producer's record of one send (ss_cuda_sent). Destroying it is the
 * producer's release; close() does the same and reports. Move-only. */
class CudaSent {
public:
    CudaSent() noexcept = default;
    explicit CudaSent(ss_cuda_sent *raw) noexcept : handle_(raw) {}
    ss_cuda_sent *get() const noexcept { return handle_.get(); }
    ss_cuda_sent *release() noexcept { return handle_.release(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }
    /* 1 while the consumer holds the memory, 0 once it released it. */
    std::int64_t counter() const {
        std::int64_t n = 0;
        check(ss_cuda_sent_counter(handle_.get(), &n), "ss_cuda_sent_counter");
        return n;
    }
    /* Releases the send; returns whether the memory waits in limbo for
     * the consumer. A second close() does nothing and returns false. */
    bool close() {
        bool in_limbo = false;
        check(ss_cuda_sent_free(handle_.release(), &in_limbo), "ss_cuda_sent_free");
        return in_limbo;
    }

private:
    unique_handle<ss_cuda_sent, detail::free_cuda_sent> handle_;
};

/* What cuda_share gives: the tuple to send and the producer's record. */
struct CudaShare {
    ss_cuda_ipc_handle handle;
    CudaSent sent;
};

/* Shares `nbytes` at `device_ptr` (cudaMalloc memory of `device`); work
 * queued on `stream` (NULL = default) before the call is visible to the
 * consumer. `deleter(ctx, device_ptr)` runs once nobody uses the memory. */
inline CudaShare cuda_share(const void *device_ptr, std::size_t nbytes, std::int32_t device, void *stream = nullptr,
                            ss_cuda_deleter deleter = nullptr, void *deleter_ctx = nullptr) {
    CudaShare out{};
    ss_cuda_sent *raw = nullptr;
    check(ss_cuda_share(device_ptr, nbytes, device, stream, deleter, deleter_ctx, &out.handle, &raw), "ss_cuda_share");
    out.sent = CudaSent(raw);
    return out;
}

/* A storage received from another process (ss_cuda_received). Destroying
 * it is the consumer's release; close() does the same and reports (e.g.
 * SS_ERR_PEER_GONE). Move-only. */
class CudaReceived {
public:
    CudaReceived() noexcept = default;
    explicit CudaReceived(ss_cuda_received *raw) noexcept : handle_(raw) {}
    /* Maps the tuple's memory; `stream` waits for the producer's event. */
    static CudaReceived open(const ss_cuda_ipc_handle &handle, void *stream = nullptr) {
        ss_cuda_received *raw = nullptr;
        check(ss_cuda_received_open(&handle, stream, &raw), "ss_cuda_received_open");
        return CudaReceived(raw);
    }
    ss_cuda_received *get() const noexcept { return handle_.get(); }
    ss_cuda_received *release() noexcept { return handle_.release(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }
    /* Device address of the first byte (nullptr for an empty storage). */
    void *data() const noexcept { return ss_cuda_received_data(handle_.get()); }
    std::size_t size() const noexcept { return ss_cuda_received_size(handle_.get()); }
    void close() { check(ss_cuda_received_free(handle_.release()), "ss_cuda_received_free"); }

private:
    unique_handle<ss_cuda_received, detail::free_cuda_received> handle_;
};

/* Device memory from ss_cuda_alloc, freed when destroyed. Move-only. */
class CudaMemory {
public:
    CudaMemory() noexcept = default;
    static CudaMemory allocate(std::int32_t device, std::size_t nbytes) {
        void *ptr = nullptr;
        check(ss_cuda_alloc(device, nbytes, &ptr), "ss_cuda_alloc");
        return CudaMemory(device, ptr, nbytes);
    }
    CudaMemory(const CudaMemory &) = delete;
    CudaMemory &operator=(const CudaMemory &) = delete;
    CudaMemory(CudaMemory &&other) noexcept
        : device_(other.device_), ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
    CudaMemory &operator=(CudaMemory &&other) noexcept {
        if (this != &other) {
            reset();
            device_ = other.device_;
            ptr_ = std::exchange(other.ptr_, nullptr);
            size_ = std::exchange(other.size_, 0);
        }
        return *this;
    }
    ~CudaMemory() { reset(); }
    void *get() const noexcept { return ptr_; }
    std::size_t size() const noexcept { return size_; }
    std::int32_t device() const noexcept { return device_; }
    /* Gives up ownership (e.g. to a deleter passed to cuda_share). */
    void *release() noexcept {
        size_ = 0;
        return std::exchange(ptr_, nullptr);
    }
    /* Frees now and reports a failure (the destructor cannot). */
    void free() {
        void *p = release();
        if (p) check(ss_cuda_free(device_, p), "ss_cuda_free");
    }

private:
    CudaMemory(std::int32_t device, void *ptr, std::size_t size) noexcept : device_(device), ptr_(ptr), size_(size) {}
    void reset() noexcept {
        void *p = release();
        if (p) (void)ss_cuda_free(device_, p);
    }
    std::int32_t device_ = 0;
    void *ptr_ = nullptr;
    std::size_t size_ = 0;
};

/* Base and size of the allocation holding `device_ptr`. */
struct CudaAllocation {
    void *base;
    std::size_t size;
};
inline CudaAllocation cuda_pointer_base(const void *device_ptr, std::int32_t device) {
    CudaAllocation out{nullptr, 0};
    check(ss_cuda_pointer_base(device_ptr, device, &out.base, &out.size), "ss_cuda_pointer_base");
    return out;
}

/* Decrements a ref-counter slot (a consumer dropping a tuple unopened);
 * needs no GPU. */
inline void cuda_release_ipc_counter(const std::string &counter_name, std::uint64_t slot) {
    check(ss_cuda_ipc_counter_release(c_string_arg(counter_name, "ss_cuda_ipc_counter_release", "counter_name"), slot),
          "ss_cuda_ipc_counter_release");
}
/* Gives back limbo blocks no consumer uses; returns how many. */
inline std::size_t cuda_ipc_collect() {
    std::size_t freed = 0;
    check(ss_cuda_ipc_collect(&freed), "ss_cuda_ipc_collect");
    return freed;
}
inline std::size_t cuda_limbo_size() noexcept { return ss_cuda_limbo_size(); }
inline void cuda_ipc_teardown() noexcept { ss_cuda_ipc_teardown(); }

/* The tuple as one line of text, and back. */
inline std::string cuda_ipc_handle_to_text(const ss_cuda_ipc_handle &handle) {
    char buf[SS_CUDA_HANDLE_TEXT_MAX];
    check(ss_cuda_ipc_handle_to_text(&handle, buf, sizeof buf), "ss_cuda_ipc_handle_to_text");
    return buf;
}
inline ss_cuda_ipc_handle cuda_ipc_handle_from_text(const std::string &text) {
    ss_cuda_ipc_handle out{};
    check(ss_cuda_ipc_handle_from_text(c_string_arg(text, "ss_cuda_ipc_handle_from_text", "text"), &out),
          "ss_cuda_ipc_handle_from_text");
    return out;
}

/* ==== Key-value stores (ss_store): file store, TCPStore, host callbacks ==== */

/* One reference to a key-value store (c10d's "Store"), the rendezvous medium
 * of symmetric memory. Copying is explicit (ref()); the store closes with its
 * last reference. Timeouts are in milliseconds; 0, the default of get and
 * wait, waits forever. All const members may run on several threads at once,
 * each caller gets its own answer, and one thread's calls take effect in the
 * order it made them. A key is any bytes but NUL (UTF-8 or not); a key with
 * a NUL byte is refused with Error SS_ERR_INVALID_ARGUMENT. */
class Store {
public:
    Store() noexcept = default;
    /* Takes ownership of a handle from the C API. */
    explicit Store(ss_store *raw) noexcept : handle_(raw) {}

    /* The store in folder `path` (created if missing), shared by the
     * processes of one host; use a fresh folder per job. */
    static Store open_file(const std::string &path) {
        ss_store *raw = nullptr;
        check(ss_store_file_open(c_string_arg(path, "ss_store_file_open", "path"), &raw), "ss_store_file_open");
        return Store(raw);
    }
    /* The file `path` in PyTorch's FileStore format, shared with
     * torch.distributed.FileStore(path, world_size) ranks both ways; the last
     * of world_size stores to close removes it (-1: never). */
    static Store open_torch_file(const std::string &path, int world_size, int64_t timeout_ms) {
        ss_store *raw = nullptr;
        const char *c_path = c_string_arg(path, "ss_store_torch_file_open", "path");
        check(ss_store_torch_file_open(c_path, world_size, timeout_ms, &raw), "ss_store_torch_file_open");
        return Store(raw);
    }
    /* Joins (or with is_master serves) a PyTorch c10d TCPStore at host:port,
     * as torch.distributed.TCPStore(host, port, world_size, is_master,
     * timeout). Port 0 with is_master picks a free port (tcp_port()). */
    static Store open_tcp(const std::string &host, int port, bool is_master, int world_size, int64_t timeout_ms) {
        ss_store *raw = nullptr;
        const char *c_host = c_string_arg(host, "ss_store_tcp_open", "host");
        check(ss_store_tcp_open(c_host, port, is_master, world_size, timeout_ms, &raw), "ss_store_tcp_open");
        return Store(raw);
    }
    /* A store calling the host's functions with ctx (see ss_store_callbacks). */
    static Store from_callbacks(const ss_store_callbacks &cb, void *ctx) {
        ss_store *raw = nullptr;
        check(ss_store_callbacks_open(&cb, ctx, &raw), "ss_store_callbacks_open");
        return Store(raw);
    }
    /* A store backed by a C++ object the library then owns, e.g. an adapter
     * over a framework's own c10d store. T provides
     *   void set(const std::string &key, const std::vector<uint8_t> &value);
     *   std::vector<uint8_t> get(const std::string &key, int64_t timeout_ms);
     *   int64_t add(const std::string &key, int64_t delta);
     *   void wait(const std::vector<std::string> &keys, int64_t timeout_ms);
     * and may be called from several threads at once. To report a timeout,
     * throw storage_sharing::Error with SS_ERR_TIMEOUT; an Error's status is
     * passed on, any other exception becomes SS_ERR_IO. */
    template <class T>
    static Store adopt(std::unique_ptr<T> object) {
        static const ss_store_callbacks table = {sizeof(ss_store_callbacks), &adopted<T>::set, &adopted<T>::get,
                                                 &adopted<T>::add, &adopted<T>::wait, &adopted<T>::free_ctx};
        Store s = from_callbacks(table, object.get());
        object.release();  // owned by the store now; free_ctx deletes it
        return s;
    }

    /* A second reference to the same store. */
    Store ref() const {
        ss_store *raw = nullptr;
        check(ss_store_ref(handle_.get(), &raw), "ss_store_ref");
        return Store(raw);
    }
    /* The port of a TCPStore (SS_ERR_UNSUPPORTED for other stores). */
    int tcp_port() const {
        int port = 0;
        check(ss_store_tcp_port(handle_.get(), &port), "ss_store_tcp_port");
        return port;
    }

    void set(const std::string &key, const void *data, std::size_t len) const {
        check(ss_store_set(handle_.get(), c_string_arg(key, "ss_store_set", "key"), data, len), "ss_store_set");
    }
    void set(const std::string &key, const std::string &value) const { set(key, value.data(), value.size()); }
    void set(const std::string &key, const std::vector<uint8_t> &value) const { set(key, value.data(), value.size()); }

    /* The value of key, waiting until it is set (Error with SS_ERR_TIMEOUT,
     * naming the key, when timeout_ms passes first; 0, the default, waits
     * forever). */
    std::vector<uint8_t> get(const std::string &key, int64_t timeout_ms = 0) const {
        const char *c_key = c_string_arg(key, "ss_store_get", "key");
        return read_value(256, "ss_store_get", [&](void *buf, std::size_t size, std::size_t *len) {
            return ss_store_get(handle_.get(), c_key, timeout_ms, buf, size, len);
        });
    }
    std::string get_string(const std::string &key, int64_t timeout_ms = 0) const {
        std::vector<uint8_t> v = get(key, timeout_ms);
        return std::string(v.begin(), v.end());
    }

    /* Adds delta to the integer under key (missing = 0); the new value.
     * Wraps in two's complement past either end (INT64_MAX + 1 is
     * INT64_MIN), as PyTorch's TCPStore servers do. */
    int64_t add(const std::string &key, int64_t delta) const {
        int64_t out = 0;
        check(ss_store_add(handle_.get(), c_string_arg(key, "ss_store_add", "key"), delta, &out), "ss_store_add");
        return out;
    }

    /* Waits until every key is set (SS_ERR_TIMEOUT names the missing ones;
     * timeout_ms 0, the default, waits forever). */
    void wait(const std::vector<std::string> &keys, int64_t timeout_ms = 0) const {
        std::vector<const char *> ptrs = key_ptrs(keys, "ss_store_wait");
        check(ss_store_wait(handle_.get(), ptrs.data(), ptrs.size(), timeout_ms), "ss_store_wait");
    }

    /* Whether every key is set now (no waiting). */
    bool check_keys(const std::vector<std::string> &keys) const {
        std::vector<const char *> ptrs = key_ptrs(keys, "ss_store_check");
        bool all = false;
        check(ss_store_check(handle_.get(), ptrs.data(), ptrs.size(), &all), "ss_store_check");
        return all;
    }

    /* c10d's compare-and-set: desired after a swap, else the current value
     * (expected when the key is missing). */
    std::vector<uint8_t> compare_set(const std::string &key, const std::string &expected, const std::string &desired) const {
        // A retry after a longer current value does not swap a second time.
        const std::size_t size = expected.size() > desired.size() ? expected.size() : desired.size();
        const char *c_key = c_string_arg(key, "ss_store_compare_set", "key");
        return read_value(size, "ss_store_compare_set", [&](void *buf, std::size_t buf_len, std::size_t *len) {
            return ss_store_compare_set(handle_.get(), c_key, expected.data(), expected.size(), desired.data(),
                                        desired.size(), buf, buf_len, len);
        });
    }

    /* Deletes key; whether it was set. */
    bool delete_key(const std::string &key) const {
        bool existed = false;
        const char *c_key = c_string_arg(key, "ss_store_delete_key", "key");
        check(ss_store_delete_key(handle_.get(), c_key, &existed), "ss_store_delete_key");
        return existed;
    }

    /* How many keys are set (a TCPStore counts init/ too). */
    int64_t num_keys() const {
        int64_t n = 0;
        check(ss_store_num_keys(handle_.get(), &n), "ss_store_num_keys");
        return n;
    }

    ss_store *get() const noexcept { return handle_.get(); }
    ss_store *release() noexcept { return handle_.release(); }
    void close() noexcept { handle_.reset(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }

private:
    /* The keys as C strings; one with a NUL byte is refused (naming it). */
    static std::vector<const char *> key_ptrs(const std::vector<std::string> &keys, const char *function) {
        std::vector<const char *> ptrs;
        ptrs.reserve(keys.size());
        for (std::size_t i = 0; i < keys.size(); i++) {
            ptrs.push_back(c_string_arg(keys[i], function, ("keys[" + std::to_string(i) + "]").c_str()));
        }
        return ptrs;
    }

    /* Runs call(buf, size, &len) with a buffer of `size` bytes, and again
     * with a larger one while it answers SS_ERR_BUFFER_TOO_SMALL with a
     * longer length; the bytes written. */
    template <typename Call>
    static std::vector<uint8_t> read_value(std::size_t size, const char *what, Call call) {
        std::vector<uint8_t> buf(size);
        for (;;) {
            std::size_t len = 0;
            ss_status st = call(buf.data(), buf.size(), &len);
            if (st == SS_ERR_BUFFER_TOO_SMALL && len > buf.size()) {
                buf.resize(len);  // longer than our buffer: ask again
                continue;
            }
            check(st, what);
            buf.resize(len);
            return buf;
        }
    }

    template <class T>
    struct adopted {
        /* Runs f, turning exceptions into status codes: nothing may unwind
         * into the library. */
        template <class F>
        static int guard(F &&f) noexcept {
            try {
                return f();
            } catch (const Error &e) {
                return static_cast<int>(e.status());
            } catch (...) {
                return static_cast<int>(SS_ERR_IO);
            }
        }
        static int set(void *ctx, const char *key, const void *value, std::size_t len) {
            return guard([&] {
                const uint8_t *p = static_cast<const uint8_t *>(value);
                static_cast<T *>(ctx)->set(key, std::vector<uint8_t>(p, p + len));
                return static_cast<int>(SS_OK);
            });
        }
        static int get(void *ctx, const char *key, int64_t timeout_ms, void *buf, std::size_t buf_len,
                       std::size_t *out_len) {
            return guard([&] {
                std::vector<uint8_t> v = static_cast<T *>(ctx)->get(key, timeout_ms);
                *out_len = v.size();
                if (v.size() > buf_len) return static_cast<int>(SS_ERR_BUFFER_TOO_SMALL);
                if (!v.empty()) std::memcpy(buf, v.data(), v.size());
                return static_cast<int>(SS_OK);
            });
        }
        static int add(void *ctx, const char *key, int64_t delta, int64_t *out_value) {
            return guard([&] {
                *out_value = static_cast<T *>(ctx)->add(key, delta);
                return static_cast<int>(SS_OK);
            });
        }
        static int wait(void *ctx, const char *const *keys, std::size_t nkeys, int64_t timeout_ms) {
            return guard([&] {
                static_cast<T *>(ctx)->wait(std::vector<std::string>(keys, keys + nkeys), timeout_ms);
                return static_cast<int>(SS_OK);
            });
        }
        static void free_ctx(void *ctx) { delete static_cast<T *>(ctx); }
    };

    unique_handle<ss_store, ss_store_free> handle_;
};


/* ---- symmetric memory (ss_symm_*) ----------------------------------------
 * Every rank of a group allocates a block of the same size; after
 * rendezvous each rank reaches every peer's buffer and signal pad. */

/* Registers `group`: this process is `rank` of `world_size`, meeting the
 * others through `store` (borrowed; the group takes its own reference). */
inline void symm_set_group_info(const std::string &group, int rank, int world_size, const ss_store *store) {
    const char *c_group = c_string_arg(group, "ss_symm_set_group_info", "group");
    check(ss_symm_set_group_info(c_group, rank, world_size, store), "ss_symm_set_group_info");
}
/* The same with the file store in folder `store_dir` (one host). */
inline void symm_set_group_info_file(const std::string &group, int rank, int world_size, const std::string &store_dir) {
    // Both names are checked before the store folder is made.
    c_string_arg(group, "ss_symm_set_group_info", "group");
    ss_store *raw = nullptr;
    check(ss_store_file_open(c_string_arg(store_dir, "ss_store_file_open", "store_dir"), &raw), "ss_store_file_open");
    unique_handle<ss_store, ss_store_free> store(raw);
    symm_set_group_info(group, rank, world_size, store.get());
}

struct SymmGroupInfo {
    int rank;
    int world_size;
};
inline SymmGroupInfo symm_get_group_info(const std::string &group) {
    SymmGroupInfo out{0, 0};
    const char *c_group = c_string_arg(group, "ss_symm_get_group_info", "group");
    check(ss_symm_get_group_info(c_group, &out.rank, &out.world_size), "ss_symm_get_group_info");
    return out;
}
/* Chooses the backend by name, before the first allocation. */
inline void symm_set_backend(const std::string &name) {
    check(ss_symm_set_backend(c_string_arg(name, "ss_symm_set_backend", "name")), "ss_symm_set_backend");
}
/* The signal pad size of the blocks allocated from now on (default 9216). */
inline size_t symm_get_signal_pad_size() {
    size_t n = 0;
    check(ss_symm_get_signal_pad_size(&n), "ss_symm_get_signal_pad_size");
    return n;
}
/* Sets it: a positive multiple of 4, before the process's first allocation. */
inline void symm_set_signal_pad_size(size_t size) { check(ss_symm_set_signal_pad_size(size), "ss_symm_set_signal_pad_size"); }

/* A rendezvoused block (not owned: valid until its SymmBlock is freed).
 * timeout_ms 0 waits forever; stream is a CUDA stream (ignored on CPU). */
class SymmMem {
public:
    explicit SymmMem(const ss_symm_mem *handle) noexcept : h_(handle) {}
    const ss_symm_mem *get() const noexcept { return h_; }
    int rank() const noexcept { return ss_symm_mem_rank(h_); }
    int world_size() const noexcept { return ss_symm_mem_world_size(h_); }
    std::size_t buffer_size() const noexcept { return ss_symm_mem_buffer_size(h_); }
    std::size_t signal_pad_size() const noexcept { return ss_symm_mem_signal_pad_size(h_); }
    void *buffer_ptr(int rank) const {
        void *p = nullptr;
        check(ss_symm_mem_buffer_ptr(h_, rank, &p), "ss_symm_mem_buffer_ptr");
        return p;
    }
    std::uint32_t *signal_pad_ptr(int rank) const {
        void *p = nullptr;
        check(ss_symm_mem_signal_pad_ptr(h_, rank, &p), "ss_symm_mem_signal_pad_ptr");
        return static_cast<std::uint32_t *>(p);
    }
    void *get_buffer(int rank, std::size_t nbytes, std::size_t offset = 0) const {
        void *p = nullptr;
        check(ss_symm_mem_get_buffer(h_, rank, nbytes, offset, &p), "ss_symm_mem_get_buffer");
        return p;
    }
    /* Device-readable arrays of world_size pointers (CUDA: device memory,
     * CPU: host memory), owned by the object. */
    void *const *buffer_ptrs_dev() const {
        void *p = nullptr;
        check(ss_symm_mem_buffer_ptrs_dev(h_, &p), "ss_symm_mem_buffer_ptrs_dev");
        return static_cast<void *const *>(p);
    }
    void *const *signal_pad_ptrs_dev() const {
        void *p = nullptr;
        check(ss_symm_mem_signal_pad_ptrs_dev(h_, &p), "ss_symm_mem_signal_pad_ptrs_dev");
        return static_cast<void *const *>(p);
    }
    bool has_multicast() const noexcept { return ss_symm_mem_has_multicast(h_); }
    /* Throws (SS_ERR_UNSUPPORTED, with the reason) where there is none. */
    void *multicast_ptr() const {
        void *p = nullptr;
        check(ss_symm_mem_multicast_ptr(h_, &p), "ss_symm_mem_multicast_ptr");
        return p;
    }
    void barrier(int channel = 0, std::int64_t timeout_ms = 0, void *stream = nullptr) const {
        check(ss_symm_mem_barrier(h_, channel, timeout_ms, stream), "ss_symm_mem_barrier");
    }
    void put_signal(int dst_rank, int channel = 0, std::int64_t timeout_ms = 0, void *stream = nullptr) const {
        check(ss_symm_mem_put_signal(h_, dst_rank, channel, timeout_ms, stream), "ss_symm_mem_put_signal");
    }
    void wait_signal(int src_rank, int channel = 0, std::int64_t timeout_ms = 0, void *stream = nullptr) const {
        check(ss_symm_mem_wait_signal(h_, src_rank, channel, timeout_ms, stream), "ss_symm_mem_wait_signal");
    }

private:
    const ss_symm_mem *h_;
};

/* One rank's symmetric block; frees it (ss_symm_free) when destroyed.
 * Move-only. group "" means none. */
class SymmBlock {
public:
    static SymmBlock alloc(std::size_t size, const std::string &group = "", int device_type = SS_DEVICE_CPU,
                           int device_idx = 0) {
        void *p = nullptr;
        const char *c_group = group.empty() ? nullptr : c_string_arg(group, "ss_symm_alloc", "group");
        check(ss_symm_alloc(device_type, device_idx, size, c_group, &p), "ss_symm_alloc");
        return SymmBlock(p);
    }
    /* The persistent block alloc_id (the same block once the previous use
     * was freed). */
    static SymmBlock alloc_persistent(std::size_t size, std::uint64_t alloc_id, const std::string &group = "",
                                      int device_type = SS_DEVICE_CPU, int device_idx = 0) {
        void *p = nullptr;
        const char *c_group = group.empty() ? nullptr : c_string_arg(group, "ss_symm_alloc_persistent", "group");
        check(ss_symm_alloc_persistent(device_type, device_idx, size, c_group, alloc_id, &p),
              "ss_symm_alloc_persistent");
        return SymmBlock(p);
    }
    SymmBlock(const SymmBlock &) = delete;
    SymmBlock &operator=(const SymmBlock &) = delete;
    SymmBlock(SymmBlock &&other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
    SymmBlock &operator=(SymmBlock &&other) noexcept {
        if (this != &other) {
            reset();
            ptr_ = std::exchange(other.ptr_, nullptr);
        }
        return *this;
    }
    ~SymmBlock() { reset(); }

    void *data() const noexcept { return ptr_; }
    std::size_t size() const {
        std::size_t n = 0;
        check(ss_symm_get_alloc_size(ptr_, &n), "ss_symm_get_alloc_size");
        return n;
    }
    /* Meets the other ranks of `group` ("" for the allocation's group). */
    SymmMem rendezvous(const std::string &group = "", std::int64_t timeout_ms = 0) const {
        const ss_symm_mem *h = nullptr;
        const char *c_group = group.empty() ? nullptr : c_string_arg(group, "ss_symm_mem_rendezvous", "group");
        check(ss_symm_mem_rendezvous(ptr_, c_group, timeout_ms, &h), "ss_symm_mem_rendezvous");
        return SymmMem(h);
    }
    /* Frees now, reporting errors (the destructor ignores them). */
    void free() {
        void *p = std::exchange(ptr_, nullptr);
        if (p) check(ss_symm_free(p), "ss_symm_free");
    }

private:
    explicit SymmBlock(void *ptr) noexcept : ptr_(ptr) {}
    void reset() noexcept {
        void *p = std::exchange(ptr_, nullptr);
        if (p) (void)ss_symm_free(p);
    }
    void *ptr_ = nullptr;
};

/* ---- end symmetric memory ------------------------------------------------ */

/* ---- Shareable CPU arena (ss_arena) ---- */

/* Options with the library's defaults (64 MiB segments by fd, 4096 holds
 * per segment, blocks above 1 MiB in a segment of their own). */
inline ss_arena_options arena_options_default() {
    ss_arena_options o{};
    check(ss_arena_options_default(&o), "ss_arena_options_default");
    return o;
}

/* A consumer's view of a block another process shared: holds the block
 * until destroyed (the producer will not reuse it). Move-only. */
class ArenaView {
public:
    ArenaView() noexcept = default;
    explicit ArenaView(ss_arena_view *raw) noexcept : handle_(raw) {}
    /* Opens a shared block (once per handle). By fd, import the segment
     * first (import_segment_fd) unless it came with Arena::send. */
    static ArenaView open(const ss_arena_handle &h) {
        ss_arena_view *raw = nullptr;
        check(ss_arena_view_open(&h, &raw), "ss_arena_view_open");
        return ArenaView(raw);
    }
    /* Receives a block sent with Arena::send over `sock`, and opens it. */
    static ArenaView recv(int sock) {
        ss_arena_view *raw = nullptr;
        check(ss_arena_recv(sock, &raw), "ss_arena_recv");
        return ArenaView(raw);
    }
    /* Maps a by-fd segment from `fd` (taken over on success). */
    static void import_segment_fd(const ss_arena_handle &h, int fd) {
        check(ss_arena_import_segment_fd(&h, fd), "ss_arena_import_segment_fd");
    }
    ss_arena_view *get() const noexcept { return handle_.get(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }
    void *data() const noexcept { return ss_arena_view_data(handle_.get()); }
    template <class U>
    U *data_as() const noexcept { return static_cast<U *>(data()); }
    std::size_t size() const noexcept { return ss_arena_view_size(handle_.get()); }

private:
    unique_handle<ss_arena_view, ss_arena_view_free> handle_;
};

/* A producer's shareable arena: blocks born in shared memory, shared in
 * O(1). Const members may run on several threads. Move-only. */
class Arena {
public:
    Arena() noexcept = default;
    explicit Arena(ss_arena *raw) noexcept : handle_(raw) {}
    static Arena open(const ss_arena_options &options = arena_options_default()) {
        ss_arena *raw = nullptr;
        check(ss_arena_open(&options, &raw), "ss_arena_open");
        return Arena(raw);
    }
    ss_arena *get() const noexcept { return handle_.get(); }
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }
    void *alloc(std::size_t size, std::size_t align = 64) const {
        void *p = nullptr;
        check(ss_arena_alloc(handle_.get(), size, align, &p), "ss_arena_alloc");
        return p;
    }
    void free(void *p) const { check(ss_arena_dealloc(handle_.get(), p), "ss_arena_dealloc"); }
    ss_arena_handle share(void *p) const {
        ss_arena_handle h{};
        check(ss_arena_share(handle_.get(), p, &h), "ss_arena_share");
        return h;
    }
    void unshare(const ss_arena_handle &h) const { check(ss_arena_unshare(handle_.get(), &h), "ss_arena_unshare"); }
    /* The segment's descriptor (owned by the arena; by-fd arenas). */
    int segment_fd(std::uint64_t segment_id) const {
        int fd = -1;
        check(ss_arena_segment_fd(handle_.get(), segment_id, &fd), "ss_arena_segment_fd");
        return fd;
    }
    /* Shares `p` and sends it over the Unix socket (fd once per segment per peer). */
    void send(int sock, void *p) const { check(ss_arena_send(handle_.get(), sock, p), "ss_arena_send"); }
    struct Collected {
        std::size_t reclaimed_holds;
        std::size_t recycled_blocks;
    };
    /* Reclaims dead consumers' holds; reuses blocks nobody holds. */
    Collected collect() const {
        Collected c{0, 0};
        check(ss_arena_collect(handle_.get(), &c.reclaimed_holds, &c.recycled_blocks), "ss_arena_collect");
        return c;
    }
    ss_arena_stats stats() const {
        ss_arena_stats s{};
        check(ss_arena_stats_get(handle_.get(), &s), "ss_arena_stats_get");
        return s;
    }
    /* A storage of `nbytes` in a new block of this arena. */
    Storage new_storage(std::size_t nbytes) const {
        ss_storage *raw = nullptr;
        check(ss_storage_new_in_arena(handle_.get(), nbytes, &raw), "ss_storage_new_in_arena");
        return Storage(raw);
    }

private:
    unique_handle<ss_arena, ss_arena_close> handle_;
};

/* ---- end shareable CPU arena ---- */

/* ======================= Content store (ss_content_*) ======================= */

/* The hex digest of `nbytes` bytes: SS_HASH_FAST or SS_HASH_STABLE (SHA-1). */
inline std::string hash_bytes(const void *data, std::size_t nbytes, int mode = SS_HASH_FAST) {
    char buf[SS_HASH_HEX_MAX];
    check(ss_content_hash_bytes(data, nbytes, mode, buf, sizeof buf), "ss_content_hash_bytes");
    return buf;
}

/* What a content writer did so far. */
struct ContentCounts {
    std::uint64_t storages_written = 0;
    std::uint64_t storages_deduplicated = 0;
    std::uint64_t tensors_written = 0;
};

/* A writer of a content store; an existing store is added to. */
class ContentWriter {
public:
    ContentWriter(const std::string &path, int format = SS_CONTENT_FORMAT_NATIVE) {
        ss_content_writer *raw = nullptr;
        const char *c_path = c_string_arg(path, "ss_content_writer_open", "path");
        check(ss_content_writer_open(c_path, format, &raw), "ss_content_writer_open");
        h_.reset(raw);
    }
    /* Stores the bytes once per distinct content; returns the hash. */
    std::string write_storage(const void *data, std::size_t nbytes) const {
        char buf[SS_HASH_HEX_MAX];
        check(ss_content_writer_write_storage(h_.get(), data, nbytes, buf, sizeof buf), "ss_content_writer_write_storage");
        return buf;
    }
    /* Stores the bytes and an entry `name` viewing them (elements, PyTorch's order). */
    void write_tensor(const std::string &name, const void *data, std::size_t nbytes, int dtype, std::int64_t offset,
                      const std::vector<std::int64_t> &shape, const std::vector<std::int64_t> &stride) const {
        if (shape.size() != stride.size())
            throw Error(SS_ERR_INVALID_ARGUMENT, "ss_content_writer_write_tensor", "shape and stride lengths differ");
        const char *c_name = c_string_arg(name, "ss_content_writer_write_tensor", "name");
        check(ss_content_writer_write_tensor(h_.get(), c_name, data, nbytes, dtype, offset, shape.size(), shape.data(),
                                      stride.data()),
              "ss_content_writer_write_tensor");
    }
    /* fsync around each rename (default on; PyTorch never fsyncs). */
    void set_durable(bool on) const { check(ss_content_writer_set_durable(h_.get(), on), "ss_content_writer_set_durable"); }
    ContentCounts counts() const {
        ContentCounts c;
        check(ss_content_writer_counts(h_.get(), &c.storages_written, &c.storages_deduplicated, &c.tensors_written),
              "ss_content_writer_counts");
        return c;
    }
    ss_content_writer *get() const noexcept { return h_.get(); }

private:
    unique_handle<ss_content_writer, ss_content_writer_free> h_;
};

/* A tensor read from a store: its view, and its storage mapped read-only. */
class ContentTensor {
public:
    explicit ContentTensor(ss_content_tensor *raw) noexcept : h_(raw) {}
    int dtype() const noexcept { return ss_content_tensor_dtype(h_.get()); }
    std::int64_t offset() const noexcept { return ss_content_tensor_offset(h_.get()); }
    std::vector<std::int64_t> shape() const { return dims(ss_content_tensor_shape(h_.get())); }
    std::vector<std::int64_t> stride() const { return dims(ss_content_tensor_stride(h_.get())); }
    const void *data() const noexcept { return ss_content_tensor_data(h_.get()); }
    std::size_t nbytes() const noexcept { return ss_content_tensor_nbytes(h_.get()); }
    std::string storage_hash() const { return ss_content_tensor_storage_hash(h_.get()); }
    ss_content_tensor *get() const noexcept { return h_.get(); }

private:
    std::vector<std::int64_t> dims(const std::int64_t *p) const {
        std::size_t n = ss_content_tensor_ndim(h_.get());
        return p ? std::vector<std::int64_t>(p, p + n) : std::vector<std::int64_t>();
    }
    unique_handle<ss_content_tensor, ss_content_tensor_free> h_;
};

/* A storage read from a store, mapped read-only. */
class ContentStorage {
public:
    explicit ContentStorage(ss_content_storage *raw) noexcept : h_(raw) {}
    const void *data() const noexcept { return ss_content_storage_data(h_.get()); }
    std::size_t nbytes() const noexcept { return ss_content_storage_nbytes(h_.get()); }

private:
    unique_handle<ss_content_storage, ss_content_storage_free> h_;
};

/* A reader of a content store, ours or PyTorch's (format detected). */
class ContentReader {
public:
    explicit ContentReader(const std::string &path) {
        ss_content_reader *raw = nullptr;
        const char *c_path = c_string_arg(path, "ss_content_reader_open", "path");
        check(ss_content_reader_open(c_path, &raw), "ss_content_reader_open");
        h_.reset(raw);
    }
    int format() const noexcept { return ss_content_reader_format(h_.get()); }
    void set_verify(bool on) const { check(ss_content_reader_set_verify(h_.get(), on), "ss_content_reader_set_verify"); }
    ContentTensor read_tensor(const std::string &name) const {
        ss_content_tensor *raw = nullptr;
        const char *c_name = c_string_arg(name, "ss_content_reader_read_tensor", "name");
        check(ss_content_reader_read_tensor(h_.get(), c_name, &raw), "ss_content_reader_read_tensor");
        return ContentTensor(raw);
    }
    ContentStorage read_storage(const std::string &hash) const {
        ss_content_storage *raw = nullptr;
        const char *c_hash = c_string_arg(hash, "ss_content_reader_read_storage", "hash");
        check(ss_content_reader_read_storage(h_.get(), c_hash, &raw), "ss_content_reader_read_storage");
        return ContentStorage(raw);
    }
    std::vector<std::string> list_tensors() const {
        ss_content_list *raw = nullptr;
        check(ss_content_reader_list_tensors(h_.get(), &raw), "ss_content_reader_list_tensors");
        return take(raw);
    }
    std::vector<std::string> list_storages() const {
        ss_content_list *raw = nullptr;
        check(ss_content_reader_list_storages(h_.get(), &raw), "ss_content_reader_list_storages");
        return take(raw);
    }
    /* One "object: why" line per corrupt object; empty when all is well. */
    std::vector<std::string> verify(std::uint64_t *checked = nullptr) const {
        ss_content_list *raw = nullptr;
        check(ss_content_reader_verify(h_.get(), checked, &raw), "ss_content_reader_verify");
        return take(raw);
    }
    ss_content_reader *get() const noexcept { return h_.get(); }

private:
    static std::vector<std::string> take(ss_content_list *raw) {
        unique_handle<ss_content_list, ss_content_list_free> list(raw);
        std::vector<std::string> out;
        for (std::size_t i = 0, n = ss_content_list_len(raw); i < n; i++) out.emplace_back(ss_content_list_get(raw, i));
        return out;
    }
    unique_handle<ss_content_reader, ss_content_reader_free> h_;
};


}  // namespace storage_sharing

#endif /* STORAGE_SHARING_HPP */
