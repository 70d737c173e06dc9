"""torch.multiprocessing and DataLoader on the shareable arena.

After :func:`enable`:

* ``UntypedStorage._new_shared`` (what DataLoader's ``default_collate``
  calls inside a worker to allocate a batch) returns a storage in this
  process's arena, so collation writes straight into shared memory;
* a CPU storage in the arena pickles, through torch.multiprocessing
  (Queue, SimpleQueue, Pipe, Pool, spawn arguments), as its 112-byte
  handle: the receiver maps the producer's segment once (its descriptor
  comes from the producer's fd server, once per segment) and builds an
  ordinary tensor over the producer's bytes, no copy. The block goes back
  to the producer when the last tensor over it dies;
* a storage received that way and sent on (A -> B -> C) pickles as a new
  handle of the same block that the producer A makes for it, so C maps
  A's bytes too and all three see each other's writes;
* a CPU storage PyTorch would copy into a fresh segment (its own
  ``share_memory_``) is copied into an arena block instead and points to
  it from then on, as ``share_memory_`` moves it, then goes as above
  (where PyTorch can swap a storage's memory, ``_swap_data_ptr_``; on
  releases without it such a storage takes PyTorch's own reduction);
* every other storage (in PyTorch's shared memory already, CUDA, empty,
  ...) takes PyTorch's own reduction.

Arena memory is shared memory whether or not ``enable()`` was called (a
process can receive arena tensors without it): importing this module makes
``is_shared()`` True and ``share_memory_()`` a no-op for it, and makes it
pickle as a handle, as PyTorch does for its own shared storages.

Receivers let go of segments by themselves: a large block's segment with
its last tensor, a dead or retired producer's with the last tensor over
it (DataLoader: when an epoch's workers are joined).

DataLoader workers get ``enable()`` through a wrapped ``worker_init_fn``
(fork, spawn and forkserver alike), and processes started after
``enable()`` see ``STORAGE_SHARING_TORCH`` in their environment: importing
this module there enables it too.

Every private part of PyTorch replaced or called is checked first (see
``_torch_compat``): where one is missing or changed, or on a PyTorch release
outside the tested range, importing patches nothing and :func:`enable`
raises :class:`UnsupportedTorchError` naming each problem.
"""

import inspect
import operator
import os
import threading
import weakref
from typing import Optional

import torch
import torch.multiprocessing  # noqa: F401  (registers PyTorch's reductions first)
import torch.utils.data.dataloader as _dataloader
from multiprocessing.reduction import ForkingPickler

from . import Arena, Error, Handle, PeerGoneError, _native, _torch_compat, open_shared, trim_remote_cache
from ._torch_compat import TESTED_RANGE, UnsupportedTorchError  # noqa: F401  (part of this module's API)

ENV = "STORAGE_SHARING_TORCH"
DEFAULT_SEGMENT_SIZE = 256 << 20
DEFAULT_LARGE_THRESHOLD = 64 << 20
_COLLECT_EVERY = 256

_lock = threading.Lock()
_arena: Optional[Arena] = None
_arena_pid = 0
_allocs = 0
_options = {"segment_size": DEFAULT_SEGMENT_SIZE, "large_threshold": DEFAULT_LARGE_THRESHOLD}
_saved: dict = {}
# Set on every storage over arena memory (made here or received): PyTorch
# keeps a storage's Python object as long as its memory lives, so the mark
# follows the storage through views and tensors.
_MARK = "_storage_sharing_arena"
# Set by storage_sharing.cuda on the CPU storages of a weights pool (the
# host backend): shared memory too, which share_memory_ must not move.
POOL_MARK = "_storage_sharing_pool"
# Set on a storage received as a handle: (handle bytes, producer's fd
# server address), what sending it on asks the producer a new share with.
_RECEIVED = "_storage_sharing_received"
# PyTorch's own methods and reduction, under ours for arena memory (empty
# until they are replaced).
_torch: dict = {}


def _reset_after_fork() -> None:
    # A lock another thread held at fork() would stay held in the child.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def process_arena() -> Arena:
    """This process's arena (a new one after fork: a child never allocates
    from its parent's segments)."""
    global _arena, _arena_pid, _allocs
    pid = os.getpid()
    arena = _arena
    if arena is not None and _arena_pid == pid:
        return arena
    with _lock:
        if _arena is None or _arena_pid != pid:
            _arena = Arena(segment_size=_options["segment_size"], large_threshold=_options["large_threshold"])
            _arena_pid = pid
            _allocs = 0
        return _arena


