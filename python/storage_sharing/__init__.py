"""storage_sharing: tensors born in shared memory and shared in O(1).

The library (Rust) behind PyTorch-compatible shared-memory allocators and a
shareable arena, with Python objects over it:

* :class:`Arena` -- a producer's arena; :meth:`Arena.alloc` gives a
  :class:`Block` (a buffer: ``block.memoryview()``, ``numpy.frombuffer(block)``,
  ``torch.frombuffer(block)``, no copy), :meth:`Block.share` a
  :class:`Handle` (112 bytes, picklable) another process opens once with
  :func:`open_shared` / :func:`open_remote` into a :class:`RemoteBlock`.
* :class:`MapAllocator`, :class:`RefcountedMapAllocator` -- ATen's
  allocators by name and flags, as buffers.
* :func:`spawn_manager`, :class:`ManagerClient` -- the shared-memory manager
  (the ``ss_shm_manager`` the wheel installs, unless ``SS_SHM_MANAGER``
  names another).
* :mod:`storage_sharing.torch` -- ``enable()`` puts torch.multiprocessing
  and DataLoader workers on the arena.

Errors are :class:`Error` subclasses that also derive from the fitting
builtin (FileNotFoundError, PermissionError, TimeoutError, OSError with
errno ENOSPC, ValueError, ...). Calls that can block release the GIL.
"""

import os as _os
from typing import Optional, Tuple

from . import _native
from ._installed_tools import installed_script as _installed_script
from ._buffers import BufferMixin as _BufferMixin
from ._buffers import wrap as _wrap
from ._errors import (
    AlreadyExistsError,
    ClosedError,
    Error,
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    PeerGoneError,
    PermissionDeniedError,
    TooManyFilesError,
    WaitTimeoutError,
)
from ._native import (
    ALLOCATOR_MAPPED_EXCLUSIVE,
    ALLOCATOR_MAPPED_FROMFD,
    ALLOCATOR_MAPPED_KEEPFD,
    ALLOCATOR_MAPPED_NOCREATE,
    ALLOCATOR_MAPPED_SHARED,
    ALLOCATOR_MAPPED_SHAREDMEM,
    ALLOCATOR_MAPPED_UNLINK,
    HANDLE_SIZE,
    Handle,
    ManagerClient,
    has_segment,
    remote_cache_size,
    spawn_manager,
    trim_remote_cache,
)

__version__ = "0.2.0"

# The manager daemon the wheel installed is the one this package starts,
# on PATH or not (SS_SHM_MANAGER, when set, still names another).
if not _os.environ.get("SS_SHM_MANAGER"):
    _manager = _installed_script("ss_shm_manager")
    if _manager is not None:
        _native.set_manager_binary(str(_manager))


class Block(_BufferMixin):
    """A block of an :class:`Arena`: a writable buffer of ``len(block)``
    bytes in shared memory. Freed when the last reference to it (or to a
    memoryview / tensor over it) goes, or by :meth:`free`."""

    __slots__ = ()

    @property
    def freed(self) -> bool:
        return self._native.freed

    def share(self) -> Handle:
        """One hold on this block, as a :class:`Handle` that another
        process opens once. The block is not reused before that process
        lets go of it (or dies)."""
        return self._native.share()

    def free(self) -> None:
        """Frees the block now. Nothing may use its bytes afterwards
        (memoryviews or tensors over it included)."""
        self._native.free()

    def __enter__(self) -> "Block":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"<storage_sharing.Block size={self.size} address={self.address:#x}>"


class RemoteBlock(_BufferMixin):
    """A block another process shared, opened here: a writable buffer over
    the producer's memory (no copy). Holds the block until it is gone."""

    __slots__ = ()

    @property
    def producer_pid(self) -> int:
        return self._native.producer_pid

    def __repr__(self) -> str:
        return f"<storage_sharing.RemoteBlock size={self.size} producer={self.producer_pid}>"


class Arena:
    """A producer's shareable arena.

    ``strategy="fd"`` (default) makes memfd segments: nothing in /dev/shm,
    gone with the last process that maps them; consumers get a segment's
    descriptor once (from :func:`open_shared`, :func:`recv_block` or
    :func:`import_segment_fd`). ``strategy="name"`` makes
    ``/dev/shm/ss_arena_*`` objects a consumer opens by name.
    """

    def __init__(
        self,
        segment_size: Optional[int] = None,
        strategy: str = "fd",
        max_holds: Optional[int] = None,
        large_threshold: Optional[int] = None,
    ) -> None:
        self._native = _native.Arena(segment_size, strategy, max_holds, large_threshold)

    def alloc(self, size: int, align: int = 64) -> Block:
        """A block of ``size`` bytes aligned to ``align`` (a power of two
        up to 4096). A full /dev/shm raises ``OSError(errno.ENOSPC)``."""
        native = self._native.alloc(size, align)
        return _wrap(Block, native, size)

    def share(self, block: Block) -> Handle:
        return block.share()

    def unshare(self, handle: Handle) -> None:
        """Cancels a share that will never be opened."""
        self._native.unshare(handle)

    def segment_fd(self, segment_id: int) -> int:
        """A by-fd segment's descriptor (owned by the arena: do not close)."""
        return self._native.segment_fd(segment_id)

    def collect(self) -> Tuple[int, int]:
        """Releases holds of consumers that died; (reclaimed, recycled)."""
        return self._native.collect()

    def stats(self) -> dict:
        return self._native.stats()

    @property
    def strategy(self) -> str:
        return self._native.strategy

    @property
    def closed(self) -> bool:
        return self._native.closed

    def fd_server_address(self) -> str:
        """Where this process hands out segment descriptors (by fd)."""
        return self._native.fd_server_address()

    def close(self) -> None:
        """Gives the arena up; its segments go with their last block."""
        self._native.close()

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"strategy={self.strategy!r}"
        return f"<storage_sharing.Arena {state}>"


