"""Symmetric CPU memory for the processes of a torch.distributed group on
one host (PyTorch offers symmetric memory for CUDA only).

``symm.empty(shape, dtype)`` gives every rank a tensor in shared memory and
tensors over every peer's: a write to ``buf.peers[r]`` is a write to rank
``r``'s ``buf.tensor``. ``barrier()``, ``put_signal(dst)`` and
``wait_signal(src)`` synchronize through the block's signal pad, and a wait
that runs out of time raises ``TimeoutError`` naming the rank that did not
answer. ``all_reduce``, ``broadcast``, ``all_gather`` and
``all_gather_into_tensor`` run over a symmetric scratch buffer of the group.

The ranks meet through the group's store: when it is a TCPStore, through
the library's own TCPStore client at its host and port; otherwise through
the Python store object itself. Every rank must make the same calls in the
same order (allocation and every collective are collective calls).
"""

import ctypes
import itertools
import math
from datetime import timedelta
from typing import List, Optional, Sequence

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
        shape = torch.Size(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        self.group = group
        self._block = _native.SymmBlock(max(nbytes, 1), group.name, group.timeout)
        self.rank = self._block.rank
        self.world_size = self._block.world_size
        self.peers: List[torch.Tensor] = [
            _bytes_at(self._block.buffer_address(r), nbytes, self._block).view(dtype).view(shape) for r in range(self.world_size)
        ]
        self.tensor = self.peers[self.rank]

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
        self._block.close()


class Group:
    """This process's view of a group of ranks on one host. Made by
    :func:`join`."""

    def __init__(self, name: str, rank: int, world_size: int, timeout: Optional[float]):
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._scratch: Optional[SymmTensor] = None

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> SymmTensor:
        """A symmetric tensor of ``shape`` (every rank calls it alike)."""
        return SymmTensor(self, shape, dtype)

    def barrier(self, timeout=None) -> None:
        self._scratch_bytes(1).barrier(0, timeout)

    def _scratch_bytes(self, nbytes: int) -> SymmTensor:
        s = self._scratch
        if s is None or s.tensor.numel() < nbytes:
            size = max(_SCRATCH_MIN, 1 << max(0, nbytes - 1).bit_length())
            if s is not None:
                s.close()
            self._scratch = s = SymmTensor(self, (size,), torch.uint8)
        return s

    def _views(self, dtype: torch.dtype, numel: int):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        s = self._scratch_bytes(numel * itemsize)
        return s, [p[: numel * itemsize].view(dtype) for p in s.peers]


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


def _flat_in(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(f"symmetric collectives take CPU tensors, got one on {t.device}")
    return t.reshape(-1)


def all_reduce(tensor: torch.Tensor, op="sum", *, group=None, timeout=None) -> torch.Tensor:
    """Reduces ``tensor`` across the group in place (sum, max, min,
    product): each rank reduces its slice from every peer's buffer, then
    every rank gathers the slices. Returns ``tensor``."""
    g = _group(group)
    name = _op_name(op)
    flat = _flat_in(tensor)
    s, bufs = g._views(flat.dtype, flat.numel())
    mine = bufs[g.rank]
    mine.copy_(flat)
    s.barrier(0, timeout)
    lo, hi = _bounds(flat.numel(), g.world_size, g.rank)
    if hi > lo:
        # Only this rank reads its slice of every buffer, so it may
        # accumulate into its own.
        acc = mine[lo:hi]
        for p in range(g.world_size):
            if p != g.rank:
                _accumulate(acc, bufs[p][lo:hi], name)
    s.barrier(0, timeout)
    out = torch.empty_like(flat) if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous() else flat
    for p in range(g.world_size):
        plo, phi = _bounds(flat.numel(), g.world_size, p)
        if phi > plo:
            out[plo:phi].copy_(bufs[p][plo:phi])
    s.barrier(0, timeout)
    if out is not flat:
        tensor.copy_(out.view(tensor.shape))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, *, group=None, timeout=None) -> torch.Tensor:
    """Copies rank ``src``'s ``tensor`` into every rank's. Returns it."""
    g = _group(group)
    flat = _flat_in(tensor)
    s, bufs = g._views(flat.dtype, flat.numel())
    if g.rank == src:
        bufs[src].copy_(flat)
    s.barrier(0, timeout)
    if g.rank != src:
        tensor.copy_(bufs[src].view(tensor.shape))
    s.barrier(0, timeout)
    return tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group=None, timeout=None) -> torch.Tensor:
    """``output`` (world_size times ``input``'s elements) gets every rank's
    ``input`` in rank order. Returns ``output``."""
    g = _group(group)
    flat = _flat_in(input)
    n = flat.numel()
    if output.numel() != n * g.world_size:
        raise ValueError(f"output has {output.numel()} elements; {g.world_size} ranks of {n} need {n * g.world_size}")
    s, bufs = g._views(flat.dtype, n)
    bufs[g.rank].copy_(flat)
    s.barrier(0, timeout)
    out = output.view(g.world_size, n) if output.is_contiguous() else torch.empty(g.world_size, n, dtype=output.dtype)
    for p in range(g.world_size):
        out[p].copy_(bufs[p])
    s.barrier(0, timeout)
    if out.data_ptr() != output.data_ptr():
        output.copy_(out.view(output.shape))
    return output


def all_gather(tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, *, group=None, timeout=None) -> List[torch.Tensor]:
    """``tensor_list[r]`` gets rank ``r``'s ``tensor`` (as
    ``torch.distributed.all_gather``). Returns ``tensor_list``."""
    g = _group(group)
    if len(tensor_list) != g.world_size:
        raise ValueError(f"tensor_list has {len(tensor_list)} tensors for {g.world_size} ranks")
    flat = _flat_in(tensor)
    s, bufs = g._views(flat.dtype, flat.numel())
    bufs[g.rank].copy_(flat)
    s.barrier(0, timeout)
    for p, t in enumerate(tensor_list):
        t.copy_(bufs[p].view(t.shape))
    s.barrier(0, timeout)
    return list(tensor_list)

