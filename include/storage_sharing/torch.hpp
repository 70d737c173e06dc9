/* storage-sharing for libtorch programs: c10::Storage and at::Tensor over
 * the C API, in place of the sharing layer PyTorch keeps in its Python
 * bindings. Header-only, C++17; include it only in code that links
 * libtorch (nothing else in the library needs it).
 *
 *   - SharedAllocator: a c10::Allocator whose storages are born in shared
 *     memory with ATen's MapAllocator flags (86 by fd, 6 by name), so
 *     at::empty(...) under ScopedCpuAllocator, or empty_shared(...), is
 *     shareable without a copy.
 *   - share_filename / share_fd: the values _share_filename_cpu_() and
 *     _share_fd_cpu_() return; open_shared_filename / open_shared_fd: what
 *     _new_shared_filename_cpu / _new_shared_fd_cpu make of them. Opened
 *     storages release their reference from the DataPtr's deleter, so
 *     c10's strong and weak references decide when, as in PyTorch.
 *   - ArenaAllocator: tensors over blocks of a shareable arena, shared in
 *     O(1) as a plain ArenaTensorHandle.
 *   - share_cuda / open_cuda: the 8-value _share_cuda_() tuple.
 *   - Weights: a whole weights pool (ss_cuda_weights) opened once, as
 *     name -> at::Tensor views (CUDA for a CUDA pool, CPU for the host
 *     backend), with a reader guard around each use of a version.
 *
 * What another process sends (names, sizes, views, arena handles) is
 * checked before use: a view must fit its storage, as set_ demands.
 * Storages in shared memory are not resizable, so their bytes stay where
 * receivers mapped them.
 *
 * Errors throw storage_sharing::Error (status and the library's message).
 * Thread safety is c10's: sharing a storage may swap its DataPtr (as
 * PyTorch does), so no other thread may use that storage meanwhile. */
#ifndef STORAGE_SHARING_TORCH_HPP
#define STORAGE_SHARING_TORCH_HPP

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../storage_sharing.hpp"

