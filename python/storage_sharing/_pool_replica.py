"""A weights pool replicated to other machines through torch.distributed.

Every rank of a process group calls ``broadcast`` with the same source
rank (``Pool.replica`` on a rank that has no replica yet). One round:

1. header: the source's version, the manifest's length, the chunk size,
   or why the source refuses (a torn pool sends nothing);
2. manifest: segments (the bytes in use of each), storages, tensors, as
   JSON, which each replica parses, bounds-checks and compares with its
   own (or builds its replica from);
3. vote (an all_reduce of one code per rank): every replica has checked
   the manifest and opened an update (its local readers have let go), or
   every rank learns who refused and why, and nothing is written;
4. the bytes: per segment, chunks of ``chunk_bytes`` broadcast straight
   into the replica's segment memory, a few in flight at once;
5. commit (a second vote): every rank saw every chunk through, so no
   replica publishes bytes a source that gave up went on changing. Each
   replica then publishes under the source's version number.

A failure after a replica opened its update leaves it torn: its readers
get ``BusyError`` until a later complete round (on a new group, if a rank
is gone) publishes. A chunk the failed group may still deliver is waited
for before the replica is written again.
"""

import collections
import contextlib
import ctypes
import json
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ._errors import BusyError, Error, InvalidArgumentError, PeerGoneError, WaitTimeoutError
from ._pool_layout import SUPPORTED_DTYPES
from ._pool_tensors import bytes_at, dtype_name, storage_in, typed_view

FORMAT = "storage_sharing.pool_replica/1"
DEFAULT_CHUNK_BYTES = 64 << 20
# Chunks in flight at once: enough to keep a backend's worker threads
# busy (gloo runs two by default) without queueing the whole pool.
_WINDOW = 4
_MAGIC = 0x5353_5245_504C_0001  # "SSREPL", round format 1
_HEADER_WORDS = 8
# The library's own bounds on a manifest (see docs/cuda-weights.md, "Limits").
_MAX_MANIFEST_BYTES = 256 << 20
_MAX_SEGMENTS = 252
_MAX_ENTRIES = 1 << 20
_MAX_DIMS = 64

# Why a rank refuses a round (its vote); 0 is yes.
_SOURCE_TORN = 1
_MANIFEST_DIFFERS = 2
_MANIFEST_MALFORMED = 3
_READERS_HELD = 4
_STALE_CHUNKS = 5
_CANNOT_BUILD = 6
_UNSUPPORTED = 7
_NO_UPDATE = 8
_REASONS = {
    _SOURCE_TORN: "the source pool is torn (an update was abandoned)",
    _MANIFEST_DIFFERS: "its replica's manifest differs from the source's",
    _MANIFEST_MALFORMED: "the manifest it received is malformed",
    _READERS_HELD: "its local readers held their version past the timeout",
    _STALE_CHUNKS: "chunks of an earlier failed broadcast may still land in its replica",
    _CANNOT_BUILD: "it could not build its replica",
    _UNSUPPORTED: "the group's backend cannot move its pool's memory",
    _NO_UPDATE: "it could not open an update of its replica",
}

_turns_lock = threading.Lock()


class _Turn:
    """One writer or sender of a pool at a time, in its own process: a
    broadcast reads the pool under it, so a local ``pool.update()`` waits
    for the send instead of tearing it (and the other way round)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Optional[Tuple[int, str]] = None

    @contextlib.contextmanager
    def taken(self, timeout: Optional[float], what: str) -> Iterator[Callable[[], Optional[float]]]:
        """Waits up to ``timeout`` seconds for the turn; yields a function
        giving the seconds left of ``timeout`` (None: no limit)."""
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 <= timeout < float("inf")):
            raise InvalidArgumentError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
        start = time.monotonic()
        holder = self._holder
        if holder is not None and holder[0] == threading.get_ident():
            raise InvalidArgumentError(f"{what} inside {holder[1]} of the same pool, in the same thread, would wait for itself")
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            busy = holder[1] if holder else "another call"
            raise WaitTimeoutError(f"{what}: the pool was still busy with {busy} after {timeout} s")
        self._holder = (threading.get_ident(), what)
        try:
            yield lambda: None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        finally:
            self._holder = None
            self._lock.release()


def turn_of(pool) -> _Turn:
    """The pool's turn (made on first use)."""
    with _turns_lock:
        turn = pool.__dict__.get("_turn")
        if turn is None:
            turn = pool._turn = _Turn()
        return turn


