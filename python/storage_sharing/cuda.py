"""A model's weights shared whole between processes, updated in place.

The producer puts a state dict in a :class:`Pool` (device memory in one or
a few large segments), exports it once, and hands the small picklable
:class:`WeightsHandle` to other processes; each opens it once with
:func:`open_weights` into a :class:`Weights`, a mapping of name -> tensor
views of the producer's memory (no copy) that
``model.load_state_dict(weights, assign=True)`` accepts::

    pool = cuda.Pool.from_state_dict(model.state_dict())   # copied in once
    handle = pool.export()                                 # pickle it anywhere
    ...
    w = cuda.open_weights(handle)                          # another process
    model.load_state_dict(w, assign=True)

Or the tensors are born in the pool, with no copy at all (CUDA)::

    pool = cuda.Pool("cuda:0")
    with pool.allocating():
        model = Model().cuda()
    pool.add_state_dict(model.state_dict())

Updates are in place and versioned: ``with pool.update() as tensors:``
waits until no consumer holds a version, lets the producer write (``copy_``
or its own kernels), and publishes a new version on exit. A consumer reads
inside ``with w.reading() as version:``, which holds the version it saw: the
producer's next update waits for it, so a consumer never sees a mix of two
versions.

``device="cpu"`` runs all of it on the host backend (CPU memory: sealed
memfds or named shm instead of device memory), giving CPU tensors: that is
how the tests run without a GPU, and it shares CPU weights as well.

Errors are :mod:`storage_sharing` errors: a producer that died is
:class:`~storage_sharing.PeerGoneError`, a wait that ran out is
:class:`~storage_sharing.WaitTimeoutError`, a bad argument or handle is
:class:`~storage_sharing.InvalidArgumentError`.
"""

import contextlib
import threading
from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from . import _native, _pool_replica
from ._errors import BusyError, ClosedError, InvalidArgumentError, NoSpaceError
from ._pool_layout import group_by_storage
from ._pool_tensors import bytes_at, dtype_name, dtype_named, storage_in, typed_view

__all__ = [
    "STOCK_FORMAT",
    "Pool",
    "Weights",
    "WeightsHandle",
    "open_weights",
]

STOCK_FORMAT = "storage_sharing.cuda_weights.stock/1"

DeviceLike = Union[str, int, torch.device]


