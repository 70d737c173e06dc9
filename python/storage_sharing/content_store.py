"""A drop-in for ``torch.utils._content_store``, backed by the library.

Same names, signatures and return values as PyTorch's module; the files
are PyTorch's (each side reads what the other wrote). What differs:

* hashing and writing run natively with the GIL released; the default
  (non-stable) hash is PyTorch's value computed without torch.compile,
  on all cores for big storages;
* ``write_tensor`` copies the storage's bytes and returns: the copies are
  hashed on all cores and written in the background, one stored while
  the next are hashed. Our readers of the same folder in this process
  wait for that work; anything else sees the files after ``flush()``,
  ``close()`` or the writer's deletion. A background error is raised by
  the next ``write_tensor``, ``flush()`` or ``close()``;
* a store may be reopened and added to, by several writers at once;
* reading copies the stored bytes into a fresh CPU storage once (no
  unpickling), checking them against their zip record's CRC-32 on the way:
  a damaged storage file raises ``Error`` (kind ``Corrupt``), where
  PyTorch's reader returns the damaged bytes; entries are parsed by a
  restricted reader, and an entry it cannot parse is handed, as the bytes
  read, to ``torch.load(weights_only=True)``. Names are checked as the
  library checks them: a name that leaves ``tensors/`` (``..``, an
  absolute path) or an entry that is a link or not a regular file is
  refused with ``Error``, never read through PyTorch's loader;
* ``hash_storage`` also takes a tensor (its whole storage).

Storages not on the CPU are hashed by PyTorch's own ``hash_storage`` for
the default mode (its value there depends on the device's generator) and
copied to the CPU to be written.
"""

import atexit
import io
import os
import warnings
import weakref
from collections import defaultdict
from typing import Dict, Optional

import torch
import torch._utils
from torch.multiprocessing.reductions import StorageWeakRef

from . import _native
from ._errors import Error

__all__ = ["ContentStoreReader", "ContentStoreWriter", "hash_storage"]

# The element types the library's entry format names; others take
# PyTorch's own path for the entry (the storage is still written natively).
# By name: older PyTorch releases lack some (uint16, uint32, uint64 came in
# 2.3), and no tensor of theirs can have a type they lack.
_NATIVE_DTYPES = {
    getattr(torch, name)
    for name in (
        "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
        "complex32", "complex64", "complex128", "bool", "bfloat16", "float8_e5m2",
        "float8_e4m3fn", "uint16", "uint32", "uint64",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}  # fmt: skip


# Writers with a native half, so that a reader of the same folder can wait
# for what they still have queued.
_live_writers: "weakref.WeakSet[ContentStoreWriter]" = weakref.WeakSet()


@atexit.register
def _flush_live_writers() -> None:
    # A writer kept alive until exit (a module global, a cycle) may never
    # see __del__: its queued tensors are written here, before the
    # interpreter goes.
    for w in list(_live_writers):
        w.__del__()


def _wait_for_writers(real_loc: str) -> None:
    for w in list(_live_writers):
        if w._real_loc == real_loc and w._native is not None:
            w._native.wait_idle()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)[len("torch.") :]


def _as_untyped(storage) -> torch.UntypedStorage:
    # PyTorch's hash_storage takes an UntypedStorage only (a tensor fails
    # in it with "'int' object is not callable"); we also take a tensor,
    # as its whole storage (the storage write_tensor names), and a
    # TypedStorage.
    if isinstance(storage, torch.UntypedStorage):
        return storage
    if isinstance(storage, torch.Tensor):
        return storage.untyped_storage()
    if isinstance(storage, torch.TypedStorage):
        return storage.untyped()
    raise TypeError(f"hash_storage takes a torch.UntypedStorage, a TypedStorage or a tensor, not {type(storage).__name__}")


def hash_storage(storage: torch.UntypedStorage, *, stable_hash: bool = False) -> str:
    """Hex digest of the storage's bytes: SHA-1 with ``stable_hash``,
    otherwise PyTorch's default hash (the same value PyTorch computes).
    A tensor is hashed as its whole untyped storage."""
    storage = _as_untyped(storage)
    if storage.device.type != "cpu":
        if not stable_hash:
            from torch.utils._content_store import hash_storage as torch_hash

            return torch_hash(storage, stable_hash=False)
        storage = storage.cpu()
    return _native.content_hash(storage.data_ptr(), storage.nbytes(), bool(stable_hash))