namespace storage_sharing {
namespace libtorch {

/* How a storage is put in shared memory. */
enum class Strategy {
    /* A nameless segment kept by its descriptor (ATen flags 86, the
     * "file_descriptor" strategy); shared with share_fd. */
    FileDescriptor,
    /* A named refcounted segment registered with the manager daemon
     * (ATen flags 6, "file_system"); shared with share_filename. */
    FileSystem,
};

namespace detail {

/* The deleter of every DataPtr whose context is one of our ss_storage
 * references: dropping the last c10 reference drops ours. */
inline void free_storage_ctx(void *ctx) noexcept { ss_storage_free(static_cast<ss_storage *>(ctx)); }

inline c10::DataPtr storage_data_ptr(Storage &&storage) {
    void *data = storage.data();
    return c10::DataPtr(data, storage.release(), &free_storage_ctx, c10::Device(c10::DeviceType::CPU));
}

/* Our reference behind a c10 storage, or nullptr when its bytes are not ours. */
inline ss_storage *storage_ctx(const c10::Storage &storage) noexcept {
    const c10::DataPtr &dp = storage.data_ptr();
    if (dp.get_deleter() != &free_storage_ctx) return nullptr;
    return static_cast<ss_storage *>(dp.get_context());
}

inline bool is_fd_backed(const ss_storage *s) noexcept {
    int fd = -1;
    return s && ss_storage_get_shared_fd(s, &fd) == SS_OK;
}
inline bool is_managed(const ss_storage *s) noexcept {
    std::int32_t n = 0;
    return s && ss_storage_shared_refcount(s, &n) == SS_OK;
}

inline void require_cpu(const c10::Storage &storage, const char *function) {
    if (!storage) throw Error(SS_ERR_NULL_POINTER, function, "the storage is undefined");
    if (storage.device_type() != c10::DeviceType::CPU) {
        throw Error(SS_ERR_INVALID_ARGUMENT, function,
                    std::string("only available on CPU storages (this one is on ") + storage.device().str() + ")");
    }
}

/* Bytes in shared memory must stay where receivers mapped them: resize_
 * would move them to a new segment, so such storages refuse it (as
 * PyTorch's storages opened from shared memory do). */
inline void forbid_resize(const c10::Storage &storage) noexcept {
    if (storage) storage.unsafeGetStorageImpl()->set_resizable(false);
}

/* `code` as a dtype a plain CPU or CUDA tensor can have; it may come from
 * another process, so anything else is refused here rather than left to
 * c10's internal asserts. */
inline c10::ScalarType checked_dtype(std::int64_t code, const char *function) {
    constexpr auto undefined = static_cast<std::int64_t>(c10::ScalarType::Undefined);
    if (code < 0 || code >= undefined) {
        throw Error(SS_ERR_INVALID_ARGUMENT, function,
                    "dtype " + std::to_string(code) + " is not a c10::ScalarType (0 to " + std::to_string(undefined - 1) +
                        ")");
    }
    auto dtype = static_cast<c10::ScalarType>(code);
    if (c10::isQIntType(dtype)) {
        throw Error(SS_ERR_INVALID_ARGUMENT, function,
                    std::string("dtype ") + c10::toString(dtype) + " is quantized: a plain tensor cannot have it");
    }
    return dtype;
}

/* The bytes a view reaches: one past its last element, as at::Tensor::set_
 * counts them (0 when it has no elements). Sizes, strides and the offset
 * may come from another process: negative values and any overflow are
 * refused. */
inline std::uint64_t view_nbytes(std::size_t itemsize, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                 std::int64_t storage_offset, const char *function) {
    auto bad = [function](const std::string &why) { return Error(SS_ERR_INVALID_ARGUMENT, function, why); };
    if (sizes.size() != strides.size()) {
        throw bad("sizes has " + std::to_string(sizes.size()) + " entries, strides " + std::to_string(strides.size()));
    }
    if (storage_offset < 0) throw bad("storage offset " + std::to_string(storage_offset) + " is negative");
    bool empty = false;
    for (std::size_t i = 0; i < sizes.size(); i++) {
        if (sizes[i] < 0) throw bad("size " + std::to_string(sizes[i]) + " of dimension " + std::to_string(i) + " is negative");
        if (strides[i] < 0) {
            throw bad("stride " + std::to_string(strides[i]) + " of dimension " + std::to_string(i) + " is negative");
        }
        empty = empty || sizes[i] == 0;
    }
    if (empty) return 0;
    /* The last element's index: offset + sum (size - 1) * stride. */
    std::uint64_t last = static_cast<std::uint64_t>(storage_offset);
    for (std::size_t i = 0; i < sizes.size(); i++) {
        std::uint64_t step = 0;
        if (__builtin_mul_overflow(static_cast<std::uint64_t>(sizes[i] - 1), static_cast<std::uint64_t>(strides[i]),
                                   &step) ||
            __builtin_add_overflow(last, step, &last)) {
            throw bad("the view's last element is past 2^64 (dimension " + std::to_string(i) + ")");
        }
    }
    std::uint64_t nbytes = 0;
    if (__builtin_add_overflow(last, 1, &nbytes) || __builtin_mul_overflow(nbytes, itemsize, &nbytes)) {
        throw bad("the view's extent in bytes is past 2^64");
    }
    return nbytes;
}

}  // namespace detail

/* A c10::Allocator that places every allocation in shared memory: by fd
 * (ss_storage_new_using_fd, ATen's flags 86) or by name through the
 * manager (ss_storage_new_using_filename, flags 6). A 0-byte allocation
 * is an empty DataPtr. Use the two process-wide instances of get(). */
class SharedAllocator final : public c10::Allocator {
public:
    explicit SharedAllocator(Strategy strategy) noexcept : strategy_(strategy) {}

    static SharedAllocator &get(Strategy strategy) {
        static SharedAllocator by_fd(Strategy::FileDescriptor);
        static SharedAllocator by_name(Strategy::FileSystem);
        return strategy == Strategy::FileDescriptor ? by_fd : by_name;
    }

    Strategy strategy() const noexcept { return strategy_; }

