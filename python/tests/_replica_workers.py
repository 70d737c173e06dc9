"""Processes of the pool-replication tests (importable under spawn): ranks
of a gloo group over loopback standing for nodes, each with a weights pool
on the host backend (the source's, or a replica) and local consumer
processes reading it."""

import multiprocessing
import os
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch

# Hang guards only: every wait below normally ends in well under a second.
GUARD = 120.0
# The broadcasts' own timeout: what a survivor of a killed rank waits at most.
TIMEOUT = 30.0
CHUNK = 4096


def value(name: str, version: int) -> int:
    """What every element of tensor ``name`` holds at ``version``: small
    integers, exact in every dtype used here, different per tensor."""
    base = name.split(".")[0]
    index = {"emb": 0, "head": 0, "steps": 9, "blob": 11}.get(base)
    if index is None:
        index = 1 + int(name.split(".")[1])
    return (version * 13 + index) % 113


def model(version: int, blob_bytes: int = 0, layer_dtype=torch.bfloat16) -> dict:
    """An LLM-shaped little state dict at ``version``: tied embedding and
    head, a transposed view of them, bf16 layers, an int64 buffer, and
    (for the kill tests) a large tensor last, so a transfer has many
    chunks after its first."""
    emb = torch.full((64, 16), value("emb", version), dtype=torch.float32)
    sd = {"emb.weight": emb, "head.weight": emb, "emb.T": emb.t()}
    for i in range(6):
        sd[f"layers.{i}.w"] = torch.full((32, 32), value(f"layers.{i}", version), dtype=layer_dtype)
    sd["steps"] = torch.full((5,), value("steps", version), dtype=torch.int64)
    if blob_bytes:
        sd["blob"] = torch.full((blob_bytes // 4,), value("blob", version), dtype=torch.float32)
    return sd


def write_version(tensors: dict, version: int) -> None:
    for name, t in tensors.items():
        t.fill_(value(name, version))


def torn_tensors(weights, version: int) -> list:
    """Tensors of ``weights`` not wholly at ``version``."""
    bad = []
    for name, t in weights.items():
        want = value(name, version)
        if t.numel() and not bool((t == want).all()):
            bad.append((version, name, float(t.min()), float(t.max())))
    return bad


def byte_equal(weights, version: int, blob_bytes: int = 0) -> bool:
    want = model(version, blob_bytes)
    return set(weights.keys()) == set(want) and all(torch.equal(weights[n], want[n]) for n in want)


def consumers_gone(pool) -> None:
    """Waits until the pool's server has seen its consumers hang up, so
    that dropping the pool frees it at once: a legacy pool dropped with
    consumers connected lingers, freeing (and unlinking its shm names) in
    its server thread, which the os._exit ending a forked child would cut
    short."""
    deadline = time.monotonic() + GUARD
    while pool.consumers and time.monotonic() < deadline:
        time.sleep(0.005)


def join(init_file: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=GUARD)
    )


def leave() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def read_until(inbox, results, final: int) -> None:
    """A local consumer: opens the pool whose handle comes on ``inbox``,
    reads every tensor under a held version until it reads ``final``,
    and reports its reads, the versions it saw, any torn read, and whether
    the last version was byte-equal to the source's."""
    from storage_sharing import cuda

    try:
        w = cuda.open_weights(inbox.get(timeout=GUARD), timeout=GUARD)
        torn, seen, reads, equal = [], [], 0, False
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline:
            with w.reading(timeout=GUARD) as version:
                torn += torn_tensors(w, version)
                if version == final:
                    equal = byte_equal(w, version)
            reads += 1
            if not seen or seen[-1] != version:
                seen.append(version)
            if version == final:
                break
        results.put((os.getpid(), reads, seen, torn, equal))
    except BaseException:
        results.put((os.getpid(), 0, [], [traceback.format_exc()], False))


def node(rank: int, world: int, init_file: str, kind: str, rounds: int, out) -> None:
    """A node: rank 0 owns the source pool and broadcasts it after each
    of ``rounds`` updates; the others make a replica and receive. Two
    local consumers per node read throughout."""
    from storage_sharing import cuda

    try:
        ctx = multiprocessing.get_context("fork")  # before any pool or group: nothing to inherit
        inbox, results = ctx.Queue(), ctx.Queue()
        final = 1 + rounds
        readers = [ctx.Process(target=read_until, args=(inbox, results, final), daemon=True) for _ in range(2)]
        for p in readers:
            p.start()
        join(init_file, rank, world)
        if rank == 0:
            pool = cuda.Pool.from_state_dict(model(1), device="cpu", kind=kind, segment_size=8192)
            for _ in readers:
                inbox.put(pool.export())
            version = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
            for _ in range(rounds):
                with pool.update(timeout=TIMEOUT) as tensors:
                    write_version(tensors, version + 1)
                version = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
            segments = len(pool.segments())
        else:
            pool = cuda.Pool.replica(src=0, device="cpu", kind=kind, timeout=TIMEOUT)
            for _ in readers:
                inbox.put(pool.export())
            version = pool.version
            for _ in range(rounds):
                version = pool.broadcast(src=0, timeout=TIMEOUT)
            segments = len(pool.segments())
        reports = [results.get(timeout=GUARD) for _ in readers]
        for p in readers:
            p.join(GUARD)
        leave()
        consumers_gone(pool)
        out.put((rank, version, pool.version, segments, reports))
    except BaseException:
        out.put((rank, None, None, None, traceback.format_exc()))


def _error(e: BaseException) -> tuple:
    return (type(e).__name__, str(e))


def outcome(call, done=None):
    """What a rank reports of `call()`: `done` (or, without one, what the
    call returned), or the error it raised as (type name, message)."""
    try:
        result = call()
    except Exception as e:
        return _error(e)
    return result if done is None else done


def joiner_source(init1: str, init2: str, out, phase) -> None:
    """The source of the late-joiner test: two versions to rank 1 alone,
    then (on a new group that rank 2 joins) a third to both; then a pool
    of another model is refused; then the first pool's fourth version
    goes through on the same group."""
    from storage_sharing import cuda

    report = {}
    try:
        join(init1, 0, 2)
        pool = cuda.Pool.from_state_dict(model(1), device="cpu", kind="legacy", segment_size=8192)
        pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
        with pool.update(timeout=TIMEOUT) as tensors:
            write_version(tensors, 2)
        report["second"] = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
        leave()
        phase.put("first group done")
        join(init2, 0, 3)
        with pool.update(timeout=TIMEOUT) as tensors:
            write_version(tensors, 3)
        report["third"] = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
        other = cuda.Pool.from_state_dict(model(1, layer_dtype=torch.float16), device="cpu")
        report["other"] = outcome(lambda: other.broadcast(src=0, timeout=TIMEOUT), "sent")
        with pool.update(timeout=TIMEOUT) as tensors:
            write_version(tensors, 4)
        report["fourth"] = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
        leave()
    except BaseException:
        report["failed"] = traceback.format_exc()
    out.put((0, report))


def joiner_replica(rank: int, init1, init2: str, out) -> None:
    """Rank 1 (``init1`` given: in both groups) or the late rank 2 (only
    in the second). Each receives the third version, refuses the other
    model, then receives the fourth; it reads its own replica as a local
    consumer after each step."""
    from storage_sharing import cuda

    report = {}
    try:
        if init1 is not None:
            join(init1, rank, 2)
            pool = cuda.Pool.replica(src=0, device="cpu", kind="vmm", timeout=TIMEOUT)
            pool.broadcast(src=0, timeout=TIMEOUT)
            leave()
            join(init2, rank, 3)
            report["third"] = pool.broadcast(src=0, timeout=TIMEOUT)
        else:
            join(init2, rank, 3)
            pool = cuda.Pool.replica(src=0, device="cpu", kind="vmm", timeout=TIMEOUT)
            report["third"] = pool.version
        w = cuda.open_weights(pool.export(), timeout=GUARD)
        with w.reading(timeout=GUARD) as version:
            report["third read"] = (version, byte_equal(w, version))
        report["other"] = outcome(lambda: pool.broadcast(src=0, timeout=TIMEOUT), "received")
        with w.reading(timeout=GUARD) as version:
            report["after refusal"] = (version, byte_equal(w, 3), pool.version)
        report["fourth"] = pool.broadcast(src=0, timeout=TIMEOUT)
        with w.reading(timeout=GUARD) as version:
            report["fourth read"] = (version, byte_equal(w, version))
        w.close()
        del w
        consumers_gone(pool)
        leave()
    except BaseException:
        report["failed"] = traceback.format_exc()
    out.put((rank, report))


def in_forked_rank(target, *args) -> None:
    """Runs a rank's `target` in a child forked from the test process, with
    one intra-op thread: a parent that ran parallel tensor ops before the
    fork leaves the child an OpenMP pool whose threads did not come along,
    and the child's first parallel op then never finishes."""
    torch.set_num_threads(1)
    target(*args)


def kill_when_landing(tensor: torch.Tensor, version: int, pid: int) -> threading.Thread:
    """A thread that sends SIGKILL to ``pid`` as soon as the first element
    of ``tensor`` (the first bytes of the replica) shows ``version``: the
    transfer of that version has begun and has many chunks to go."""
    want = value("emb", version)

    def watch() -> None:
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline:
            if int(tensor[0, 0]) == want:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.0002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


BLOB = 8 << 20


def kill_rank(rank: int, init1: str, init2: str, victim: str, pids, out) -> None:
    """One rank of the kill tests (3 ranks; rank 0 the source). Version 1
    goes to every replica. Then version 2 is broadcast in 4 KiB chunks,
    and the victim is killed with -9 as soon as version 2's first bytes
    land in a replica, with 8 MiB still to come: rank 2 kills itself
    (``victim="replica"``), or rank 1 kills the source, whose pid comes on
    ``pids`` (``victim="source"``). The survivors report their typed
    errors and what their readers see, then rebuild the group on
    ``init2`` (the survivors, plus a new source where the source died,
    see :func:`new_source`) where a complete broadcast of version 3
    repairs them."""
    from storage_sharing import cuda

    report = {}
    try:
        join(init1, rank, 3)
        if rank == 0:
            pool = cuda.Pool.from_state_dict(model(1, BLOB), device="cpu", kind="vmm", segment_size=1 << 16)
            pool.broadcast(src=0, timeout=TIMEOUT)
            pids.put(os.getpid())
            with pool.update(timeout=TIMEOUT) as tensors:
                write_version(tensors, 2)
        else:
            pool = cuda.Pool.replica(src=0, device="cpu", kind="legacy" if rank == 2 else "vmm", timeout=TIMEOUT)
            w = cuda.open_weights(pool.export(), timeout=GUARD)
            first = pool.state_dict()["emb.weight"]
            if victim == "replica" and rank == 2:
                kill_when_landing(first, 2, os.getpid())
            if victim == "source" and rank == 1:
                kill_when_landing(first, 2, pids.get(timeout=GUARD))
        report["broken"] = outcome(lambda: pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK), "completed")
        if rank != 0:
            report["read torn"] = outcome(lambda: w.acquire(timeout=GUARD), "acquired")
        leave()
        if victim == "replica":
            join(init2, rank, 2)
        else:
            join(init2, rank, 3)  # rank 0 of the new group is the new source
        if rank == 0:
            with pool.update(timeout=TIMEOUT) as tensors:
                write_version(tensors, 3)
            report["repair"] = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
        else:
            report["repair"] = pool.broadcast(src=0, timeout=TIMEOUT)
            with w.reading(timeout=GUARD) as version:
                report["repaired read"] = (version, byte_equal(w, version, BLOB), torn_tensors(w, version))
            w.close()
            del w
            consumers_gone(pool)
        leave()
    except BaseException:
        report["failed"] = traceback.format_exc()
    out.put((rank, report))