class ContentStoreWriter:
    """Writes ``storages/<hash>`` (``torch.save`` of the storage) and
    ``tensors/<name>`` (``torch.save`` of the view's metadata) under ``loc``."""

    def __init__(self, loc: str, stable_hash: bool = False) -> None:
        self.loc: str = loc
        self._seen: set = set()
        self.stable_hash = stable_hash
        self._native: Optional[_native.ContentWriter] = None
        self._real_loc = ""

    @property
    def seen_storage_hashes(self) -> set:
        """Hashes of the storages written or found (queued work included)."""
        if self._native is not None:
            self._native.wait_idle()
            self._seen.update(self._native.take_hashes())
        return self._seen

    @seen_storage_hashes.setter
    def seen_storage_hashes(self, value: set) -> None:
        self._seen = value

    def _writer(self) -> "_native.ContentWriter":
        if self._native is None:
            self._native = _native.ContentWriter(os.fspath(self.loc))
            self._real_loc = os.path.realpath(self.loc)
            _live_writers.add(self)
        return self._native

    def flush(self) -> None:
        """Waits until every tensor written so far is in the folder; raises
        the first error of that background work."""
        if self._native is not None:
            self._native.flush()

    def close(self) -> None:
        """flush(), then lets go of the store."""
        self.flush()
        self._native = None

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is None:
            return
        try:
            native.flush()
        except Exception as e:  # nothing may leave __del__; at exit, modules may be gone
            if warnings is not None:
                warnings.warn(f"ContentStoreWriter({self.loc!r}): queued tensors failed to be written: {e}", RuntimeWarning, stacklevel=1)

    def write_storage(self, storage: torch.UntypedStorage) -> str:
        if storage.device.type == "cpu":
            h = self._writer().write_storage(storage.data_ptr(), storage.nbytes(), bool(self.stable_hash))
        else:
            h = hash_storage(storage, stable_hash=self.stable_hash)
            cpu = storage.cpu()
            self._writer().write_storage_hashed(h, cpu.data_ptr(), cpu.nbytes())
        self._seen.add(h)
        return h

    def compute_tensor_metadata(self, t: torch.Tensor, h=None):
        if h is None:
            h = hash_storage(t.untyped_storage(), stable_hash=self.stable_hash)
        return (t.dtype, h, t.storage_offset(), t.shape, t.stride(), torch._utils.get_tensor_metadata(t))

    def write_tensor(self, name: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        extra = torch._utils.get_tensor_metadata(t)
        if storage.device.type == "cpu" and not extra and t.dtype in _NATIVE_DTYPES:
            h = self._writer().submit_tensor(
                name,
                storage.data_ptr(),
                storage.nbytes(),
                bool(self.stable_hash),
                _dtype_name(t.dtype),
                t.storage_offset(),
                list(t.shape),
                list(t.stride()),
            )
            if h is not None:
                self._seen.add(h)
            return
        # Conjugate/negative views, other dtypes and devices: PyTorch's
        # entry, our storage file.
        h = self.write_storage(storage)
        d, f = os.path.split(name)
        folder = os.path.join(self.loc, "tensors", d)
        os.makedirs(folder, exist_ok=True)
        torch.save(self.compute_tensor_metadata(t, h=h), os.path.join(folder, f))


class ContentStoreReader:
    """Reads a store written by either module. With ``cache`` (the
    default), a storage read again while a tensor over it lives is the same
    storage, so views read from one storage stay views of one storage."""

    def __init__(self, loc: str, *, cache=True) -> None:
        self.loc = loc
        self.storage_cache: Optional[Dict[Optional[torch.device], Dict[str, StorageWeakRef]]] = None
        if cache:
            self.storage_cache = defaultdict(dict)
        self._native: Optional[_native.ContentReader] = None
        self._real_loc = os.path.realpath(loc)

    def _reader(self) -> "_native.ContentReader":
        # Tensors a writer of this folder still has queued come first.
        _wait_for_writers(self._real_loc)
        if self._native is None:
            self._native = _native.ContentReader(os.fspath(self.loc))
        return self._native

    def read_storage(self, h: str, *, device=None) -> torch.UntypedStorage:
        if device is not None:
            device = torch.device(device)
        ws = self.storage_cache[device].get(h) if self.storage_cache is not None else None
        if ws is not None:
            s = torch.UntypedStorage._new_with_weak_ptr(ws.cdata)
            if s is not None:
                return s
        stored = self._reader().open_storage(h)
        s = torch.UntypedStorage(stored.nbytes)
        stored.copy_to(s.data_ptr(), s.nbytes())
        del stored
        if device is not None and device.type != "cpu":
            s = torch.empty(0, dtype=torch.uint8).set_(s).to(device).untyped_storage()
        if self.storage_cache is not None:
            self.storage_cache[device][h] = StorageWeakRef(s)
        return s

    def read_tensor_metadata(self, name: str):
        reader = self._reader()
        try:
            dtype, h, offset, shape, stride, conj, neg = reader.read_meta(name)
        except Error:
            # A name that leaves tensors/, a link, a FIFO, a missing entry:
            # refused again here (NotFoundError is a FileNotFoundError, as
            # PyTorch raises). Only an entry read safely whose contents our
            # parser does not take goes to PyTorch's loader, weights only,
            # from the bytes read (never by path, which could lead elsewhere).
            raw = reader.read_entry_bytes(name)
            return torch.load(io.BytesIO(raw), weights_only=True)
        # PyTorch's tensor metadata: the lazy bits that are set, and no others.
        metadata = {key: True for key, bit in (("conj", conj), ("neg", neg)) if bit}
        return (getattr(torch, dtype), h, offset, torch.Size(shape), tuple(stride), metadata)

    def read_tensor(self, name: str, *, device=None) -> torch.Tensor:
        dtype, h, storage_offset, size, stride, metadata = self.read_tensor_metadata(name)
        storage = self.read_storage(h, device=device)
        t = torch.tensor([], dtype=dtype, device=storage.device)
        t.set_(storage, storage_offset, size, stride)
        torch._utils.set_tensor_metadata(t, metadata)
        return t