    c10::DataPtr allocate(std::size_t nbytes) override {
        if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
        return detail::storage_data_ptr(strategy_ == Strategy::FileDescriptor ? Storage::new_using_fd(nbytes)
                                                                             : Storage::new_using_filename(nbytes));
    }
    void copy_data(void *dest, const void *src, std::size_t count) const override { std::memcpy(dest, src, count); }

private:
    Strategy strategy_;
};

namespace detail {
/* The live ScopedCpuAllocators of the process, oldest first. Each keeps
 * the allocator that was libtorch's when it began; when one ends before
 * a newer one (scopes on two threads), the newer inherits it, so the
 * last to end puts back what was there before the first. */
struct CpuAllocatorScope {
    const void *scope;
    c10::Allocator *installed;
    c10::Allocator *previous;
};
struct CpuAllocatorScopes {
    std::mutex mutex;
    std::vector<CpuAllocatorScope> live;
};
inline CpuAllocatorScopes &cpu_allocator_scopes() {
    static CpuAllocatorScopes scopes;
    return scopes;
}
}  // namespace detail

/* While alive, makes `allocator` libtorch's CPU allocator, so plain
 * at::empty(...) on the CPU is born in shared memory. Process-wide
 * (every thread): meant for a scope in which this thread alone
 * allocates. Scopes may end in any order, also on different threads:
 * the newest live scope's allocator stays installed, and the last to
 * end restores the one installed before the first began (unless code
 * outside these scopes installed another meanwhile: that one is left). */
class ScopedCpuAllocator {
public:
    explicit ScopedCpuAllocator(Strategy strategy) : allocator_(&SharedAllocator::get(strategy)) {
        auto &scopes = detail::cpu_allocator_scopes();
        std::lock_guard<std::mutex> lock(scopes.mutex);
        scopes.live.push_back({this, allocator_, c10::GetCPUAllocator()});
        c10::SetCPUAllocator(allocator_, /*priority=*/UINT8_MAX);
    }
    ScopedCpuAllocator(const ScopedCpuAllocator &) = delete;
    ScopedCpuAllocator &operator=(const ScopedCpuAllocator &) = delete;
    ~ScopedCpuAllocator() {
        auto &scopes = detail::cpu_allocator_scopes();
        std::lock_guard<std::mutex> lock(scopes.mutex);
        auto &live = scopes.live;
        std::size_t i = 0;
        while (i < live.size() && live[i].scope != this) i++;
        if (i == live.size()) return; /* cannot happen: every scope registers itself */
        if (i + 1 < live.size()) {
            /* Not the newest: the next one now stands on what this one found. */
            live[i + 1].previous = live[i].previous;
        } else if (c10::GetCPUAllocator() == live[i].installed) {
            c10::SetCPUAllocator(live[i].previous, /*priority=*/UINT8_MAX);
        }
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }

private:
    c10::Allocator *allocator_;
};

/* A contiguous CPU tensor whose storage is born in shared memory. Its
 * storage is not resizable (as PyTorch's shared storages): resize_
 * would move the bytes away from every process that mapped them. */
inline at::Tensor empty_shared(c10::IntArrayRef sizes, c10::ScalarType dtype,
                               Strategy strategy = Strategy::FileSystem) {
    at::Tensor t = at::detail::empty_generic(sizes, &SharedAllocator::get(strategy),
                                             c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
    detail::forbid_resize(t.storage());
    return t;
}

/* Whether the storage's bytes are in shared memory of ours. */
inline bool is_shared(const c10::Storage &storage) noexcept {
    const ss_storage *s = detail::storage_ctx(storage);
    return s && ss_storage_is_shared(s);
}

/* The reference of ours behind `storage` (borrowed), or nullptr. Whoever
 * asks may share it through the C API, so the storage stops being
 * resizable. */
inline const ss_storage *storage_handle(const c10::Storage &storage) noexcept {
    const ss_storage *s = detail::storage_ctx(storage);
    if (s) detail::forbid_resize(storage);
    return s;
}

/* Moves the bytes into a new shared storage of `strategy` and swaps it
 * into `storage` in place (data pointer and allocator), as PyTorch's
 * sharing calls do; other views of this StorageImpl follow. The storage
 * is no longer resizable. */
inline ss_storage *move_to_shared(const c10::Storage &storage, Strategy strategy) {
    Storage fresh = strategy == Strategy::FileDescriptor ? Storage::new_using_fd(storage.nbytes())
                                                         : Storage::new_using_filename(storage.nbytes());
    if (storage.nbytes() > 0) std::memcpy(fresh.data(), storage.data(), storage.nbytes());
    ss_storage *raw = fresh.get();
    c10::StorageImpl *impl = storage.unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(detail::storage_data_ptr(std::move(fresh)));
    impl->set_allocator(&SharedAllocator::get(strategy));
    detail::forbid_resize(storage);
    return raw;
}

/* ---- by name (the "file_system" strategy, through the manager) ---- */

/* _share_filename_cpu_(): (manager socket path, segment name, bytes). A
 * storage not already in a managed segment is first moved into one (a
 * copy); an empty one gets a segment of its header alone, as in PyTorch.
 * Before sending, call shared_incref (the reference in flight, as
 * torch.multiprocessing's reduction does); the receiver cancels it with
 * shared_decref once it has opened the storage. The storage is no longer
 * resizable. */
inline SharedFilename share_filename(const c10::Storage &storage) {
    detail::require_cpu(storage, "share_filename");
    ss_storage *s = detail::storage_ctx(storage);
    if (!detail::is_managed(s)) s = move_to_shared(storage, Strategy::FileSystem);
    detail::forbid_resize(storage);
    char manager[108], name[64];
    std::size_t nbytes = 0;
    check(ss_storage_share_filename(s, manager, sizeof manager, name, sizeof name, &nbytes), "ss_storage_share_filename");
    return SharedFilename{manager, name, nbytes};
}

/* _new_shared_filename_cpu(manager, name, nbytes): registers with that
 * manager (PyTorch's torch_shm_manager or ours; "" = this process's) and
 * maps the segment (flags 10, header count + 1). The storage is not
 * resizable; its last c10 reference releases ours (count − 1, and the
 * name goes with the last holder in any process). */
inline c10::Storage open_shared_filename(const std::string &manager, const std::string &name, std::size_t nbytes) {
    Storage s = Storage::open_shared_filename(manager, name, nbytes);
    std::size_t size = s.nbytes();
    return c10::Storage(c10::Storage::use_byte_size_t(), size, detail::storage_data_ptr(std::move(s)),
                        &SharedAllocator::get(Strategy::FileSystem), /*resizable=*/false);
}
inline c10::Storage open_shared_filename(const SharedFilename &shared) {
    return open_shared_filename(shared.manager, shared.name, shared.nbytes);
}

/* _shared_incref() / _shared_decref() / the header count, for storages
 * shared by name (Error SS_ERR_UNSUPPORTED otherwise). */
inline void shared_incref(const c10::Storage &storage) {
    check(ss_storage_shared_incref(detail::storage_ctx(storage)), "ss_storage_shared_incref");
}
inline void shared_decref(const c10::Storage &storage) {
    check(ss_storage_shared_decref(detail::storage_ctx(storage)), "ss_storage_shared_decref");
}
inline std::int32_t shared_refcount(const c10::Storage &storage) {
    std::int32_t n = 0;
    check(ss_storage_shared_refcount(detail::storage_ctx(storage), &n), "ss_storage_shared_refcount");
    return n;
}

/* ---- by descriptor (the "file_descriptor" strategy) ---- */

/* _share_fd_cpu_(): (fd, bytes). A storage not already fd-backed is
 * first moved into a nameless segment (a copy). The fd stays owned by
 * the storage: send it (send_fds) or dup it, never close it. An empty
 * storage gives (-1, 0) and stays as it is, as in PyTorch (nothing can
 * map 0 bytes: send the receiver an empty storage instead). The storage
 * is no longer resizable. */
inline SharedFd share_fd(const c10::Storage &storage) {
    detail::require_cpu(storage, "share_fd");
    if (storage.nbytes() == 0) return SharedFd{-1, 0};
    ss_storage *s = detail::storage_ctx(storage);
    if (!detail::is_fd_backed(s)) s = move_to_shared(storage, Strategy::FileDescriptor);
    detail::forbid_resize(storage);
    SharedFd out{-1, 0};
    check(ss_storage_share_fd(s, &out.fd, &out.nbytes), "ss_storage_share_fd");
    return out;
}

/* _new_shared_fd_cpu(fd, nbytes): maps a duplicate of `fd` (flags 58);
 * the caller still closes `fd`. Not resizable. */
inline c10::Storage open_shared_fd(int fd, std::size_t nbytes) {
    Storage s = Storage::open_shared_fd(fd, nbytes);
    std::size_t size = s.nbytes();
    return c10::Storage(c10::Storage::use_byte_size_t(), size, detail::storage_data_ptr(std::move(s)),
                        &SharedAllocator::get(Strategy::FileDescriptor), /*resizable=*/false);
}

/* ---- tensors ---- */

/* A CPU (or CUDA) tensor over `storage` with the given view (what
 * torch.multiprocessing's rebuild_tensor does with set_()). The view
 * comes from another process, so it is checked as set_ checks it:
 * a known dtype, no negative size, stride or offset, and every element
 * inside the storage (overflow-safe). Where set_ would grow a resizable
 * storage that is too small, this refuses: shared storages cannot grow.
 * Error SS_ERR_INVALID_ARGUMENT names what is wrong. */
inline at::Tensor tensor_from_storage(c10::Storage storage, c10::ScalarType dtype, c10::IntArrayRef sizes,
                                      c10::IntArrayRef strides, std::int64_t storage_offset) {
    const char *function = "tensor_from_storage";
    if (!storage) throw Error(SS_ERR_NULL_POINTER, function, "the storage is undefined");
    dtype = detail::checked_dtype(static_cast<std::int64_t>(dtype), function);
    std::size_t itemsize = c10::elementSize(dtype);
    std::uint64_t need = detail::view_nbytes(itemsize, sizes, strides, storage_offset, function);
    if (need > storage.nbytes()) {
        throw Error(SS_ERR_INVALID_ARGUMENT, function,
                    "the view (offset " + std::to_string(storage_offset) + ", " + std::to_string(sizes.size()) +
                        " dimensions, " + std::to_string(itemsize) + "-byte " + c10::toString(dtype) + ") needs " +
                        std::to_string(need) + " bytes, the storage has " + std::to_string(storage.nbytes()));
    }
    c10::DispatchKeySet keys(storage.device_type() == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA
                                                                            : c10::DispatchKey::CPU);
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, c10::scalarTypeToTypeMeta(dtype));
    t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, storage_offset);
    return t;
}

/* ---- tensors over arena blocks ---- */

/* Most dimensions an ArenaTensorHandle carries. */
constexpr int kMaxArenaTensorDims = 16;

/* A tensor over an arena block, as plain bytes for any channel: the
 * block's handle (one hold, opens once) and the view. `dtype` is the
 * c10::ScalarType value (the same numbers as SS_DTYPE_*). */
struct ArenaTensorHandle {
    ss_arena_handle block;
    std::int32_t dtype;
    std::int32_t ndim;
    std::int64_t storage_offset; /* in elements */
    std::int64_t sizes[kMaxArenaTensorDims];
    std::int64_t strides[kMaxArenaTensorDims];
};

namespace detail {
struct ArenaBlock {
    std::shared_ptr<ss_arena> arena;
    void *ptr;
};
inline void free_arena_block(void *ctx) noexcept {
    auto *block = static_cast<ArenaBlock *>(ctx);
    (void)ss_arena_dealloc(block->arena.get(), block->ptr);
    delete block;
}
inline void free_arena_view(void *ctx) noexcept { ss_arena_view_free(static_cast<ss_arena_view *>(ctx)); }
}  // namespace detail

/* A c10::Allocator over a shareable arena: every storage is a block born
 * in shared memory and shared in O(1) (a hold, no copy) with share().
 * Storages keep the arena alive. Allocation is thread-safe. */
class ArenaAllocator final : public c10::Allocator {
public:
    explicit ArenaAllocator(const ss_arena_options &options = arena_options_default())
        : arena_(open_arena(options), &ss_arena_close) {}