class _Deadline:
    def __init__(self, timeout: Optional[float]) -> None:
        if timeout is not None and not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> Optional[float]:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


# ---- the manifest ----


def manifest_of(pool) -> Tuple[dict, List[Tuple[int, int]]]:
    """The pool's manifest as a broadcast sends it, and (address, bytes
    sent) of each segment in it. Only segments with tensors' bytes count,
    and of each only the bytes up to the end of its last storage."""
    segments = pool._native.segments()
    storages: List[List[int]] = []
    by_ptr: Dict[int, int] = {}
    tensors = []
    reach = [0] * len(segments)
    for name, e in pool._entries.items():
        if e.storage_nbytes == 0:
            storages.append([-1, 0, 0])
            index = len(storages) - 1
        else:
            index = by_ptr.get(e.storage_ptr)
            if index is None:
                seg = next(i for i, (b, n) in enumerate(segments) if b <= e.storage_ptr and e.storage_ptr + e.storage_nbytes <= b + n)
                offset = e.storage_ptr - segments[seg][0]
                storages.append([seg, offset, e.storage_nbytes])
                index = by_ptr[e.storage_ptr] = len(storages) - 1
                reach[seg] = max(reach[seg], offset + e.storage_nbytes)
        tensors.append([name, index, dtype_name(e.dtype), list(e.sizes), list(e.strides), e.storage_offset])
    kept = [i for i, r in enumerate(reach) if r]
    renumber = {old: new for new, old in enumerate(kept)}
    for s in storages:
        if s[0] >= 0:
            s[0] = renumber[s[0]]
    manifest = {"format": FORMAT, "segments": [reach[i] for i in kept], "storages": storages, "tensors": tensors}
    return manifest, [(segments[i][0], reach[i]) for i in kept]


def _is_int(x, lo: int = 0, hi: int = 1 << 62) -> bool:
    return type(x) is int and lo <= x <= hi


def parse_manifest(data: bytes) -> dict:
    """A received manifest, checked for shape and bounds (every index in
    range, every storage inside its segment); an error says what is wrong."""

    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"the broadcast manifest is malformed: {why}")

    try:
        m = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise bad(f"format {got!r}, expected {FORMAT!r}")
    segments, storages, tensors = m.get("segments"), m.get("storages"), m.get("tensors")
    if not isinstance(segments, list) or len(segments) > _MAX_SEGMENTS or not all(_is_int(s, 1) for s in segments):
        raise bad(f"segments must be at most {_MAX_SEGMENTS} positive byte counts")
    if not isinstance(storages, list) or not isinstance(tensors, list) or max(len(storages), len(tensors)) > _MAX_ENTRIES:
        raise bad(f"storages and tensors must be lists of at most {_MAX_ENTRIES} entries")
    for i, s in enumerate(storages):
        if not (isinstance(s, list) and len(s) == 3 and all(_is_int(x, -1) for x in s)):
            raise bad(f"storage {i} is not [segment, offset, bytes]")
        seg, offset, nbytes = s
        if nbytes == 0 and (seg, offset) != (-1, 0):
            raise bad(f"storage {i} has no bytes but names segment {seg}")
        if nbytes and not (0 <= seg < len(segments) and offset >= 0 and offset + nbytes <= segments[seg]):
            raise bad(f"storage {i} ({nbytes} bytes at {offset} in segment {seg}) lies outside the segments")
    names = set()
    dtypes = {dtype_name(d) for d in SUPPORTED_DTYPES}
    for i, t in enumerate(tensors):
        if not (isinstance(t, list) and len(t) == 6 and isinstance(t[0], str)):
            raise bad(f"tensor {i} is not [name, storage, dtype, sizes, strides, offset]")
        name, storage, dt, sizes, strides, offset = t
        if name in names:
            raise bad(f"tensor name {name!r} appears twice")
        names.add(name)
        if not _is_int(storage) or storage >= len(storages):
            raise bad(f"tensor {name!r} names storage {storage!r} of {len(storages)}")
        if dt not in dtypes:
            raise bad(f"tensor {name!r} has dtype {dt!r}, which the pool does not carry")
        shape_ok = isinstance(sizes, list) and isinstance(strides, list) and len(sizes) == len(strides) <= _MAX_DIMS
        if not shape_ok or not all(_is_int(x) for x in sizes + strides) or not _is_int(offset):
            raise bad(f"tensor {name!r} has malformed sizes, strides or offset")
    return m