def new_source(init2: str, out) -> None:
    """A source started after the first one was killed: a pool of the
    same model, brought to version 3, broadcast on the rebuilt group."""
    from storage_sharing import cuda

    report = {}
    try:
        pool = cuda.Pool.from_state_dict(model(1, BLOB), device="cpu", kind="vmm", segment_size=1 << 16)
        pool.export()  # version 1
        for version in (2, 3):
            with pool.update(timeout=TIMEOUT) as tensors:
                write_version(tensors, version)
        join(init2, 0, 3)
        report["repair"] = pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK)
        leave()
    except BaseException:
        report["failed"] = traceback.format_exc()
    out.put(("new source", report))


def cuda_pair(rank: int, init: str, out) -> None:
    """Two ranks on one GPU over gloo (which moves CUDA tensors itself):
    rank 0's pool on cuda:0 goes to rank 1's replica on cuda:0, three
    versions; rank 1 reports its versions and whether each arrived whole."""
    from storage_sharing import cuda

    report = {"versions": [], "equal": []}
    try:
        torch.cuda.set_device(0)
        join(init, rank, 2)
        if rank == 0:
            pool = cuda.Pool.from_state_dict(model(1), device="cuda:0")
            report["versions"].append(pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK))
            for version in (2, 3):
                with pool.update(timeout=TIMEOUT) as tensors:
                    write_version(tensors, version)
                report["versions"].append(pool.broadcast(src=0, timeout=TIMEOUT, chunk_bytes=CHUNK))
        else:
            pool = cuda.Pool.replica(src=0, device="cuda:0", timeout=TIMEOUT)
            for step in range(3):
                if step:
                    pool.broadcast(src=0, timeout=TIMEOUT)
                torch.cuda.synchronize()
                got = {k: v.cpu() for k, v in pool.state_dict().items()}
                want = model(pool.version)
                report["versions"].append(pool.version)
                report["equal"].append(all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys())
            report["on device"] = all(t.is_cuda for t in pool.state_dict().values())
        leave()
    except BaseException:
        report["failed"] = traceback.format_exc()
    out.put((rank, report))