    const ss_arena *arena() const noexcept { return arena_.get(); }

    c10::DataPtr allocate(std::size_t nbytes) override {
        if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
        void *p = nullptr;
        check(ss_arena_alloc(arena_.get(), nbytes, 64, &p), "ss_arena_alloc");
        return c10::DataPtr(p, new detail::ArenaBlock{arena_, p}, &detail::free_arena_block,
                            c10::Device(c10::DeviceType::CPU));
    }
    void copy_data(void *dest, const void *src, std::size_t count) const override { std::memcpy(dest, src, count); }

    /* A contiguous tensor in a new block. */
    at::Tensor empty(c10::IntArrayRef sizes, c10::ScalarType dtype) {
        return at::detail::empty_generic(sizes, this, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
    }

    /* Shares a tensor whose storage is a block of this arena. By fd, the
     * peer needs the segment's descriptor (segment_fd) once per segment. */
    ArenaTensorHandle share(const at::Tensor &t) const {
        const c10::DataPtr &dp = t.storage().data_ptr();
        auto *block = dp.get_deleter() == &detail::free_arena_block ? static_cast<detail::ArenaBlock *>(dp.get_context())
                                                                    : nullptr;
        if (!block || block->arena != arena_) {
            throw Error(SS_ERR_INVALID_ARGUMENT, "ArenaAllocator::share", "the tensor's storage is not a block of this arena");
        }
        if (t.dim() > kMaxArenaTensorDims) {
            throw Error(SS_ERR_INVALID_ARGUMENT, "ArenaAllocator::share",
                        "the tensor has " + std::to_string(t.dim()) + " dimensions, at most " +
                            std::to_string(kMaxArenaTensorDims) + " fit a handle");
        }
        ArenaTensorHandle h{};
        check(ss_arena_share(arena_.get(), block->ptr, &h.block), "ss_arena_share");
        h.dtype = static_cast<std::int32_t>(t.scalar_type());
        h.ndim = static_cast<std::int32_t>(t.dim());
        h.storage_offset = t.storage_offset();
        for (int i = 0; i < h.ndim; i++) {
            h.sizes[i] = t.size(i);
            h.strides[i] = t.stride(i);
        }
        return h;
    }
    /* Cancels a share whose handle will never be opened. */
    void unshare(const ArenaTensorHandle &h) const { check(ss_arena_unshare(arena_.get(), &h.block), "ss_arena_unshare"); }
    /* The descriptor of a by-fd segment (owned by the arena). */
    int segment_fd(const ArenaTensorHandle &h) const {
        int fd = -1;
        check(ss_arena_segment_fd(arena_.get(), h.block.segment_id, &fd), "ss_arena_segment_fd");
        return fd;
    }
    /* Reclaims dead consumers' holds and reuses blocks nobody holds. */
    Arena::Collected collect() const {
        Arena::Collected c{0, 0};
        check(ss_arena_collect(arena_.get(), &c.reclaimed_holds, &c.recycled_blocks), "ss_arena_collect");
        return c;
    }

private:
    static ss_arena *open_arena(const ss_arena_options &options) {
        ss_arena *raw = nullptr;
        check(ss_arena_open(&options, &raw), "ss_arena_open");
        return raw;
    }
    std::shared_ptr<ss_arena> arena_;
};

/* Consumer: the tensor an ArenaTensorHandle names (by fd, import the
 * segment first with ArenaView::import_segment_fd). Its storage holds
 * the block until the last c10 reference goes. The handle comes from
 * another process: the library checks the block against the mapped
 * segment, and the view (ndim, dtype, sizes, strides, offset) is checked
 * against the block as tensor_from_storage does. A refused view gives
 * Error SS_ERR_INVALID_ARGUMENT and releases the block's hold, as if the
 * tensor had been opened and dropped. */
inline at::Tensor open_arena_tensor(const ArenaTensorHandle &h) {
    ss_arena_view *view = nullptr;
    check(ss_arena_view_open(&h.block, &view), "ss_arena_view_open");
    /* Owned by the DataPtr from here on (its deleter frees the view). */
    c10::DataPtr data(ss_arena_view_data(view), view, &detail::free_arena_view, c10::Device(c10::DeviceType::CPU));
    std::size_t size = ss_arena_view_size(view);
    c10::Storage storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, /*resizable=*/false);
    if (h.ndim < 0 || h.ndim > kMaxArenaTensorDims) {
        throw Error(SS_ERR_INVALID_ARGUMENT, "open_arena_tensor",
                    "ndim " + std::to_string(h.ndim) + " is out of range (0 to " + std::to_string(kMaxArenaTensorDims) +
                        ")");
    }
    c10::ScalarType dtype = detail::checked_dtype(h.dtype, "open_arena_tensor");
    return tensor_from_storage(std::move(storage), dtype, c10::IntArrayRef(h.sizes, static_cast<std::size_t>(h.ndim)),
                               c10::IntArrayRef(h.strides, static_cast<std::size_t>(h.ndim)), h.storage_offset);
}

/* ---- CUDA ---- */

namespace detail {
/* The producer's original DataPtr waits here until both it and every
 * consumer are done; then the caching allocator gets the memory back. */
inline void give_back_cuda(void *ctx, void * /*device_ptr*/) { delete static_cast<c10::DataPtr *>(ctx); }
inline void free_cuda_sent_ctx(void *ctx) noexcept { (void)ss_cuda_sent_free(static_cast<ss_cuda_sent *>(ctx), nullptr); }
inline void free_cuda_received_ctx(void *ctx) noexcept {
    (void)ss_cuda_received_free(static_cast<ss_cuda_received *>(ctx));
}
}  // namespace detail

/* _share_cuda_(): the 8-value tuple (device, memory handle, size, offset,
 * ref-counter file, slot, event handle, event_sync_required) with our
 * ref-counter files. The storage's DataPtr is wrapped, as PyTorch does:
 * its memory goes back once this storage and the consumer are both done.
 * `stream` is the cudaStream_t whose queued work the consumer must see
 * (nullptr: the default stream). Without CUDA: Error
 * SS_ERR_CUDA_UNAVAILABLE with the library's reason. */
inline ss_cuda_ipc_handle share_cuda(const c10::Storage &storage, void *stream = nullptr) {
    if (!storage) throw Error(SS_ERR_NULL_POINTER, "share_cuda", "the storage is undefined");
    if (storage.device_type() != c10::DeviceType::CUDA) {
        throw Error(SS_ERR_INVALID_ARGUMENT, "share_cuda",
                    std::string("only available on CUDA storages (this one is on ") + storage.device().str() + ")");
    }
    c10::StorageImpl *impl = storage.unsafeGetStorageImpl();
    if (impl->received_cuda()) {
        throw Error(SS_ERR_UNSUPPORTED, "share_cuda",
                    "this storage was received from another process: clone it before sending it on");
    }
    ss_cuda_ipc_handle handle{};
    ss_cuda_sent *sent = nullptr;
    auto original = std::make_unique<c10::DataPtr>(c10::DataPtr(nullptr, storage.device()));
    void *data = storage.mutable_data();
    check(ss_cuda_share(data, storage.nbytes(), storage.device().index(), stream, &detail::give_back_cuda,
                        original.get(), &handle, &sent),
          "ss_cuda_share");
    if (sent) {
        *original = impl->set_data_ptr(c10::DataPtr(data, sent, &detail::free_cuda_sent_ctx, storage.device()));
        (void)original.release(); /* the library owns it now (give_back_cuda) */
    }
    return handle;
}

/* _new_shared_cuda(8 values): maps the producer's memory (once per
 * allocation here) and makes `stream` wait for its event. The storage is
 * not resizable and marked received; its last reference releases the
 * producer's slot. */
inline c10::Storage open_cuda(const ss_cuda_ipc_handle &handle, void *stream = nullptr) {
    ss_cuda_received *received = nullptr;
    check(ss_cuda_received_open(&handle, stream, &received), "ss_cuda_received_open");
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(handle.device));
    /* Owned by the DataPtr from here on (its deleter is the consumer's release). */
    c10::DataPtr data(ss_cuda_received_data(received), received, &detail::free_cuda_received_ctx, device);
    std::size_t size = ss_cuda_received_size(received);
    c10::Storage storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, /*resizable=*/false);
    storage.unsafeGetStorageImpl()->set_received_cuda(true);
    return storage;
}