def first_difference(mine: dict, theirs: dict) -> Optional[str]:
    """The first place where a replica's manifest and the source's differ,
    in words; None when they are the same."""
    if len(mine["tensors"]) != len(theirs["tensors"]):
        return f"the replica has {len(mine['tensors'])} tensors, the source {len(theirs['tensors'])}"
    fields = ("name", "storage", "dtype", "sizes", "strides", "storage offset")
    for i, (a, b) in enumerate(zip(mine["tensors"], theirs["tensors"])):
        for field, x, y in zip(fields, a, b):
            if x != y:
                return f"tensor {i} ({a[0]!r}): {field} {x!r} in the replica, {y!r} at the source"
    if len(mine["storages"]) != len(theirs["storages"]):
        return f"the replica has {len(mine['storages'])} storages, the source {len(theirs['storages'])}"
    for i, (a, b) in enumerate(zip(mine["storages"], theirs["storages"])):
        if a != b:
            return f"storage {i}: (segment, offset, bytes) {tuple(a)} in the replica, {tuple(b)} at the source"
    if mine["segments"] != theirs["segments"]:
        return f"segment bytes {mine['segments']} in the replica, {theirs['segments']} at the source"
    return None


# ---- building a replica ----


def build_replica(cls, manifest: dict, device: torch.device, kind: str, max_consumers: Optional[int]):
    """A pool of ``cls`` on ``device`` with the manifest's layout: one
    segment per manifest segment, each taken whole by one block (so the
    storages lie at the same offsets), the tensors described over them.
    Its bytes are whatever the memory held: the caller fills them."""
    from .cuda import _Entry

    extents = manifest["segments"]
    pool = cls(device, kind, segment_size=min(extents) if extents else None, max_consumers=max_consumers)
    native = pool._native
    for i, extent in enumerate(extents):
        ptr = native.alloc(extent)
        segments = native.segments()
        if len(segments) != i + 1 or segments[i][0] != ptr:
            raise RuntimeError(f"segment {i} of the replica was not made fresh for its block (the pool placed it elsewhere)")
        rest = segments[i][1] - -(-extent // 512) * 512
        if rest and not segments[i][0] < native.alloc(rest) < segments[i][0] + segments[i][1]:
            raise RuntimeError(f"the tail of segment {i} of the replica was placed outside it")
    bases = [b for b, _ in native.segments()]
    whole = [bytes_at(b, n, device, native).untyped_storage() for b, n in native.segments()]
    views: Dict[int, torch.UntypedStorage] = {}
    for name, index, dt, sizes, strides, offset in manifest["tensors"]:
        seg, at, nbytes = manifest["storages"][index]
        ptr = bases[seg] + at if nbytes else 0
        native.add_tensor(name, ptr, nbytes, dt, sizes, strides, offset)
        storage = views.get(index)
        if storage is None:
            if nbytes:
                storage = storage_in(whole[seg], at, nbytes)
            else:
                storage = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
            views[index] = storage
        dtype = getattr(torch, dt)
        pool._entries[name] = _Entry(ptr, nbytes, dtype, sizes, strides, offset)
        pool._tensors[name] = typed_view(storage, dtype, sizes, strides, offset)
    made, _ = manifest_of(pool)
    difference = first_difference(made, manifest)
    if difference is not None:
        # Another spelling of the same tensors (storages out of order,
        # shared empty storages): not what a source sends.
        raise InvalidArgumentError(f"the broadcast manifest is not in canonical form: {difference}")
    return pool


# ---- the collectives ----


class _Group:
    """The process group and this rank's place in it."""

    def __init__(self, group, src: int, pool_device: Optional[torch.device]) -> None:
        try:
            import torch.distributed as dist
        except ImportError as e:  # pragma: no cover - builds without distributed
            raise InvalidArgumentError("this torch has no torch.distributed") from e
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError("torch.distributed is not initialized: call dist.init_process_group first")
        self.dist = dist
        self.group = group
        pg = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(pg)
        self.me = dist.get_rank(pg)
        if self.me < 0:
            raise InvalidArgumentError("this process is not a member of the group it broadcasts over")
        if type(src) is not int or src not in self.ranks:
            raise InvalidArgumentError(f"src {src!r} is not a (global) rank of the group, whose ranks are {self.ranks}")
        self.src = src
        self.is_source = self.ranks[self.me] == src
        backend = str(dist.get_backend(pg)).lower()
        self.needs_cuda = "nccl" in backend
        if self.needs_cuda:
            index = pool_device.index if pool_device is not None and pool_device.type == "cuda" else torch.cuda.current_device()
            self.control_device = torch.device("cuda", index)
        else:
            self.control_device = torch.device("cpu")

    def start_broadcast(self, t: torch.Tensor):
        return self.dist.broadcast(t, src=self.src, group=self.group, async_op=True)

    def vote(self, code: int, deadline: _Deadline, what: str) -> List[int]:
        """Every rank's code (0: yes)."""
        votes = torch.zeros(len(self.ranks), dtype=torch.int64, device=self.control_device)
        votes[self.me] = code
        wait(self.dist.all_reduce(votes, group=self.group, async_op=True), deadline, what)
        return votes.tolist()

    def refusals(self, votes: List[int]) -> str:
        return "; ".join(
            f"rank {self.ranks[i]}: {_REASONS.get(code, f'code {code}')}" for i, code in enumerate(votes) if code
        )


def wait(work, deadline: _Deadline, what: str) -> None:
    """Waits for a collective; a failure is a typed error: the time ran
    out (``WaitTimeoutError``) or the backend gave up, typically because a
    rank is gone (``PeerGoneError``)."""
    left = deadline.left()
    try:
        if left is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=max(left, 0.001)))
    except RuntimeError as e:
        timed_out = (left is not None and deadline.left() == 0.0) or "timed out" in str(e).lower()
        if timed_out:
            limit = "the group's timeout" if deadline.timeout is None else f"the timeout of {deadline.timeout} s"
            raise WaitTimeoutError(f"{what}: not done within {limit} (a rank of the group is gone or stalled)") from e
        raise PeerGoneError(f"{what}: the process group failed ({str(e).splitlines()[0][:300]}); a rank of the group is likely gone") from e


