"""Tensors over memory a pool maps at a known address, with no copy.

A segment becomes one uint8 tensor over its bytes, whose storage keeps the
native owner (the pool or the opened weights) alive; each storage entry of
the manifest is a slice of that storage (a storage of its own sharing the
memory), and each named tensor a typed view of its entry's storage
(``set_`` with the manifest's dtype, sizes, strides and offset). So tensors
that were views of one storage in the producer are views of one storage
here too, and a tensor's storage is its own entry, not the whole segment.

* CPU (the host backend): a ctypes byte array at the address, read by
  ``torch.frombuffer`` (which keeps the array, and so the owner, alive).
* CUDA: an object exposing ``__cuda_array_interface__`` at the address,
  read by ``torch.as_tensor`` (PyTorch keeps that object alive as long as
  the storage; the object keeps the owner).
"""

import ctypes
from typing import Sequence

import torch


class _DeviceBytes:
    """``nbytes`` bytes of CUDA memory at ``address``, as the CUDA array
    interface describes them (version 3, no stream: the pool's version
    protocol orders the reads, not this interface)."""

    __slots__ = ("__cuda_array_interface__", "_owner")

    def __init__(self, address: int, nbytes: int, owner) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        self._owner = owner


def bytes_at(address: int, nbytes: int, device: torch.device, owner) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` bytes at ``address`` on ``device``
    (cpu or cuda:N), whose storage keeps ``owner`` alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        array = (ctypes.c_ubyte * nbytes).from_address(address)
        array._owner = owner
        return torch.frombuffer(array, dtype=torch.uint8)
    if device.type == "cuda":
        with torch.cuda.device(device):
            t = torch.as_tensor(_DeviceBytes(address, nbytes, owner), device=device)
        if t.data_ptr() != address:
            # as_tensor copies when it places the memory on another device:
            # a copy would be silently stale after the next update.
            raise RuntimeError(f"CUDA memory at {address:#x} is not on {device} as the pool says (torch put it on {t.device})")
        return t
    raise ValueError(f"pool tensors live on cpu or cuda, not {device}")


def storage_in(segment: torch.UntypedStorage, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage of its own over ``nbytes`` bytes at ``offset`` in
    ``segment`` (a slice of an untyped storage shares its memory and keeps
    it alive): one per storage entry, with no cost per segment byte."""
    if offset < 0 or nbytes <= 0 or offset + nbytes > segment.nbytes():
        raise ValueError(f"a storage of {nbytes} bytes at offset {offset} lies outside its segment of {segment.nbytes()} bytes")
    return segment[offset : offset + nbytes]


def typed_view(
    base, dtype: torch.dtype, sizes: Sequence[int], strides: Sequence[int], storage_offset: int
) -> torch.Tensor:
    """A ``dtype`` tensor over ``base`` (a tensor's storage, or an untyped
    storage); ``set_`` checks that it stays inside it."""
    storage = base.untyped_storage() if isinstance(base, torch.Tensor) else base
    t = torch.empty(0, dtype=dtype, device=storage.device)
    return t.set_(storage, storage_offset, tuple(sizes), tuple(strides))


def dtype_named(name: str) -> torch.dtype:
    """``torch.<name>``, or an error naming the dtype this torch lacks."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"this torch ({torch.__version__}) has no dtype torch.{name}")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")
