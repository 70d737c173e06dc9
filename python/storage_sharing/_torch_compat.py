"""What storage_sharing.torch needs of PyTorch's private parts, checked
before anything of PyTorch's is replaced.

storage_sharing.torch puts its own functions in the place of PyTorch's
(the storage reduction, two storage methods, ``_new_shared`` and two
methods of the DataLoader's worker iterator) and calls the ones it
replaces. Those are private: a PyTorch release may rename them or change
their arguments. Patching one that changed would break sharing in ways that
show up far from here, so every one of them is looked at first, and on a
PyTorch release outside the range scripts/torch_versions.sh has passed,
nothing is patched unless the user asks for it (ALLOW_UNTESTED_ENV).
"""

import inspect
import os
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers PyTorch's reductions)
import torch.utils.data.dataloader as _dataloader

from ._errors import Error

# The PyTorch minor releases scripts/torch_versions.sh has passed (see
# docs/python.md for the table).
TESTED_RANGE = ((2, 4), (2, 15))
ALLOW_UNTESTED_ENV = "STORAGE_SHARING_TORCH_ALLOW_UNTESTED"


class UnsupportedTorchError(Error, RuntimeError):
    """The installed PyTorch lacks, or has changed, something
    storage_sharing.torch replaces or relies on; nothing was patched."""

    kind = "UnsupportedTorch"


def tested_range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_RANGE
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def _minor_version(version: str):
    """(major, minor) of a version such as "2.4.1+cu121" or "2.16.0a0+git1234";
    None when it does not start with two numbers."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def _version_problem():
    version = str(torch.__version__)
    minor = _minor_version(version)
    lo, hi = TESTED_RANGE
    if minor is not None and lo <= minor <= hi:
        return None
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return None
    return (
        f"torch {version} is outside the tested range {tested_range_text()} "
        f"(set {ALLOW_UNTESTED_ENV}=1 to try it anyway; the checks of the parts used still apply)"
    )


def _params(fn):
    """The parameter names of ``fn``, or None when it has no signature."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _signature_text(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(no signature)"


def _method_problems():
    problems = []
    storage = torch.UntypedStorage
    # Storage methods: the two replaced (and called), the ones called.
    for name in ("is_shared", "share_memory_", "data_ptr", "nbytes", "copy_"):
        if not callable(getattr(storage, name, None)):
            problems.append(f"torch.UntypedStorage.{name} is missing")
    if not callable(getattr(torch, "frombuffer", None)):
        problems.append("torch.frombuffer is missing")
    # What DataLoader's default_collate allocates batches with.
    static = inspect.getattr_static(storage, "_new_shared", None)
    if not isinstance(static, classmethod):
        problems.append("torch.UntypedStorage._new_shared is missing or no longer a classmethod")
    else:
        params = _params(storage._new_shared)
        if params is None or params[:1] != ["size"] or "device" not in params:
            problems.append(
                f"torch.UntypedStorage._new_shared{_signature_text(storage._new_shared)}: "
                "expected (size, *, device='cpu')"
            )
    reducer = ForkingPickler._extra_reducers.get(storage)
    if not callable(reducer):
        problems.append(
            "torch.multiprocessing registers no reduction for torch.UntypedStorage "
            "(ForkingPickler._extra_reducers[torch.UntypedStorage])"
        )
    # The DataLoader's worker iterator: __init__ gets the loader (its
    # worker_init_fn is wrapped around the call), _shutdown_workers joins
    # the workers (the received segments are trimmed after it).
    iterator = getattr(_dataloader, "_MultiProcessingDataLoaderIter", None)
    where = "torch.utils.data.dataloader._MultiProcessingDataLoaderIter"
    if iterator is None:
        problems.append(f"{where} is missing")
    else:
        for name, expected in (("__init__", ["self", "loader"]), ("_shutdown_workers", ["self"])):
            method = iterator.__dict__.get(name)
            params = _params(method) if callable(method) else None
            if method is None or not callable(method):
                problems.append(f"{where}.{name} is missing")
            elif params != expected:
                problems.append(f"{where}.{name}{_signature_text(method)}: expected ({', '.join(expected)})")
    return problems


def _storage_object_problem():
    # Arena storages are marked with an attribute on their Python object;
    # the mark must come back with the storage from any tensor over it,
    # which PyTorch does only where it keeps the storage's Python object
    # alive with its memory.
    probe = "_storage_sharing_probe"
    s = torch.UntypedStorage(1)
    setattr(s, probe, True)
    t = torch.empty(0, dtype=torch.uint8).set_(s)
    del s
    if getattr(t.untyped_storage(), probe, False):
        return None
    return "torch does not keep a storage's Python object while a tensor uses it (attributes set on it are lost)"


def can_move_storages() -> bool:
    """Whether a storage's memory can be swapped for an arena block in place
    (``UntypedStorage._swap_data_ptr_``, which older PyTorch releases lack).
    Without it, a storage that is not in the arena yet is shared by
    PyTorch's own reduction, as without enable()."""
    return callable(getattr(torch.UntypedStorage, "_swap_data_ptr_", None))


def problems():
    """Every reason storage_sharing.torch cannot patch this PyTorch (empty
    when it can)."""
    found = _method_problems()
    if not found:
        storage_problem = _storage_object_problem()
        if storage_problem:
            found.append(storage_problem)
    version_problem = _version_problem()
    return ([version_problem] if version_problem else []) + found


def check() -> None:
    """Raises UnsupportedTorchError naming every problem, if there is one."""
    found = problems()
    if found:
        raise UnsupportedTorchError(
            f"storage_sharing.torch cannot patch torch {torch.__version__} "
            f"(tested with {tested_range_text()}); nothing was patched:\n"
            + "\n".join(f"  - {p}" for p in found)
        )