def _send_bytes(g: _Group, segments: List[torch.Tensor], chunk: int, deadline: _Deadline, what: str, stale: list) -> None:
    """Broadcasts each segment in chunks, ``_WINDOW`` in flight at once.
    On failure the chunks still in flight go to ``stale``."""
    flight: "collections.deque" = collections.deque()
    try:
        for i, seg in enumerate(segments):
            for at in range(0, seg.numel(), chunk):
                flight.append((g.start_broadcast(seg[at : at + chunk]), f"{what}: the chunk at byte {at} of segment {i}"))
                if len(flight) >= _WINDOW:
                    _wait_first(flight, deadline)
        while flight:
            _wait_first(flight, deadline)
    except BaseException:
        stale.extend(w for w, _ in flight)
        raise


def _wait_first(flight: "collections.deque", deadline: _Deadline) -> None:
    work, what = flight[0]
    wait(work, deadline, what)
    flight.popleft()


# ---- one round ----


class _Refusal(Exception):
    """Why this rank votes no, and the error it raises then."""

    def __init__(self, code: int, error: Error) -> None:
        super().__init__(str(error))
        self.code = code
        self.error = error


_ERROR_OF_CODE = {
    _SOURCE_TORN: BusyError,
    _READERS_HELD: WaitTimeoutError,
    _STALE_CHUNKS: BusyError,
}


def _refused(g: _Group, votes: List[int], what: str) -> Error:
    first = next(code for code in votes if code)
    cls = _ERROR_OF_CODE.get(first, InvalidArgumentError)
    return cls(f"{what}: refused, nothing was written ({g.refusals(votes)}; each refusing rank's own error says more)")


def _commit_failed(g: _Group, votes: List[int], what: str) -> Error:
    # Every rank that reaches the commit votes yes; a no is a peer that
    # does not follow the protocol.
    return InvalidArgumentError(f"{what}: not committed, a rank voted no ({g.refusals(votes)})")