def _device(device: DeviceLike) -> torch.device:
    """``cpu`` or ``cuda:N`` (an index always), or an error naming the
    device a pool cannot live on."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"pool device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type != "cuda":
        raise InvalidArgumentError(f"a pool lives on cpu (the host backend) or a CUDA device, not {d}")
    if d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


def _native_device(d: torch.device) -> Tuple[str, int]:
    return ("cpu", 0) if d.type == "cpu" else ("cuda", d.index)


def _current_stream(d: torch.device) -> int:
    """The stream the caller works on (0 on the host backend)."""
    return 0 if d.type == "cpu" else torch.cuda.current_stream(d).cuda_stream


def _require_mem_pool() -> None:
    missing = [n for n in ("MemPool", "use_mem_pool") if not hasattr(torch.cuda, n)]
    if missing or not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        raise RuntimeError(
            f"Pool.allocating() needs torch.cuda.MemPool, torch.cuda.use_mem_pool and "
            f"CUDAPluggableAllocator; this torch ({torch.__version__}) lacks "
            f"{', '.join(missing) or 'CUDAPluggableAllocator'}: copy the weights in with "
            f"Pool.from_state_dict / add_state_dict instead"
        )


# The pool whose allocating() context is open: PyTorch's pluggable
# allocator calls plain C functions, so the pool they place blocks in is
# one per process.
_allocating_lock = threading.Lock()
_allocating: Optional["Pool"] = None


class _Entry:
    """Where a tensor of the manifest lies (for the stock descriptor and
    the manifest a broadcast sends)."""

    __slots__ = ("storage_ptr", "storage_nbytes", "dtype", "sizes", "strides", "storage_offset")

    def __init__(self, storage_ptr: int, storage_nbytes: int, dtype: torch.dtype, sizes, strides, storage_offset: int) -> None:
        self.storage_ptr = storage_ptr
        self.storage_nbytes = storage_nbytes
        self.dtype = dtype
        self.sizes = tuple(sizes)
        self.strides = tuple(strides)
        self.storage_offset = storage_offset


class WeightsHandle:
    """What a consumer needs to open a pool: a few dozen bytes naming the
    producer's socket, pid, device and kind. Picklable; bytes(handle) and
    :meth:`from_bytes` carry it through any channel."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = bytes(data)

    @classmethod
    def from_bytes(cls, data: bytes) -> "WeightsHandle":
        """A handle from its bytes; an error names what is wrong with them."""
        h = cls(data)
        h._info()
        return h

    def __bytes__(self) -> bytes:
        return self._data

    def _info(self):
        return _native.pool_handle_info(self._data)

    @property
    def producer_pid(self) -> int:
        return self._info()[1]

    @property
    def device(self) -> torch.device:
        _, _, kind, index, _ = self._info()
        return torch.device("cpu") if kind == "cpu" else torch.device("cuda", index)

    @property
    def kind(self) -> str:
        return self._info()[4]

    def __reduce__(self):
        return (WeightsHandle, (self._data,))

    def __eq__(self, other) -> bool:
        return isinstance(other, WeightsHandle) and other._data == self._data

    def __hash__(self) -> int:
        return hash(self._data)

    def __repr__(self) -> str:
        try:
            _, pid, _, _, kind = self._info()
            return f"<storage_sharing.cuda.WeightsHandle producer={pid} device={self.device} kind={kind}>"
        except Exception:
            return f"<storage_sharing.cuda.WeightsHandle (malformed, {len(self._data)} bytes)>"