def _remote(native) -> RemoteBlock:
    return _wrap(RemoteBlock, native, native.size)


def open_remote(handle: Handle) -> RemoteBlock:
    """Opens a shared block whose segment is by name or mapped here already."""
    return _remote(_native.open_remote(handle))


def open_shared(handle: Handle, address: str, timeout: float = 30.0) -> RemoteBlock:
    """Opens a shared block, asking the producer's fd server at ``address``
    (its :meth:`Arena.fd_server_address`) for the segment's descriptor the
    first time this process meets that segment."""
    return _remote(_native.open_shared(handle, address, timeout))


def import_segment_fd(handle: Handle, fd: int) -> None:
    """Maps the by-fd segment of ``handle`` from ``fd`` (a duplicate is
    taken: the caller keeps and closes ``fd``)."""
    _native.import_segment_fd(handle, fd)


def send_block(arena: Arena, sock, block: Block) -> None:
    """Shares ``block`` and sends it over a connected Unix stream socket
    (an object with ``fileno()`` or an fd); the segment's descriptor goes
    the first time this peer gets that segment."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    _native.send_block(arena._native, fd, block._native)


def recv_block(sock) -> RemoteBlock:
    """Receives and opens one block sent by :func:`send_block`."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    return _remote(_native.recv_block(fd))


class _MapBase(_BufferMixin):
    __slots__ = ()

    def __init__(self, *args, **kwargs) -> None:
        pass  # made by __new__; the ctypes array must not see the arguments

    @property
    def filename(self) -> str:
        return self._native.filename

    @property
    def flags(self) -> int:
        return self._native.flags

    @property
    def closed(self) -> bool:
        return self._native.closed

    def close(self) -> None:
        """Unmaps now. Nothing may use the bytes afterwards."""
        self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MapAllocator(_MapBase):
    """ATen's ``MapAllocator(name, flags, size)``: a shared file or shm
    object mapped, as a writable buffer of ``size`` bytes."""

    __slots__ = ()

    def __new__(cls, name: str, flags: int, size: int):
        return _wrap(MapAllocator, _native.MapAllocator(name, flags, size), size)

    def fd(self) -> int:
        return self._native.fd()

    def __repr__(self) -> str:
        return f"<storage_sharing.MapAllocator {self.filename!r} size={self.size}>"


class RefcountedMapAllocator(_MapBase):
    """ATen's ``RefcountedMapAllocator``: a shm object whose first 64 bytes
    hold a cross-process count; the buffer is the ``size`` bytes after it.
    The last process to close it removes the name."""

    __slots__ = ()

    def __new__(cls, name: str, flags: int, size: int):
        return _wrap(RefcountedMapAllocator, _native.RefcountedMapAllocator(name, flags, size), size)

    def refcount(self) -> int:
        return self._native.refcount()

    def incref(self) -> None:
        self._native.incref()

    def decref(self) -> bool:
        return self._native.decref()

    def __repr__(self) -> str:
        return f"<storage_sharing.RefcountedMapAllocator {self.filename!r} size={self.size}>"


__all__ = [
    "ALLOCATOR_MAPPED_EXCLUSIVE",
    "ALLOCATOR_MAPPED_FROMFD",
    "ALLOCATOR_MAPPED_KEEPFD",
    "ALLOCATOR_MAPPED_NOCREATE",
    "ALLOCATOR_MAPPED_SHARED",
    "ALLOCATOR_MAPPED_SHAREDMEM",
    "ALLOCATOR_MAPPED_UNLINK",
    "HANDLE_SIZE",
    "AlreadyExistsError",
    "Arena",
    "Block",
    "ClosedError",
    "Error",
    "Handle",
    "InvalidArgumentError",
    "ManagerClient",
    "MapAllocator",
    "NoSpaceError",
    "NotFoundError",
    "PeerGoneError",
    "PermissionDeniedError",
    "RefcountedMapAllocator",
    "RemoteBlock",
    "TooManyFilesError",
    "WaitTimeoutError",
    "has_segment",
    "import_segment_fd",
    "open_remote",
    "open_shared",
    "recv_block",
    "remote_cache_size",
    "send_block",
    "spawn_manager",
    "trim_remote_cache",
]