def _chunk_bytes(chunk_bytes: Optional[int]) -> int:
    if chunk_bytes is None:
        return DEFAULT_CHUNK_BYTES
    if not _is_int(chunk_bytes, 1, 1 << 40):
        raise InvalidArgumentError(f"chunk_bytes must be a whole number of bytes from 1 to 2^40, got {chunk_bytes!r}")
    return chunk_bytes


def _current_stream(device: torch.device) -> int:
    return 0 if device.type == "cpu" else torch.cuda.current_stream(device).cuda_stream


def broadcast(pool, group, src: int, timeout: Optional[float], chunk_bytes: Optional[int]) -> int:
    """``Pool.broadcast``: sends on rank ``src``, receives elsewhere."""
    deadline = _Deadline(timeout)
    chunk = _chunk_bytes(chunk_bytes)
    g = _Group(group, src, pool.device)
    if g.is_source:
        return _send(pool, g, deadline, chunk)
    return _receive(type(pool), pool, g, deadline, None, None, None)[1]


def replica(cls, group, src: int, device: torch.device, kind: str, timeout: Optional[float], max_consumers: Optional[int]):
    """``Pool.replica``: a new replica, filled by the source's broadcast."""
    deadline = _Deadline(timeout)
    g = _Group(group, src, device)
    if g.is_source:
        raise InvalidArgumentError(f"Pool.replica on rank {src}, the source: the source calls pool.broadcast()")
    return _receive(cls, None, g, deadline, device, kind, max_consumers)[0]


def _send(pool, g: _Group, deadline: _Deadline, chunk: int) -> int:
    with turn_of(pool).taken(deadline.left(), "pool.broadcast()"):
        pool.export()
        version = pool._native.version
        refusal = _SOURCE_TORN if pool._native.torn else 0
        if g.needs_cuda and pool.device.type != "cuda":
            refusal = _UNSUPPORTED
        manifest, spans = manifest_of(pool)
        data = json.dumps(manifest, separators=(",", ":")).encode()
        what = f"broadcast of version {version} from rank {g.src}"
        header = torch.tensor([_MAGIC, version, len(data), chunk, refusal, 0, 0, 0], dtype=torch.int64)
        wait(g.start_broadcast(header.to(g.control_device)), deadline, f"{what}: the header")
        if refusal:
            cls = BusyError if refusal == _SOURCE_TORN else InvalidArgumentError
            raise cls(f"{what}: not sent, {_REASONS[refusal]}")
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(g.control_device)
        wait(g.start_broadcast(body), deadline, f"{what}: the manifest")
        votes = g.vote(0, deadline, f"{what}: the vote")
        if any(votes):
            raise _refused(g, votes, what)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)  # the published writes are done
        segments = [bytes_at(base, n, pool.device, pool._native) for base, n in spans]
        _send_bytes(g, segments, chunk, deadline, what, [])
        votes = g.vote(0, deadline, f"{what}: the commit")
        if any(votes):
            raise _commit_failed(g, votes, what)
    return version


def _stale_of(pool) -> list:
    """Chunks of a failed round that may still write into this replica."""
    return pool.__dict__.setdefault("_replica_stale", [])


def _prepare(cls, pool, manifest_bytes: bytes, g: _Group, deadline: _Deadline, what: str, new: tuple):
    """Checks the manifest against the replica (or builds the replica),
    waits for stale chunks, and opens the update. Returns the replica, or
    raises ``_Refusal``."""
    try:
        manifest = parse_manifest(manifest_bytes)
    except InvalidArgumentError as e:
        raise _Refusal(_MANIFEST_MALFORMED, InvalidArgumentError(f"{what}: refused, nothing was written: {e}")) from None
    if pool is None:
        device, kind, max_consumers = new
        try:
            pool = build_replica(cls, manifest, device, kind, max_consumers)
        except Exception as e:  # whatever it is, the other ranks must hear of it at the vote
            error = type(e)(f"{what}: could not build the replica: {e}") if isinstance(e, Error) else e
            raise _Refusal(_CANNOT_BUILD, error) from None
    else:
        difference = first_difference(manifest_of(pool)[0], manifest)
        if difference is not None:
            raise _Refusal(
                _MANIFEST_DIFFERS,
                InvalidArgumentError(f"{what}: refused, the source's manifest differs from this replica's, nothing was written: {difference}"),
            )
    if g.needs_cuda and pool.device.type != "cuda":
        raise _Refusal(_UNSUPPORTED, InvalidArgumentError(f"{what}: a {pool.device} replica cannot receive over NCCL"))
    stale = _stale_of(pool)
    while stale:
        try:
            wait(stale[0], deadline, f"{what}: a chunk of the failed broadcast before")
        except WaitTimeoutError:
            raise _Refusal(
                _STALE_CHUNKS,
                BusyError(f"{what}: refused, chunks of a failed broadcast may still land in this replica (destroy the old group first)"),
            ) from None
        except Error:
            pass  # it ended, failing: it writes nothing more
        stale.pop(0)
    pool.export()
    try:
        pool._native.begin_update(deadline.left())
    except WaitTimeoutError as e:
        raise _Refusal(_READERS_HELD, WaitTimeoutError(f"{what}: refused, nothing was written: {e}")) from None
    except Error as e:
        raise _Refusal(_NO_UPDATE, type(e)(f"{what}: refused, nothing was written: {e}")) from None
    return pool