/* ---- a weights pool opened whole (ss_cuda_weights) ---- */

namespace detail {
/* One reference to the opened pool per c10 storage: the import (mappings,
 * connection, hold slot) lasts until the Weights object and every tensor
 * it gave out are gone. */
using WeightsRef = std::shared_ptr<ss_cuda_weights>;
inline void free_weights_ref(void *ctx) noexcept { delete static_cast<WeightsRef *>(ctx); }
}  // namespace detail

/* A producer's pool of named tensors (ss_cuda_pool_export), opened once in
 * this process (ss_cuda_weights_open): one connection and one mapping per
 * segment, whatever the number of tensors. tensors() are views into the
 * producer's memory, CUDA tensors on the pool's device for a CUDA pool and
 * CPU tensors for the host backend; tensors that were views of one storage
 * in the producer share one c10::Storage here. The storages are not
 * resizable, and each keeps the import alive, so tensors may outlive this
 * object.
 *
 * The producer updates the bytes in place. Read them only under a reader
 * guard (read() or acquire()/release()): while one is held the producer's
 * next update waits, so what the guard's kernels read is one version.
 * The manifest comes from another process: every view is checked against
 * its storage as tensor_from_storage checks it, and names must be unique.
 * A producer that has died is reported by the next acquire as Error
 * SS_ERR_PEER_GONE. */
