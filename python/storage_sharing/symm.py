"""Symmetric CPU memory for the processes of a torch.distributed group on
one host (PyTorch offers symmetric memory for CUDA only).

``symm.empty(shape, dtype)`` gives every rank a tensor in shared memory and
tensors over every peer's: a write to ``buf.peers[r]`` is a write to rank
``r``'s ``buf.tensor``. ``barrier()``, ``put_signal(dst)`` and
``wait_signal(src)`` synchronize through the block's signal pad, and a wait
that runs out of time raises ``TimeoutError`` naming the rank that did not
answer. ``all_reduce``, ``broadcast``, ``all_gather`` and
``all_gather_into_tensor`` run over a symmetric scratch buffer of the group;
an all_gather whose input lies in a symmetric tensor on every rank reads the
peers' inputs in place instead.

The ranks meet through the group's store: when it is a TCPStore, through
the library's own TCPStore client at its host and port; otherwise through
the Python store object itself. Every rank must make the same calls in the
same order (allocation and every collective are collective calls).

Every collective first checks that every rank passed the same call (size,
dtype, op, source rank): when they differ, or when one rank refuses its own
arguments (a cast, a sparse tensor, a wrong count), every rank raises an
error naming the ranks and what each passed, before any data moves, and
the group can be used for the next call.
"""

import contextlib
import ctypes
import itertools
import math
import operator
import weakref
from datetime import timedelta
from typing import List, NamedTuple, Optional, Sequence

import torch

from . import _native

__all__ = [
    "Group",
    "SymmTensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "empty",
    "join",
]

DEFAULT_TIMEOUT = 300.0
_SCRATCH_MIN = 1 << 16
_groups: dict = {}
_serial = itertools.count()


def _seconds(timeout) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _shape_of(shape) -> torch.Size:
    """``shape`` (an int or a sequence of ints) as a size, or an error
    naming what is wrong with it."""
    if isinstance(shape, int):
        shape = (shape,)
    try:
        size = torch.Size(shape)
    except TypeError as e:
        raise TypeError(f"symm.empty: shape must be an int or a sequence of ints, got {shape!r}") from e
    for i, d in enumerate(size):
        if d < 0:
            raise ValueError(f"symm.empty: dimension {i} of shape {tuple(size)} is negative ({d}); every size must be >= 0")
    return size


def _bytes_at(address: int, size: int, owner) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes at ``address``, keeping ``owner``."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    arr = (ctypes.c_ubyte * size).from_address(address)
    arr._owner = owner
    return torch.frombuffer(arr, dtype=torch.uint8)


class SymmTensor:
    """One symmetric allocation: ``tensor`` (this rank's) and ``peers``
    (every rank's, ``peers[rank]`` is ``tensor``), over the same memory in
    every process of the group."""

    def __init__(self, group: "Group", shape, dtype: torch.dtype):
        shape = _shape_of(shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"symm.empty: dtype must be a torch.dtype, got {dtype!r}")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        self.group = group
        self._block = _native.SymmBlock(max(nbytes, 1), group.name, group.timeout)
        self.rank = self._block.rank
        self.world_size = self._block.world_size
        buffers = [self._block.buffer_address(r) for r in range(self.world_size)]
        self.peers: List[torch.Tensor] = [_bytes_at(b, nbytes, self._block).view(dtype).view(shape) for b in buffers]
        self.tensor = self.peers[self.rank]
        # Allocations are collective calls, so this count names the
        # allocation alike on every rank.
        self.serial = next(group._serials)
        group._allocations[self.serial] = _Allocation(buffers, nbytes, weakref.ref(self._block))

    @property
    def channels(self) -> int:
        return self._block.channels

    def barrier(self, channel: int = 0, timeout=None) -> None:
        self._block.barrier(channel, self._timeout(timeout))

    def put_signal(self, dst: int, channel: int = 0, timeout=None) -> None:
        self._block.put_signal(dst, channel, self._timeout(timeout))

    def wait_signal(self, src: int, channel: int = 0, timeout=None) -> None:
        self._block.wait_signal(src, channel, self._timeout(timeout))

    def _timeout(self, timeout):
        return self.group.timeout if timeout is None else _seconds(timeout)

    def close(self) -> None:
        """Frees the block now; no tensor over it may be used afterwards
        (it is freed anyway when this object and its tensors are gone)."""
        self.peers = []
        self.tensor = None
        self.group._allocations.pop(self.serial, None)
        self._block.close()


class _Allocation:
    """What a group remembers of a symmetric allocation: where it lies on
    every rank, and its block while that lives (the tensors over it keep
    it, not this)."""

    __slots__ = ("buffers", "size", "block")

    def __init__(self, buffers: List[int], size: int, block: "weakref.ref"):
        self.buffers = buffers
        self.size = size
        self.block = block