def _end_unwritten(pool, was_torn: bool) -> None:
    """Closes an update that wrote nothing: the same version again, or
    still torn if it was."""
    if was_torn:
        pool._native.abandon_update()
    else:
        pool._native.publish_update(_current_stream(pool.device), pool._native.version)


def _receive(cls, pool, g: _Group, deadline: _Deadline, device, kind, max_consumers):
    turn = turn_of(pool).taken(deadline.left(), "pool.broadcast()") if pool is not None else contextlib.nullcontext()
    with turn:
        header = torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=g.control_device)
        wait(g.start_broadcast(header), deadline, f"broadcast from rank {g.src}: the header")
        magic, version, length, chunk, refusal = header.tolist()[:5]
        what = f"broadcast of version {version} from rank {g.src}"
        if magic != _MAGIC:
            raise InvalidArgumentError(
                f"broadcast from rank {g.src}: the header is not a pool broadcast's (every rank of the group must call "
                f"pool.broadcast or Pool.replica with the same src)"
            )
        if refusal:
            cls_ = BusyError if refusal == _SOURCE_TORN else InvalidArgumentError
            raise cls_(f"{what}: the source sent nothing, {_REASONS.get(refusal, f'code {refusal}')}")
        if not (0 < length <= _MAX_MANIFEST_BYTES and 0 < chunk <= 1 << 40 and 0 < version < 1 << 62):
            raise InvalidArgumentError(f"{what}: the header is out of bounds (manifest {length} bytes, chunk {chunk} bytes)")
        body = torch.empty(length, dtype=torch.uint8, device=g.control_device)
        wait(g.start_broadcast(body), deadline, f"{what}: the manifest")
        body = body.cpu()
        manifest_bytes = ctypes.string_at(body.data_ptr(), length)
        code, error, was_torn = 0, None, True
        target = pool
        try:
            was_torn = pool is None or pool._native.torn
            target = _prepare(cls, pool, manifest_bytes, g, deadline, what, (device, kind, max_consumers))
        except _Refusal as r:
            code, error = r.code, r.error
        try:
            votes = g.vote(code, deadline, f"{what}: the vote")
        except BaseException as e:
            if code == 0:
                _end_unwritten(target, was_torn)
                raise
            # Its refusal was posted (the others learn it); the local wait
            # that led to it may have used up the time to see the vote end.
            raise error from e
        if code:
            raise error
        if any(votes):
            _end_unwritten(target, was_torn)
            raise _refused(g, votes, what)
        try:
            _, spans = manifest_of(target)
            segments = [bytes_at(base, n, target.device, target._native) for base, n in spans]
            _send_bytes(g, segments, chunk, deadline, what, _stale_of(target))
            votes = g.vote(0, deadline, f"{what}: the commit")
            if any(votes):
                raise _commit_failed(g, votes, what)
        except Error as e:
            target._native.abandon_update()
            torn = "; this replica is torn (its readers get BusyError) until a complete broadcast publishes"
            raise type(e)(f"{e}{torn if pool is not None else ''}") from e
        except BaseException:
            target._native.abandon_update()
            raise
        target._native.publish_update(_current_stream(target.device), version)
    return target, version
