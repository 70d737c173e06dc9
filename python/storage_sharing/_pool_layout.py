"""How a state dict's tensors go into a pool: grouped by the storage they
view, so that views of one storage stay views of one storage.

For each storage only the bytes its tensors reach are copied (a small slice
of a large buffer does not bring the whole buffer along): the span from the
first byte any of them reads to the last, its start rounded down to 64
bytes so that every tensor's offset stays a whole number of its elements.
"""

from typing import Dict, List, Mapping, Tuple

import torch

from ._errors import InvalidArgumentError

# What the pool's manifest carries (c10 scalar types the library knows).
SUPPORTED_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
        torch.bool,
        torch.bfloat16,
        torch.float8_e5m2,
        torch.float8_e4m3fn,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)

_SPAN_ALIGN = 64


def byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """[start, end) of the bytes of its storage that ``t`` reads; empty
    (start == end) for a tensor without elements."""
    item = t.element_size()
    start = t.storage_offset() * item
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * item


class Member:
    """One named tensor of a storage group, placed relative to the span."""

    __slots__ = ("name", "tensor", "storage_offset")

    def __init__(self, name: str, tensor: torch.Tensor, storage_offset: int) -> None:
        self.name = name
        self.tensor = tensor
        self.storage_offset = storage_offset  # elements from the span's start


class StorageGroup:
    """The tensors of a state dict that view one storage, and the span of
    its bytes they reach."""

    __slots__ = ("storage", "lo", "hi", "members")

    def __init__(self, storage: torch.UntypedStorage, lo: int, hi: int, members: List[Member]) -> None:
        self.storage = storage
        self.lo = lo
        self.hi = hi
        self.members = members

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def source_bytes(self) -> torch.Tensor:
        """The span as a uint8 tensor over the original storage."""
        t = torch.empty(0, dtype=torch.uint8, device=self.storage.device)
        return t.set_(self.storage, self.lo, (self.nbytes,), (1,))


def checked(name, t) -> torch.Tensor:
    """``t`` if the pool can carry it, else an error naming it and why.
    Conjugate and negative views are resolved into storages of their own."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"state dict keys must be str, got {type(name).__name__} {name!r}")
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name!r} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"tensor {name!r} has layout {t.layout}: the pool carries strided tensors only")
    if t.is_quantized or t.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"tensor {name!r} has dtype {t.dtype}, which the pool does not carry")
    if t.device.type == "meta":
        raise InvalidArgumentError(f"tensor {name!r} is on the meta device: it has no data to share")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.detach()


def group_by_storage(state_dict: Mapping[str, torch.Tensor]) -> List[StorageGroup]:
    """The state dict's tensors, grouped by the storage they view, in the
    order of their first appearance."""
    groups: Dict[object, List[Tuple[str, torch.Tensor]]] = {}
    for name, t in state_dict.items():
        t = checked(name, t)
        storage = t.untyped_storage()
        # Storages are one when their memory is one; storages without data
        # all have address 0, so each is a group of its own.
        key = (t.device, storage.data_ptr()) if storage.data_ptr() else object()
        groups.setdefault(key, []).append((name, t))
    out = []
    for members in groups.values():
        extents = [byte_extent(t) for _, t in members]
        reached = [(s, e) for s, e in extents if e > s]
        lo = min(s for s, _ in reached) // _SPAN_ALIGN * _SPAN_ALIGN if reached else 0
        hi = max(e for _, e in reached) if reached else 0
        placed = []
        for (name, t), (s, _) in zip(members, extents):
            offset = (s - lo) // t.element_size() if t.numel() else 0
            placed.append(Member(name, t, offset))
        out.append(StorageGroup(members[0][1].untyped_storage(), lo, hi, placed))
    return out