class Group:
    """This process's view of a group of ranks on one host. Made by
    :func:`join`."""

    def __init__(self, name: str, rank: int, world_size: int, timeout: Optional[float]):
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._scratch: Optional[_native.SymmScratch] = None
        self._serials = itertools.count()
        self._allocations: dict = {}
        # How many all_gathers read the peers' inputs in place (for tests
        # and benchmarks).
        self.gathers_in_place = 0

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> SymmTensor:
        """A symmetric tensor of ``shape`` (every rank calls it alike)."""
        return SymmTensor(self, shape, dtype)

    def barrier(self, timeout=None) -> None:
        """A barrier that is also a collective call: it raises on every
        rank when another rank is in another collective."""
        self._scratch_block().barrier(self._timeout(timeout))

    def _timeout(self, timeout):
        return self.timeout if timeout is None else _seconds(timeout)

    def _symmetric_input(self, t: torch.Tensor, nbytes: int):
        """``(allocation, size, offset, buffers)`` when the ``nbytes`` at
        ``t`` lie in a live symmetric allocation of this group (its rank
        buffer), else None."""
        if nbytes == 0:
            return None
        at = t.data_ptr()
        for serial, a in list(self._allocations.items()):
            block = a.block()
            if block is None or block.closed:
                del self._allocations[serial]
                continue
            base = a.buffers[self.rank]
            if base <= at and at + nbytes <= base + a.size:
                return serial, a.size, at - base, a.buffers
        return None

    def _scratch_block(self) -> "_native.SymmScratch":
        """The group's scratch block; the first collective makes it at its
        smallest size (a collective call: alike on every rank, whatever
        each rank passed)."""
        if self._scratch is None:
            self._scratch = _native.SymmScratch(_SCRATCH_MIN, self.name, self.timeout)
        return self._scratch

    def _scratch_for(self, call: "_Call", timeout) -> "_native.SymmScratch":
        """The scratch block, grown until ``call`` fits. Growing is a
        collective call, so the ranks first check that they all make the
        same ``call`` (every rank raises when they do not)."""
        s = self._scratch_block()
        if s.capacity < call.nbytes:
            call.agree(s, timeout)
            size = max(_SCRATCH_MIN, 1 << max(0, call.nbytes - 1).bit_length())
            s.close()
            self._scratch = s = _native.SymmScratch(size, self.name, self.timeout)
        return s

    @contextlib.contextmanager
    def _refusals(self, kind: str, timeout):
        """Runs a collective's argument checks. When they refuse, every
        peer is told (its call raises, naming this rank, instead of waiting
        for a call this rank will not make), then the refusal is raised."""
        try:
            yield
        except Exception:
            try:
                self._scratch_block().refuse(kind, timeout)
            except Exception:  # this rank's own refusal is the error to raise
                pass
            raise


class _Call(NamedTuple):
    """What a rank passes to a collective; every rank must pass the same."""

    kind: str
    dtype: str
    numel: int
    itemsize: int
    op: Optional[str] = None
    root: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def agree(self, scratch, timeout, region=None) -> None:
        scratch.agree(self.kind, self.dtype, self.numel, self.itemsize, self.op, self.root, timeout, region)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _store_of(pg):
    from torch.distributed import distributed_c10d as c10d

    if pg is None:
        pg = c10d._get_default_group()
    return pg, c10d._world.pg_map[pg][1]


def join(group=None, *, store=None, rank: Optional[int] = None, world_size: Optional[int] = None, timeout=DEFAULT_TIMEOUT) -> Group:
    """The symmetric-memory group of a torch.distributed process group
    (the default one when ``group`` is None), or of ``store``, ``rank`` and
    ``world_size`` given directly. Every rank calls it alike. ``timeout``
    (seconds or timedelta; None waits forever) bounds the rendezvous and
    every wait."""
    if store is None:
        import torch.distributed as dist

        pg, store = _store_of(group)
        rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
        label = getattr(pg, "group_name", "") or "default"
    else:
        if rank is None or world_size is None:
            raise ValueError("join(store=...) needs rank and world_size")
        label = "store"
    key = (id(store), label, rank, world_size)
    found = _groups.get(key)
    if found is not None:
        return found
    name = f"storage_sharing.symm/{label}/{next(_serial)}"
    raw = store
    while hasattr(raw, "underlying_store"):
        raw = raw.underlying_store
    seconds = _seconds(timeout)
    import torch.distributed as dist

    if isinstance(raw, dist.TCPStore):
        _native.symm_group_tcp(name, rank, world_size, raw.host, raw.port, seconds)
    else:
        _native.symm_group_store(name, rank, world_size, store)
    g = Group(name, rank, world_size, seconds)
    _groups[key] = g
    return g