class Weights {
public:
    /* A reader's hold on one version: released (after `stream`'s queued
     * work, so kernels that read the weights are done) when it goes. */
    class ReadGuard {
    public:
        ReadGuard(ReadGuard &&other) noexcept
            : weights_(std::exchange(other.weights_, nullptr)), stream_(other.stream_), version_(other.version_) {}
        ReadGuard(const ReadGuard &) = delete;
        ReadGuard &operator=(const ReadGuard &) = delete;
        ReadGuard &operator=(ReadGuard &&) = delete;
        ~ReadGuard() {
            /* A destructor cannot throw: a failed release (the producer is
             * gone) leaves nothing to give back anyway. */
            if (weights_) (void)ss_cuda_weights_release(weights_, reinterpret_cast<std::uintptr_t>(stream_));
        }
        /* The version being read (1 after the first export, + 1 per publish). */
        std::uint64_t version() const noexcept { return version_; }
        /* Releases now, reporting a failure (the guard is then spent). */
        void release() {
            ss_cuda_weights *w = std::exchange(weights_, nullptr);
            if (w) check(ss_cuda_weights_release(w, reinterpret_cast<std::uintptr_t>(stream_)), "ss_cuda_weights_release");
        }

    private:
        friend class Weights;
        ReadGuard(ss_cuda_weights *weights, void *stream, std::uint64_t version) noexcept
            : weights_(weights), stream_(stream), version_(version) {}
        ss_cuda_weights *weights_;
        void *stream_;
        std::uint64_t version_;
    };