class Pool:
    """A producer's shareable pool of weights on ``device`` (``"cuda:N"``,
    or ``"cpu"`` for the host backend).

    ``kind="vmm"`` (default) shares segments as file descriptors (only
    processes with this library open them); ``kind="legacy"`` uses legacy
    CUDA IPC handles that stock PyTorch can open too (see
    :meth:`stock_descriptor`). ``segment_size`` is the size of a new segment
    (a larger request gets a segment of its own); ``max_consumers`` bounds
    the consumer processes connected at once.

    The pool keeps its tensors (:meth:`state_dict`) alive: memory a
    consumer reads is never handed out again while the pool lives.
    """

    def __init__(
        self,
        device: DeviceLike = "cuda:0",
        kind: str = "vmm",
        segment_size: Optional[int] = None,
        max_consumers: Optional[int] = None,
    ) -> None:
        self.device = _device(device)
        self.kind = kind
        dtype, index = _native_device(self.device)
        self._native = _native.CudaPool(dtype, index, kind, segment_size, max_consumers)
        self._tensors: Dict[str, torch.Tensor] = {}
        self._entries: Dict[str, _Entry] = {}
        self._mem_pool = None
        self._handle: Optional[WeightsHandle] = None

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping, device: Optional[DeviceLike] = None, kind: str = "vmm", **options
    ) -> "Pool":
        """A pool holding a copy of ``state_dict`` (each storage copied in
        once; views of one storage stay views of one storage). ``device``
        defaults to the device of the state dict's tensors."""
        if device is None:
            devices = {t.device for t in state_dict.values() if isinstance(t, torch.Tensor)}
            if len(devices) != 1:
                found = ", ".join(sorted(str(d) for d in devices)) or "no tensors"
                raise InvalidArgumentError(f"Pool.from_state_dict: pass device= (the state dict has {found})")
            device = devices.pop()
        pool = cls(device, kind, **options)
        pool.add_state_dict(state_dict)
        return pool

    # ---- filling ----

    def add_state_dict(self, state_dict: Mapping) -> None:
        """Adds every tensor of ``state_dict`` to the manifest. Tensors
        already in the pool (born in :meth:`allocating`) are added as they
        are; the others are copied in, one copy per storage."""
        if self._handle is not None:
            raise InvalidArgumentError("the pool's manifest is frozen after export: add tensors before pool.export()")
        groups = group_by_storage(state_dict)
        for g in groups:
            for m in g.members:
                if m.name in self._entries:
                    raise InvalidArgumentError(f"the pool has a tensor named {m.name!r} already")
        segments = self._native.segments()
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            for g in groups:
                self._add_group(g, segments)

    def _add_group(self, g, segments: List[Tuple[int, int]]) -> None:
        start = g.storage.data_ptr() + g.lo
        born_here = (
            g.nbytes > 0
            and g.storage.device == self.device
            and any(base <= start and start + g.nbytes <= base + size for base, size in segments)
        )
        if born_here:
            ptr, views = start, {m.name: m.tensor for m in g.members}
        else:
            # A storage without bytes takes no block (the manifest gives it none).
            ptr = self._native.alloc(g.nbytes) if g.nbytes else 0
            dst = bytes_at(ptr, g.nbytes, self.device, self._native)
            _pool_memory(dst.untyped_storage())
            if g.nbytes:
                dst.copy_(g.source_bytes())
            views = {
                m.name: typed_view(dst, m.tensor.dtype, m.tensor.shape, m.tensor.stride(), m.storage_offset)
                for m in g.members
            }
        for i, m in enumerate(g.members):
            t, offset = m.tensor, m.storage_offset
            try:
                self._native.add_tensor(m.name, ptr, g.nbytes, dtype_name(t.dtype), list(t.shape), list(t.stride()), offset)
            except BaseException:
                if i == 0 and ptr and not born_here:
                    self._native.free_block(ptr)  # nothing refers to the copy yet
                raise
            self._entries[m.name] = _Entry(ptr, g.nbytes, t.dtype, t.shape, t.stride(), offset)
            self._tensors[m.name] = views[m.name]

    @contextlib.contextmanager
    def allocating(self) -> Iterator["Pool"]:
        """Inside this context, this thread's CUDA allocations on the pool's
        device are born in the pool (``torch.cuda.MemPool`` over a
        ``CUDAPluggableAllocator`` of this library): ``model.cuda()`` puts
        the parameters there with no copy. Add them with
        :meth:`add_state_dict` afterwards. One pool at a time per process."""
        global _allocating
        if self.device.type != "cuda":
            raise InvalidArgumentError(
                f"Pool.allocating() places PyTorch's CUDA allocations; this pool is on {self.device} "
                f"(the host backend): put tensors in with add_state_dict or from_state_dict"
            )
        _require_mem_pool()
        with _allocating_lock:
            if _allocating is not None:
                raise InvalidArgumentError("another pool's allocating() context is open in this process")
            _allocating = self
        try:
            if self._mem_pool is None:
                allocator = torch.cuda.memory.CUDAPluggableAllocator(
                    _native.__file__, "ss_pool_torch_malloc", "ss_pool_torch_free"
                )
                self._mem_pool = torch.cuda.MemPool(allocator.allocator())
            _native.take_alloc_error()
            self._native.make_current()
            try:
                with torch.cuda.use_mem_pool(self._mem_pool, device=self.device):
                    yield self
            except torch.cuda.OutOfMemoryError as e:
                why = _native.take_alloc_error()
                if why is None:
                    raise
                raise NoSpaceError(f"the pool could not place an allocation: {why}") from e
        finally:
            _native.clear_current_pool()
            with _allocating_lock:
                _allocating = None

    # ---- sharing ----

    def export(self) -> WeightsHandle:
        """The handle consumers open. The first call freezes the manifest,
        starts answering consumers and publishes version 1; later calls
        return the same handle."""
        if self._handle is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies in are done before version 1
            self._handle = WeightsHandle(self._native.export())
        return self._handle

    @contextlib.contextmanager
    def update(self, timeout: Optional[float] = None) -> Iterator[Dict[str, torch.Tensor]]:
        """Opens an update: waits (up to ``timeout`` seconds; None = no
        limit) until no consumer holds a version, yields the pool's tensors
        to write in place, and on exit publishes the next version (recorded
        on the current stream). If the block raises, nothing is published
        and the pool stays torn: consumers' acquire fails until a later
        update publishes."""
        # A broadcast of this pool reads it under the same turn.
        with _pool_replica.turn_of(self).taken(timeout, "pool.update()") as left:
            self._native.begin_update(left())
            try:
                yield dict(self._tensors)
            except BaseException:
                self._native.abandon_update()
                raise
            self._native.publish_update(_current_stream(self.device))

    # ---- across machines ----

    def broadcast(
        self, group=None, src: int = 0, timeout: Optional[float] = None, chunk_bytes: Optional[int] = None
    ) -> int:
        """Every rank of ``group`` (torch.distributed; None: the default
        group) calls this with the same ``src`` (a global rank): rank
        ``src`` sends its pool's current version, the others receive it
        into their replicas (made by :meth:`replica`), in chunks of
        ``chunk_bytes`` broadcast straight into their segments. Returns
        the version, which every replica then publishes as its own. Each
        rank waits up to ``timeout`` seconds in all (None: the group's own
        timeout). See docs/cuda-weights.md, "Weights across machines"."""
        return _pool_replica.broadcast(self, group, src, timeout, chunk_bytes)

    @classmethod
    def replica(
        cls,
        group=None,
        src: int = 0,
        device: DeviceLike = "cuda",
        kind: str = "vmm",
        timeout: Optional[float] = None,
        max_consumers: Optional[int] = None,
    ) -> "Pool":
        """A replica of the pool that rank ``src`` of ``group`` broadcasts
        (its :meth:`broadcast` runs at the same time): built on ``device``
        from the source's manifest, filled with the source's current
        version and published under its number. Export it for this
        node's consumers; later versions arrive with
        ``replica.broadcast(group, src)``."""
        return _pool_replica.replica(cls, group, src, _device(device), kind, timeout, max_consumers)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The pool's tensors, by name (the producer's views of them)."""
        return dict(self._tensors)

    @property
    def version(self) -> int:
        """The last published version (0 before export)."""
        return self._native.version

    @property
    def consumers(self) -> int:
        """Consumer processes connected now."""
        return self._native.consumers

    def segments(self) -> List[Tuple[int, int]]:
        """(address, bytes) of each segment."""
        return self._native.segments()

    def stock_descriptor(self) -> dict:
        """The pool as stock PyTorch opens it (legacy kind, CUDA only): a
        dict of builtins only, picklable where this package is not
        installed. Per segment, the eight arguments of
        ``torch.UntypedStorage._new_shared_cuda``; per tensor, (segment,
        byte offset of its storage in the segment, dtype name, shape,
        stride, storage offset).

        Each call hands out new slots of PyTorch's ref-counter files, which
        the stock consumer gives back when its storages go: make one
        descriptor per consumer process. A stock consumer takes no part in
        the version protocol (it cannot acquire): it suits weights that no
        longer change, or readers that tolerate an update under them."""
        if self.kind != "legacy" or self.device.type != "cuda":
            raise InvalidArgumentError(
                f"stock PyTorch opens legacy-kind CUDA pools only; this pool is kind={self.kind!r} on {self.device}"
            )
        segments = self._native.segments()
        stock = self._native.stock_segments()
        tensors = {}
        for name, e in self._entries.items():
            index = next(i for i, (base, size) in enumerate(segments) if base <= e.storage_ptr < base + size)
            tensors[name] = (
                index,
                e.storage_ptr - segments[index][0],
                dtype_name(e.dtype),
                e.sizes,
                e.strides,
                e.storage_offset,
            )
        return {"format": STOCK_FORMAT, "device": self.device.index, "segments": [tuple(s) for s in stock], "tensors": tensors}

    def __reduce__(self):
        raise TypeError("a Pool stays in its process: send pool.export() (a WeightsHandle) to consumers")

    def __repr__(self) -> str:
        return f"<storage_sharing.cuda.Pool device={self.device} kind={self.kind} tensors={len(self._tensors)}>"


class Weights(Mapping):
    """A consumer's view of a producer's pool: name -> tensor over the
    producer's memory (no copy; views of one storage there are views of one
    storage here). The tensors keep the mapping alive, even past
    :meth:`close`.

    Reads are safe against updates only between :meth:`acquire` and
    :meth:`release` (or inside ``with weights.reading():``): the producer's
    next update waits for the release.

    Threads: the process holds one version for all its threads. A thread
    already reading enters ``reading()`` again at once, nested as deep as
    it likes; another thread joins the process's hold at once too, except
    while the producer waits to write, when it first lets the process's
    reads end (for at most 10 ms, then it joins: the read it waits for may
    be waiting for it). :meth:`close` waits for the other threads' reads to
    end and never drops a hold someone reads under.

    Writes: the tensors are the producer's memory. A consumer that writes
    them (``w[name] += 1``) changes them for the producer and every other
    consumer, with no new version: the pool's versions order the
    producer's writes only. ``is_shared()`` is True on them and
    ``share_memory_()`` leaves them where they are."""

    def __init__(self, native, device: torch.device) -> None:
        self._native = native
        self.device = device
        self._lock = threading.Condition()
        self._holds: Dict[int, int] = {}  # thread ident -> reads open
        self._closed_holds: Dict[int, int] = {}  # thread ident -> reads close() ended for it
        self._closing = False
        self._version = 0
        segments = native.segments()
        mapped: Dict[int, torch.UntypedStorage] = {}  # segment -> its bytes
        storages: Dict[int, torch.UntypedStorage] = {}  # storage entry -> its bytes
        self._tensors: Dict[str, torch.Tensor] = {}
        for name, entry, seg, ptr, nbytes, dt, sizes, strides, offset in native.tensors():
            storage = storages.get(entry)
            if storage is None:
                if nbytes == 0:  # no bytes, no segment
                    storage = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
                else:
                    base, size = segments[seg]
                    if seg not in mapped:
                        mapped[seg] = _pool_memory(bytes_at(base, size, device, native).untyped_storage())
                    storage = _pool_memory(storage_in(mapped[seg], ptr - base, nbytes))
                storages[entry] = storage
            self._tensors[name] = typed_view(storage, dtype_named(dt), sizes, strides, offset)

    def _live(self):
        if self._native is None:
            raise ClosedError("these weights are closed")
        return self._native

    def __getitem__(self, name: str) -> torch.Tensor:
        self._live()
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def acquire(self, timeout: Optional[float] = None) -> int:
        """Holds the current version (waiting, up to ``timeout`` seconds,
        while the producer writes; None = no limit); the current stream
        waits for its publish. Returns the version. Threads share the
        hold: each acquire needs its release."""
        with self._lock:
            if self._closing:
                raise ClosedError("these weights are being closed")
            native = self._live()
        v = native.acquire(_current_stream(self.device), timeout)
        with self._lock:
            if self._closing:
                # close() began meanwhile: it must not wait for a read that
                # never started.
                native.release(_current_stream(self.device))
                raise ClosedError("these weights are being closed")
            me = threading.get_ident()
            self._holds[me] = self._holds.get(me, 0) + 1
            self._version = v
        return v

    def release(self) -> None:
        """Lets the held version go, once the current stream's reads of it
        are done."""
        me = threading.get_ident()
        with self._lock:
            if self._closed_holds.get(me):
                # close() in this thread ended this read already.
                self._closed_holds[me] -= 1
                return
            native = self._live()
            whose = me if self._holds.get(me) else next(iter(self._holds), None)
            if whose is None:
                raise InvalidArgumentError("these weights hold no version: acquire() first")
            native.release(_current_stream(self.device))
            self._holds[whose] -= 1
            if not self._holds[whose]:
                del self._holds[whose]
            self._lock.notify_all()

    @contextlib.contextmanager
    def reading(self, timeout: Optional[float] = None) -> Iterator[int]:
        """``with weights.reading() as version:``: acquire, then release.
        Nests, in one thread and across the threads of the process."""
        version = self.acquire(timeout)
        try:
            yield version
        finally:
            self.release()

    @property
    def held(self) -> Optional[int]:
        """The version held now, or None."""
        return self._version if self._holds else None

    def check_producer(self) -> None:
        """Raises PeerGoneError once the producer is gone."""
        self._live().check_producer()

    @property
    def update_pending(self) -> bool:
        """Whether the producer waits to write, or writes, an update now
        (new reads wait for its publish, except those joining a read of
        this process)."""
        return self._live().update_pending

    def segments(self) -> List[Tuple[int, int]]:
        """Where each segment is mapped in this process: (address, bytes)."""
        return self._live().segments()

    @property
    def closed(self) -> bool:
        return self._native is None

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Lets go of the pool: the mapping and the connection to the
        producer go when the last tensor over them does. Waits (up to
        ``timeout`` seconds; None = no limit) for the reads other threads
        have open, refusing new ones meanwhile; the calling thread's own
        reads end here (their ``release`` then does nothing). Raises
        :class:`~storage_sharing.BusyError` when other threads still read
        after ``timeout``; the weights then stay open."""
        me = threading.get_ident()
        with self._lock:
            if self._native is None:
                return
            self._closing = True
            try:
                others = lambda: sum(n for t, n in self._holds.items() if t != me)  # noqa: E731
                if not self._lock.wait_for(lambda: others() == 0, timeout):
                    raise BusyError(
                        f"close(): {others()} read(s) of other threads still open after {timeout} s; "
                        f"the weights stay open (close again once they end)"
                    )
                self._end_reads()
            finally:
                self._closing = False

    def _end_reads(self) -> None:
        """Ends every read still open (the caller's), and closes."""
        native, stream = self._native, _current_stream(self.device)
        for thread, n in self._holds.items():
            for _ in range(n):
                native.release(stream)
            self._closed_holds[thread] = self._closed_holds.get(thread, 0) + n
        self._holds = {}
        self._native = None
        self._tensors = {}

    def __enter__(self) -> "Weights":
        return self

    def __del__(self) -> None:
        # A hold forgotten with this object would stall the producer's
        # updates for as long as a tensor keeps the connection open. No
        # thread can be reading: a read keeps this object alive.
        if getattr(self, "_holds", None) and self._native is not None:
            self._end_reads()

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("Weights stay in their process: send the WeightsHandle and open it there")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._tensors)} tensors"
        return f"<storage_sharing.cuda.Weights {state} device={self.device}>"


