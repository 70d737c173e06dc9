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

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

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

/* The library's run-time version ("MAJOR.MINOR.PATCH"); SS_VERSION_STRING is
 * the version this header came with. */
inline std::string version() { return ss_version(); }

/* A fresh process-wide segment name, "/torch_<pid>_<rand>_<n>". */
inline std::string new_process_wide_shm_handle() {
    char buf[64];
    check(ss_new_process_wide_shm_handle(buf, sizeof buf), "ss_new_process_wide_shm_handle");
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
    static MapView from_data(const void *ptr) noexcept { return MapView(ss_map_from_data(ptr)); }

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
        check(ss_map_open(name.c_str(), flags, size, &raw), "ss_map_open");
        return Map(raw);
    }
    /* MapAllocator(WITH_FD, name, fd, flags, size): on success the map owns
     * `fd`; on failure (an exception) the caller still does. */
    static Map open_fd(int fd, int flags, std::size_t size, const std::string &name = "") {
        ss_map *raw = nullptr;
        check(ss_map_open_fd(name.c_str(), fd, flags, size, &raw), "ss_map_open_fd");
        return Map(raw);
    }
    /* RefcountedMapAllocator(name, flags, size). */
    static Map open_refcounted(const std::string &name, int flags, std::size_t size) {
        ss_map *raw = nullptr;
        check(ss_refcounted_map_open(name.c_str(), flags, size, &raw), "ss_refcounted_map_open");
        return Map(raw);
    }
    /* An anonymous fd-backed segment of `size` zero bytes. */
    static Map new_fd_storage(std::size_t size) {
        ss_map *raw = nullptr;
        check(ss_new_shm_fd_storage(size, &raw), "ss_new_shm_fd_storage");
        return Map(raw);
    }
    /* share_memory_(): a copy of `nbytes` at `src` in a new fd-backed segment. */
    static Map share_memory(const void *src, std::size_t nbytes) {
        ss_map *raw = nullptr;
        check(ss_share_memory(src, nbytes, &raw), "ss_share_memory");
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

}  // namespace storage_sharing

#endif /* STORAGE_SHARING_HPP */