    /* Opens the pool a handle names (the bytes ss_cuda_pool_export wrote,
     * or Python's WeightsHandle bytes). timeout_ms bounds the connection
     * (0: the library's default). */
    static Weights open(const void *handle, std::size_t len, std::int64_t timeout_ms = 0) {
        if (!handle && len > 0) throw Error(SS_ERR_NULL_POINTER, "Weights::open", "the handle is null");
        std::int32_t device_type = 0, device = 0;
        check(ss_cuda_pool_handle_device(static_cast<const std::uint8_t *>(handle), len, &device_type, &device),
              "ss_cuda_pool_handle_device");
        ss_cuda_weights *raw = nullptr;
        check(ss_cuda_weights_open(static_cast<const std::uint8_t *>(handle), len, timeout_ms, &raw),
              "ss_cuda_weights_open");
        Weights w(detail::WeightsRef(raw, &ss_cuda_weights_free));
        w.device_ = device_type == SS_POOL_DEVICE_CUDA
                        ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))
                        : c10::Device(c10::DeviceType::CPU);
        w.build_tensors();
        return w;
    }
    static Weights open(const std::vector<std::uint8_t> &handle, std::int64_t timeout_ms = 0) {
        return open(handle.data(), handle.size(), timeout_ms);
    }

    /* name -> view, for load_state_dict-style use. */
    const std::unordered_map<std::string, at::Tensor> &tensors() const noexcept { return tensors_; }
    /* The tensor named `name` (Error SS_ERR_NOT_FOUND names it otherwise). */
    const at::Tensor &at(const std::string &name) const {
        auto it = tensors_.find(name);
        if (it == tensors_.end()) throw Error(SS_ERR_NOT_FOUND, "Weights::at", "no tensor named '" + name + "'");
        return it->second;
    }
    /* Where the tensors live: CUDA(index) or CPU (host backend). */
    c10::Device device() const noexcept { return device_; }

    /* Waits (up to timeout_ms; 0 waits forever) for a published version,
     * makes `stream` (a cudaStream_t; nullptr: the default stream) wait
     * for the producer's publish, and holds that version until the guard
     * goes. One guard at a time per Weights object. */
    ReadGuard read(void *stream = nullptr, std::int64_t timeout_ms = 0) {
        std::uint64_t version = acquire(stream, timeout_ms);
        return ReadGuard(weights_.get(), stream, version);
    }
    /* The calls read() pairs, for code that cannot hold a guard. */
    std::uint64_t acquire(void *stream = nullptr, std::int64_t timeout_ms = 0) {
        std::uint64_t version = 0;
        check(ss_cuda_weights_acquire(weights_.get(), reinterpret_cast<std::uintptr_t>(stream), timeout_ms, &version),
              "ss_cuda_weights_acquire");
        return version;
    }
    void release(void *stream = nullptr) {
        check(ss_cuda_weights_release(weights_.get(), reinterpret_cast<std::uintptr_t>(stream)),
              "ss_cuda_weights_release");
    }

    /* The C object (borrowed), for calls this class does not wrap. */
    ss_cuda_weights *get() const noexcept { return weights_.get(); }