def _pool_memory(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """Marks a CPU storage over pool memory as shared memory (CUDA storages
    are already): ``is_shared()`` True, ``share_memory_()`` leaves it in
    place instead of moving it to a copy that updates would miss."""
    if storage.device.type == "cpu":
        from . import torch as _torch_hooks  # installs the is_shared/share_memory_ hooks

        setattr(storage, _torch_hooks.POOL_MARK, True)
    return storage


def open_weights(handle: Union[WeightsHandle, bytes], timeout: Optional[float] = 30.0) -> Weights:
    """Opens the pool ``handle`` names (made by :meth:`Pool.export` in
    another process): one connection to the producer and one mapping of
    each segment, whatever the number of tensors. Waits up to ``timeout``
    seconds for the producer (None = no limit)."""
    if isinstance(handle, WeightsHandle):
        data = bytes(handle)
    elif isinstance(handle, (bytes, bytearray, memoryview)):
        data = bytes(handle)
    else:
        raise InvalidArgumentError(f"open_weights takes a WeightsHandle (or its bytes), got {type(handle).__name__}")
    _, _, dev_type, index, _ = _native.pool_handle_info(data)
    device = torch.device("cpu") if dev_type == "cpu" else torch.device("cuda", index)
    return Weights(_native.CudaWeights(data, timeout), device)
