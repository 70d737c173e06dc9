"""Exceptions raised by storage_sharing.

Every error of the library becomes an instance of :class:`Error`; where a
builtin exception fits, the class derives from it too, so ``except
FileNotFoundError`` or ``except TimeoutError`` work as expected. The
message is the library's (it names the object and the cause); ``kind`` is
the library's error kind (``"NotFound"``, ``"NoSpace"``, ...).
"""

import errno as _errno


class Error(Exception):
    """Base class of every error raised by storage_sharing."""

    kind = "Error"


class NotFoundError(Error, FileNotFoundError):
    """A segment, file, mapping or key does not exist."""


class AlreadyExistsError(Error, FileExistsError):
    """An object that must be new already exists."""


class PermissionDeniedError(Error, PermissionError):
    """The operating system refused access."""


class NoSpaceError(Error, OSError):
    """/dev/shm (or memory) cannot hold the bytes asked for: errno ENOSPC."""


class TooManyFilesError(Error, OSError):
    """The process or system is out of file descriptors: errno EMFILE."""


class WaitTimeoutError(Error, TimeoutError):
    """A wait ran out of time."""


class InvalidArgumentError(Error, ValueError):
    """An argument has a value the operation cannot accept."""


class ClosedError(Error, ValueError):
    """The object was closed already."""


class PeerGoneError(Error, ConnectionError):
    """The peer process or connection is gone."""


class BusyError(Error, OSError):
    """The object is in a state that refuses the call now (say, a weights
    pool torn by an abandoned update): errno EBUSY."""


# kind -> (class, errno for OSError subclasses or None)
_BY_KIND = {
    "NotFound": (NotFoundError, _errno.ENOENT),
    "AlreadyExists": (AlreadyExistsError, _errno.EEXIST),
    "Permission": (PermissionDeniedError, _errno.EACCES),
    "NoSpace": (NoSpaceError, _errno.ENOSPC),
    "TooManyFiles": (TooManyFilesError, _errno.EMFILE),
    "Timeout": (WaitTimeoutError, _errno.ETIMEDOUT),
    "InvalidArgument": (InvalidArgumentError, None),
    "NullPointer": (InvalidArgumentError, None),
    "NameTooLong": (InvalidArgumentError, None),
    "SizeMismatch": (InvalidArgumentError, None),
    "BufferTooSmall": (InvalidArgumentError, None),
    "Closed": (ClosedError, None),
    "PeerGone": (PeerGoneError, _errno.EPIPE),
    "Busy": (BusyError, _errno.EBUSY),
}


def from_native(kind: str, message: str) -> Error:
    """The exception for a library error of ``kind`` (used by the native module)."""
    cls, code = _BY_KIND.get(kind, (Error, None))
    exc = cls(code, message) if code is not None else cls(message)
    exc.kind = kind
    return exc