private:
    explicit Weights(detail::WeightsRef weights) : weights_(std::move(weights)), device_(c10::DeviceType::CPU) {}

    c10::Storage storage_for(const ss_cuda_weights_tensor_info &info, std::size_t index) {
        auto known = storages_.find(info.storage_index);
        if (known != storages_.end()) {
            if (known->second.data() != info.data_ptr || known->second.nbytes() != info.storage_nbytes) {
                throw Error(SS_ERR_CORRUPT, "Weights::open",
                            "tensor " + std::to_string(index) + " names storage " + std::to_string(info.storage_index) +
                                " with another address or size than an earlier tensor");
            }
            return known->second;
        }
        if (!info.data_ptr && info.storage_nbytes > 0) {
            throw Error(SS_ERR_CORRUPT, "Weights::open", "tensor " + std::to_string(index) + " has no storage address");
        }
        /* The deleter's context is a reference to the import. */
        auto *ref = new detail::WeightsRef(weights_);
        c10::DataPtr data(info.data_ptr, ref, &detail::free_weights_ref, device_);
        c10::Storage storage(c10::Storage::use_byte_size_t(), info.storage_nbytes, std::move(data), nullptr,
                             /*resizable=*/false);
        storages_.emplace(info.storage_index, storage);
        return storage;
    }

    void build_tensors() {
        std::size_t count = 0;
        check(ss_cuda_weights_count(weights_.get(), &count), "ss_cuda_weights_count");
        tensors_.reserve(count);
        for (std::size_t i = 0; i < count; i++) {
            ss_cuda_weights_tensor_info info{};
            check(ss_cuda_weights_tensor(weights_.get(), i, &info), "ss_cuda_weights_tensor");
            if (!info.name) throw Error(SS_ERR_CORRUPT, "Weights::open", "tensor " + std::to_string(i) + " has no name");
            if (info.ndim > 0 && (!info.sizes || !info.strides)) {
                throw Error(SS_ERR_CORRUPT, "Weights::open", std::string("tensor '") + info.name + "' has no sizes");
            }
            c10::ScalarType dtype = detail::checked_dtype(info.dtype, "Weights::open");
            at::Tensor t = tensor_from_storage(storage_for(info, i), dtype, c10::IntArrayRef(info.sizes, info.ndim),
                                               c10::IntArrayRef(info.strides, info.ndim), info.storage_offset);
            if (!tensors_.emplace(info.name, std::move(t)).second) {
                throw Error(SS_ERR_CORRUPT, "Weights::open", std::string("two tensors are named '") + info.name + "'");
            }
        }
        /* The tensors hold the storages from here on. */
        storages_.clear();
    }

    detail::WeightsRef weights_;
    c10::Device device_;
    std::unordered_map<std::size_t, c10::Storage> storages_; /* while building: by storage index */
    std::unordered_map<std::string, at::Tensor> tensors_;
};

}  // namespace libtorch
}  // namespace storage_sharing

#endif /* STORAGE_SHARING_TORCH_HPP */
