"""Buffer-protocol objects over memory the native module owns.

The wheel is built for the stable ABI of CPython 3.9, which has no way to
give a native class the buffer protocol (that came in 3.11). So a block,
view or map is a ctypes byte array placed at the memory's address, which
every Python has, with the native owner kept as an attribute: memoryview,
numpy.frombuffer and torch.frombuffer work on it with no copy, and the
memory stays valid as long as any of them (or the object) is alive.
"""

import ctypes

_classes: dict = {}


class BufferMixin:
    """What blocks, views and maps have in common as buffers."""

    __slots__ = ()

    @property
    def address(self) -> int:
        """Where the bytes start in this process."""
        return self._native.address

    @property
    def size(self) -> int:
        """How many bytes the buffer has."""
        return self._native.size

    def memoryview(self) -> memoryview:
        """A writable ``memoryview`` of format ``'B'`` over the bytes
        (``memoryview(obj)`` itself has ctypes' format ``'<B'``, which
        numpy and torch read but memoryview cannot index)."""
        return memoryview(self).cast("B")


def wrap(kind: type, native, size: int):
    """An instance of ``kind`` (a mixin) that is also a ctypes array of
    ``size`` bytes at ``native.address``, keeping ``native`` alive."""
    key = (kind, size)
    cls = _classes.get(key)
    if cls is None:
        if len(_classes) > 4096:
            _classes.clear()
        cls = type(kind.__name__, (kind, ctypes.c_ubyte * size), {"__slots__": ()})
        cls.__module__ = kind.__module__
        cls.__qualname__ = kind.__qualname__
        _classes[key] = cls
    obj = cls.from_address(native.address)
    obj._native = native
    return obj