def new_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU UntypedStorage of ``nbytes`` bytes in this process's arena."""
    global _allocs
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"new_storage: nbytes must be at least 0, got {nbytes}")
    if nbytes == 0:
        # No bytes to share: an empty storage, shared as PyTorch's own
        # empty shared storages are (is_shared() True, sent as empty).
        return _marked(torch.UntypedStorage(0))
    arena = process_arena()
    block = arena.alloc(nbytes)
    _allocs += 1
    if _allocs % _COLLECT_EVERY == 0:
        arena.collect()  # holds of consumers that died
    return _marked(torch.frombuffer(block, dtype=torch.uint8, count=int(nbytes)).untyped_storage())


def _marked(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    setattr(storage, _MARK, True)
    return storage


def empty(*size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory is an arena block."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    numel = 1
    for s in size:
        numel *= int(s)
    itemsize = torch.empty((), dtype=dtype).element_size()
    storage = new_storage(numel * itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, size)


def to_arena(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU ``tensor`` in the arena (one copy)."""
    out = empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor)
    return out


def in_arena(obj) -> bool:
    """Whether a tensor's or storage's memory is a block of this process's arena."""
    storage = obj.untyped_storage() if isinstance(obj, torch.Tensor) else obj
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    arena = _arena
    if arena is None or _arena_pid != os.getpid() or storage.device.type != "cpu" or storage.nbytes() == 0:
        return False
    try:
        return arena._native.block_size(storage.data_ptr()) >= storage.nbytes()
    except Error:
        return False


# Storages of this process's arena that were sent, by block (segment id,
# offset), one entry per live storage however often it is sent: a share of
# that block that comes back to this process, straight or through other
# processes, is the storage that was sent (as PyTorch's own shared-storage
# cache makes it), not a second mapping of this process's own segment.
_sent: "weakref.WeakValueDictionary[tuple, torch.UntypedStorage]" = weakref.WeakValueDictionary()


def _sent_storage(handle: Handle, nbytes: int) -> Optional[torch.UntypedStorage]:
    """The storage of this process's arena that a share coming back is of,
    its hold given back (the storage itself keeps the block); None when the
    share is another process's block or the storage is gone."""
    if handle.producer_pid != os.getpid() or _arena is None or _arena_pid != os.getpid():
        return None
    sent = _sent.get((handle.segment_id, handle.offset))
    if sent is None or sent.nbytes() != nbytes:
        return None
    try:
        # Checks the share is one of this arena's (pid, start time, slot,
        # generation): a stale or foreign handle opens as any other.
        _arena.unshare(handle)
    except Error:
        return None
    return sent


def _rebuild_storage(handle: bytes, address: str, nbytes: int, sender_ptr: int = 0) -> torch.UntypedStorage:
    # `sender_ptr` is accepted from older senders; the handle says which block.
    h = Handle.from_bytes(handle)
    sent = _sent_storage(h, nbytes)
    if sent is not None:
        return sent
    view = open_shared(h, address)
    storage = _marked(torch.frombuffer(view, dtype=torch.uint8, count=nbytes).untyped_storage())
    setattr(storage, _RECEIVED, (handle, address))
    return storage


def _reduce_received(storage):
    """A received storage sent on: a new share of the producer's block, made
    by the producer (this process proves its hold with its handle). None
    when the producer is gone: then nobody else sees these bytes, and
    PyTorch's reduction (a copy this process and the receiver share) loses
    nothing."""
    handle, address = getattr(storage, _RECEIVED)
    try:
        new = _native.reshare(Handle.from_bytes(handle), address)
    except PeerGoneError:
        return None
    return (_rebuild_storage, (bytes(new), address, storage.nbytes()))


def _reduce_own(storage):
    """The arena reduction of a storage over a block of this process's
    arena, or None when it is not one."""
    arena = _arena
    if arena is None or _arena_pid != os.getpid():
        return None
    try:
        handle = arena._native.share(storage.data_ptr())
    except Error:
        return None  # not a block of ours
    if handle.size >= storage.nbytes():
        _sent[(handle.segment_id, handle.offset)] = storage
        return (_rebuild_storage, (bytes(handle), arena.fd_server_address(), storage.nbytes()))
    arena.unshare(handle)
    return None


def _move_to_arena(storage: torch.UntypedStorage) -> None:
    """What ``share_memory_`` does, into an arena block: the storage's bytes
    are copied once into a block and the storage points to the block from
    now on (every tensor over it with it); its old memory goes."""
    block = new_storage(storage.nbytes())
    block.copy_(storage)
    storage._swap_data_ptr_(block)
    _marked(storage)
    # `block` now owns the storage's old memory, freed when it goes here.


def _reduce_storage(storage):
    if type(storage) is torch.UntypedStorage and storage.device.type == "cpu" and storage.nbytes() > 0:
        reduced = _reduce_own(storage)
        if reduced is not None:
            return reduced
        if hasattr(storage, _RECEIVED):
            reduced = _reduce_received(storage)
            if reduced is not None:
                return reduced
        elif _moves_fresh_storages() and not getattr(storage, _MARK, False) and not _torch["is_shared"](storage):
            # PyTorch would copy it into a fresh segment of its own (one
            # descriptor and one mapping per storage): an arena block costs
            # neither once the segment is mapped. (A PyTorch that cannot
            # swap a storage's memory keeps its own way.)
            _move_to_arena(storage)
            reduced = _reduce_own(storage)
            if reduced is not None:
                return reduced
    return _torch["reduce_storage"](storage)


def _moves_fresh_storages() -> bool:
    """Only under the file_descriptor strategy, whose cost (a descriptor per
    storage) the arena saves: under file_system PyTorch's named segments cost
    no descriptor, and programs that chose it may look for those names."""
    return is_enabled() and _torch["can_move"] and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"


def _is_shared(self) -> bool:
    # Arena and pool memory is shared memory, like PyTorch's own shared storages.
    return getattr(self, _MARK, False) or getattr(self, POOL_MARK, False) or _torch["is_shared"](self)


def _share_memory_(self, *args, **kwargs):
    # PyTorch leaves a storage in shared memory where it is; moving arena
    # memory to a copy would cut it off from the processes sharing it.
    if getattr(self, _MARK, False) or getattr(self, POOL_MARK, False):
        return self
    return _torch["share_memory_"](self, *args, **kwargs)


def _install_arena_memory_hooks() -> None:
    """Arena memory is shared memory in every process that imports this
    module (a receiver need not call enable()); ordinary storages keep
    PyTorch's behaviour. Only after _torch_compat's checks pass."""
    if _torch:
        return
    _torch["reduce_storage"] = ForkingPickler._extra_reducers[torch.UntypedStorage]
    _torch["is_shared"] = inspect.getattr_static(torch.UntypedStorage, "is_shared")
    _torch["share_memory_"] = inspect.getattr_static(torch.UntypedStorage, "share_memory_")
    _torch["can_move"] = _torch_compat.can_move_storages()
    ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
    torch.UntypedStorage.is_shared = _is_shared
    torch.UntypedStorage.share_memory_ = _share_memory_


def _new_shared(cls, size, *, device="cpu"):
    if cls is torch.UntypedStorage and torch.device(device).type == "cpu" and size > 0:
        return new_storage(size)
    return _saved["new_shared"].__get__(None, cls)(size, device=device)


class _EnableInWorker:
    """A DataLoader worker_init_fn that enables the arena in the worker,
    then calls the user's function (picklable for spawn/forkserver)."""

    def __init__(self, user_fn, options):
        self.user_fn = user_fn
        self.options = options

    def __call__(self, worker_id):
        enable(**self.options)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _iter_init(self, loader, *args, **kwargs):
    fn = loader.worker_init_fn
    if is_enabled() and not isinstance(fn, _EnableInWorker):
        loader.worker_init_fn = _EnableInWorker(fn, dict(_options))
        try:
            return _saved["iter_init"](self, loader, *args, **kwargs)
        finally:
            loader.worker_init_fn = fn
    return _saved["iter_init"](self, loader, *args, **kwargs)


def _trimming_shutdown(original):
    def _shutdown_workers(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            # The workers are joined: their segments that no batch uses any
            # more are unmapped now, not at the next epoch's first batch.
            try:
                trim_remote_cache()
            except Exception:  # noqa: BLE001  (may run from __del__ at exit)
                pass

    _shutdown_workers.__wrapped__ = original
    return _shutdown_workers


# The smallest large threshold the arena takes (its smallest size class).
_MIN_LARGE_THRESHOLD = 64


def _machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _checked_options(segment_size, large_threshold):
    """The options as ints, each checked against its range, or an error
    naming the option (here, not later inside a DataLoader worker)."""

    def whole_bytes(name, value):
        if isinstance(value, bool):
            raise TypeError(f"storage_sharing.torch.enable(): {name} must be a number of bytes (int), got {value!r}")
        try:
            return operator.index(value)
        except TypeError:
            raise TypeError(f"storage_sharing.torch.enable(): {name} must be a number of bytes (int), got {value!r}") from None

    segment_size = whole_bytes("segment_size", segment_size)
    large_threshold = whole_bytes("large_threshold", large_threshold)
    page, memory = os.sysconf("SC_PAGE_SIZE"), _machine_memory()
    if segment_size < page:
        raise ValueError(f"storage_sharing.torch.enable(): segment_size must be at least one page ({page} bytes), got {segment_size}")
    if segment_size > memory:
        raise ValueError(
            f"storage_sharing.torch.enable(): segment_size {segment_size} is more than this machine's memory ({memory} bytes)"
        )
    if large_threshold < _MIN_LARGE_THRESHOLD:
        raise ValueError(
            f"storage_sharing.torch.enable(): large_threshold must be at least {_MIN_LARGE_THRESHOLD} bytes, got {large_threshold}"
        )
    if large_threshold > segment_size // 4:
        raise ValueError(
            f"storage_sharing.torch.enable(): large_threshold {large_threshold} must be at most a quarter of segment_size ({segment_size})"
        )
    return segment_size, large_threshold


def is_enabled() -> bool:
    return bool(_saved)


def enable(segment_size: int = DEFAULT_SEGMENT_SIZE, large_threshold: int = DEFAULT_LARGE_THRESHOLD) -> None:
    """Puts CPU tensors shared through torch.multiprocessing and DataLoader
    batches on the arena (see the module's doc). Calling it again with the
    same options does nothing.

    ``segment_size``: the most bytes of data a shared segment that blocks
    are carved from may grow to (from one page up to this machine's
    memory). A segment costs what has been carved from it: its pages are
    reserved 1 MiB at a time as blocks reach them, so a worker that sends
    small batches holds about 1 MiB, not ``segment_size``. Blocks above
    ``large_threshold`` (64 bytes up to a quarter of ``segment_size``) get
    a segment of their own, sized to them. The defaults keep batches up to
    64 MiB in reused segments: after the first batches, no new mapping is
    made. Each option is checked here: ``TypeError`` or ``ValueError``
    naming it.

    The options are fixed while enabled and once this process has made its
    arena: other options then raise ValueError (rather than being ignored
    here and handed to child processes).

    Raises :class:`UnsupportedTorchError`, patching nothing, where a private
    part of PyTorch this relies on is missing or changed, or on a release
    outside ``TESTED_RANGE`` (unless ``STORAGE_SHARING_TORCH_ALLOW_UNTESTED=1``).
    """
    segment_size, large_threshold = _checked_options(segment_size, large_threshold)
    wanted = {"segment_size": segment_size, "large_threshold": large_threshold}
    with _lock:
        fixed = _saved or (_arena is not None and _arena_pid == os.getpid())
        if fixed and wanted != _options:
            raise ValueError(
                f"storage_sharing.torch.enable(segment_size={segment_size}, large_threshold={large_threshold}): "
                f"enabled already with segment_size={_options['segment_size']}, large_threshold={_options['large_threshold']}"
                + (", which this process's arena was made with" if _arena is not None and _arena_pid == os.getpid() else "")
                + "; options cannot change once enabled or once the arena exists"
            )
        if not _saved:
            _torch_compat.check()
            _install_arena_memory_hooks()
        _options.update(wanted)
        os.environ[ENV] = f"{segment_size}:{large_threshold}"
        if _saved:
            return
        _saved["new_shared"] = inspect.getattr_static(torch.UntypedStorage, "_new_shared")
        _saved["own_new_shared"] = "_new_shared" in torch.UntypedStorage.__dict__
        _saved["iter_init"] = _dataloader._MultiProcessingDataLoaderIter.__init__
        _saved["shutdown_workers"] = _dataloader._MultiProcessingDataLoaderIter._shutdown_workers
        torch.UntypedStorage._new_shared = classmethod(_new_shared)
        _dataloader._MultiProcessingDataLoaderIter.__init__ = _iter_init
        _dataloader._MultiProcessingDataLoaderIter._shutdown_workers = _trimming_shutdown(_saved["shutdown_workers"])


def disable() -> None:
    """Back to PyTorch's own allocation: new storages and DataLoader batches
    are PyTorch's again. Tensors already in the arena stay valid and stay
    shared memory (they still pickle as handles)."""
    os.environ.pop(ENV, None)
    with _lock:
        if not _saved:
            return
        if _saved["own_new_shared"]:
            torch.UntypedStorage._new_shared = _saved["new_shared"]
        else:
            del torch.UntypedStorage._new_shared
        _dataloader._MultiProcessingDataLoaderIter.__init__ = _saved["iter_init"]
        _dataloader._MultiProcessingDataLoaderIter._shutdown_workers = _saved["shutdown_workers"]
        _saved.clear()


def _enable_from_env() -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    try:
        seg, large = (int(v) for v in value.split(":"))
    except ValueError:
        seg, large = DEFAULT_SEGMENT_SIZE, DEFAULT_LARGE_THRESHOLD
    enable(seg, large)


if not _torch_compat.problems():
    _install_arena_memory_hooks()
_enable_from_env()