def held_and_stalled(rank: int, init: str, out, events) -> None:
    """Two ranks. Round 2: rank 1's local reader holds version 1 past the
    timeout, so rank 1 refuses at the vote and nothing is written; round
    3 goes through on the same group once the reader let go. Then the
    source tears its pool (an update that raised) and sends nothing.
    Round 4: rank 1 stalls (never calls), so the source's timeout runs out."""
    from storage_sharing import cuda

    report = {}
    try:
        join(init, rank, 2)
        if rank == 0:
            pool = cuda.Pool.from_state_dict(model(1), device="cpu", segment_size=8192)
            pool.broadcast(src=0, timeout=TIMEOUT)
            for version in (2, 3):
                with pool.update(timeout=TIMEOUT) as tensors:
                    write_version(tensors, version)
                report[version] = outcome(lambda: pool.broadcast(src=0, timeout=TIMEOUT))
            try:
                with pool.update(timeout=TIMEOUT) as tensors:
                    tensors["steps"].fill_(99)
                    raise RuntimeError("the trainer failed mid-update")
            except RuntimeError:
                pass
            report["torn"] = outcome(lambda: pool.broadcast(src=0, timeout=TIMEOUT), "sent")
            with pool.update(timeout=TIMEOUT) as tensors:
                write_version(tensors, 4)
            report[4] = outcome(lambda: pool.broadcast(src=0, timeout=1.0), "sent")
            events.put("source done")
        else:
            pool = cuda.Pool.replica(src=0, device="cpu", timeout=TIMEOUT)
            w = cuda.open_weights(pool.export(), timeout=GUARD)
            w.acquire(timeout=GUARD)
            report[2] = outcome(lambda: pool.broadcast(src=0, timeout=0.5), "received")
            report["kept"] = (w.held, byte_equal(w, 1), pool.version, pool._native.torn)
            w.release()
            report[3] = pool.broadcast(src=0, timeout=TIMEOUT)
            with w.reading(timeout=GUARD) as version:
                report["read"] = (version, byte_equal(w, version))
            report["torn"] = outcome(lambda: pool.broadcast(src=0, timeout=TIMEOUT), "received")
            with w.reading(timeout=GUARD) as version:
                report["after torn source"] = (version, byte_equal(w, version))
            events.get(timeout=GUARD)  # stalled through round 4
            w.close()
            del w
            consumers_gone(pool)
        leave()
    except BaseException:
        report["failed"] = traceback.format_exc()
    out.put((rank, report))