def empty(shape, dtype: torch.dtype = torch.float32, *, group=None) -> SymmTensor:
    """A symmetric tensor in the group of ``group`` (see :func:`join`)."""
    return _group(group).empty(shape, dtype)


def barrier(*, group=None, timeout=None) -> None:
    _group(group).barrier(timeout)


def _group(group) -> Group:
    return group if isinstance(group, Group) else join(group)


def _op_name(op) -> str:
    name = getattr(op, "name", None) or str(op)
    name = name.rsplit(".", 1)[-1].lower()
    if name not in ("sum", "max", "min", "product", "prod"):
        raise ValueError(f"unsupported reduce op {op!r} (sum, max, min, product)")
    return name


def _accumulate(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    if op == "sum":
        acc.add_(x)
    elif op == "max":
        torch.maximum(acc, x, out=acc)
    elif op == "min":
        torch.minimum(acc, x, out=acc)
    else:
        acc.mul_(x)


def _bounds(numel: int, ws: int, r: int):
    per = -(-numel // ws)
    return min(numel, r * per), min(numel, (r + 1) * per)


def _check_tensor(t, fn: str, what: str, written: bool = False) -> None:
    """Refuses, naming ``what`` and the reason, a tensor the collectives
    cannot move: not a tensor, not dense, not on the CPU, or (when written)
    with elements that share memory."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"symm.{fn}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        layout = str(t.layout).rsplit(".", 1)[-1]
        raise ValueError(f"symm.{fn}: {what} is a {layout} tensor; symmetric collectives take dense CPU tensors (use .to_dense())")
    if t.device.type != "cpu":
        raise ValueError(f"symm.{fn}: {what} is on {t.device}; symmetric collectives take CPU tensors")
    if written and torch._debug_has_internal_overlap(t) == 1:
        raise ValueError(f"symm.{fn}: {what} has elements that share memory (an expanded view?), so it cannot be written")


# The dtypes reduced in Rust; others go through torch (_all_reduce_torch).
_NATIVE_REDUCE = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def all_reduce(tensor: torch.Tensor, op="sum", *, group=None, timeout=None) -> torch.Tensor:
    """Reduces ``tensor`` across the group in place (sum, max, min,
    product): each rank reduces its slice from every peer's buffer, then
    every rank gathers the slices. Returns ``tensor``."""
    g = _group(group)
    t = g._timeout(timeout)
    tensor = _plain(tensor)
    with g._refusals("all_reduce", t):
        name = _op_name(op)
        _check_tensor(tensor, "all_reduce", "tensor", written=True)
    dtype_name = _NATIVE_REDUCE.get(tensor.dtype)
    if dtype_name is None:
        return _all_reduce_torch(g, tensor, name, t)
    flat = tensor if tensor.is_contiguous() else tensor.contiguous()
    n = flat.numel()
    s = g._scratch_for(_Call("all_reduce", dtype_name, n, flat.element_size(), op=name), t)
    s.all_reduce(flat.data_ptr(), flat.data_ptr(), n, dtype_name, name, t)
    if flat is not tensor:
        tensor.copy_(flat)
    return tensor


def _all_reduce_torch(g: Group, tensor: torch.Tensor, name: str, t) -> torch.Tensor:
    """all_reduce of a dtype without a native reduction (complex, bool,
    ...): the same two steps over the scratch block, reduced by torch."""
    flat = tensor.reshape(-1)
    n, itemsize = flat.numel(), flat.element_size()
    call = _Call("all_reduce", _dtype_name(flat.dtype), n, itemsize, op=name)
    s = g._scratch_for(call, t)
    off = s.next_region()
    bufs = [_bytes_at(s.buffer_address(r) + off, n * itemsize, s).view(flat.dtype) for r in range(g.world_size)]
    mine = bufs[g.rank]
    mine.copy_(flat)
    # The first barrier, which also checks that every rank made this call.
    call.agree(s, t, region=off)
    lo, hi = _bounds(n, g.world_size, g.rank)
    if hi > lo:
        # Only this rank reads its slice of every buffer, so it may
        # accumulate into its own.
        acc = mine[lo:hi]
        for p in range(g.world_size):
            if p != g.rank:
                _accumulate(acc, bufs[p][lo:hi], name)
    s.sync(t)
    out = torch.empty_like(flat)
    for p in range(g.world_size):
        plo, phi = _bounds(n, g.world_size, p)
        out[plo:phi].copy_(bufs[p][plo:phi])
    tensor.copy_(out.view(tensor.shape))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, *, group=None, timeout=None) -> torch.Tensor:
    """Copies rank ``src``'s ``tensor`` into every rank's. Returns it."""
    g = _group(group)
    t = g._timeout(timeout)
    tensor = _plain(tensor)
    with g._refusals("broadcast", t):
        _check_tensor(tensor, "broadcast", "tensor", written=True)
        try:
            src = operator.index(src)
        except TypeError:
            raise TypeError(f"symm.broadcast: the source rank must be an int, got {src!r}") from None
        if not 0 <= src < g.world_size:
            raise ValueError(f"symm.broadcast: source rank {src} is not in a group of {g.world_size}")
    flat = tensor if tensor.is_contiguous() else tensor.contiguous()
    call = _Call("broadcast", _dtype_name(flat.dtype), flat.numel(), flat.element_size(), root=src)
    g._scratch_for(call, t).broadcast(src, flat.data_ptr(), call.numel, call.dtype, call.itemsize, t)
    if flat is not tensor and g.rank != src:
        tensor.copy_(flat)
    return tensor


def _plain(t) -> torch.Tensor:
    """A SymmTensor's own tensor; any other tensor as it is."""
    return t.tensor if isinstance(t, SymmTensor) else t


def _check_outputs(fn: str, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> None:
    """Refuses outputs that are no dense CPU tensors, overlap themselves,
    or differ from ``input`` in dtype (as torch.distributed, no cast) or
    element count."""
    n = input.numel()
    for p, t in enumerate(outputs):
        what = "output" if fn == "all_gather_into_tensor" else f"output {p}"
        _check_tensor(t, fn, what, written=True)
        if t.dtype != input.dtype:
            raise ValueError(
                f"symm.{fn}: {what} has dtype {t.dtype} but the input has {input.dtype}; "
                "as torch.distributed with gloo, symmetric collectives do not cast"
            )
        if fn == "all_gather" and t.numel() != n:
            raise ValueError(f"output {p} has {t.numel()} elements; the input has {n}")


def _gather(g: Group, outputs: Sequence[torch.Tensor], input: torch.Tensor, t) -> None:
    """Every rank's ``input`` into ``outputs[rank]`` (checked: CPU, dense,
    of ``input``'s dtype and size): straight into the contiguous outputs,
    through a temporary into the others. An input in a symmetric tensor is
    read by the peers in place."""
    flat = input if input.is_contiguous() else input.contiguous()
    n, itemsize = flat.numel(), flat.element_size()
    direct = [o if o.is_contiguous() else torch.empty(n, dtype=flat.dtype) for o in outputs]
    call = _Call("all_gather", _dtype_name(flat.dtype), n, itemsize)
    scratch = g._scratch_for(call, t)
    outs = [o.data_ptr() for o in direct]
    if scratch.all_gather(flat.data_ptr(), n, call.dtype, itemsize, outs, t, g._symmetric_input(flat, call.nbytes)):
        g.gathers_in_place += 1
    for o, d in zip(outputs, direct):
        if d is not o:
            o.copy_(d.view(o.shape))


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group=None, timeout=None) -> torch.Tensor:
    """``output`` (world_size times ``input``'s elements, of its dtype)
    gets every rank's ``input`` in rank order. Returns ``output``."""
    g = _group(group)
    t = g._timeout(timeout)
    output, input = _plain(output), _plain(input)
    with g._refusals("all_gather", t):
        _check_tensor(input, "all_gather_into_tensor", "input")
        _check_outputs("all_gather_into_tensor", [output], input)
        n = input.numel()
        if output.numel() != n * g.world_size:
            raise ValueError(f"output has {output.numel()} elements; {g.world_size} ranks of {n} need {n * g.world_size}")
    whole = output if output.is_contiguous() else torch.empty(n * g.world_size, dtype=input.dtype)
    _gather(g, list(whole.view(g.world_size, n).unbind(0)), input, t)
    if whole is not output:
        output.copy_(whole.view(output.shape))
    return output


def all_gather(tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, *, group=None, timeout=None) -> List[torch.Tensor]:
    """``tensor_list[r]`` gets rank ``r``'s ``tensor`` (as
    ``torch.distributed.all_gather``; the outputs must have its dtype).
    Returns ``tensor_list``."""
    g = _group(group)
    t = g._timeout(timeout)
    with g._refusals("all_gather", t):
        tensor_list = [_plain(x) for x in tensor_list]
        tensor = _plain(tensor)
        _check_tensor(tensor, "all_gather", "tensor")
        if len(tensor_list) != g.world_size:
            raise ValueError(f"tensor_list has {len(tensor_list)} tensors for {g.world_size} ranks")
        _check_outputs("all_gather", tensor_list, tensor)
    _gather(g, tensor_list, tensor, t)
    return list(tensor_list)
