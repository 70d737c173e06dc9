"""Rank bodies for test_symm (importable by spawned children)."""

import os
import signal
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from storage_sharing import symm


def init(rank, world_size, how, where):
    """Joins the gloo group through a TCPStore at port ``where`` or a
    FileStore at path ``where``."""
    if how == "tcp":
        store = dist.TCPStore("127.0.0.1", where, world_size, is_master=False, timeout=timedelta(seconds=60))
    else:
        store = dist.FileStore(where, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def run(body, rank, world_size, how, where, results, *args):
    try:
        init(rank, world_size, how, where)
        out = body(rank, world_size, *args)
        results.put((rank, "ok", out))
        dist.destroy_process_group()
    except BaseException as e:  # reported to the test, which asserts
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def peers_and_signals(rank, world_size):
    g = symm.join(timeout=60)
    buf = symm.empty((4, 8), torch.float32)
    buf.tensor.fill_(rank)
    buf.barrier()
    seen = [float(p[3, 7]) for p in buf.peers]
    buf.barrier()
    # A ring of signals: each rank writes into its right neighbour's
    # buffer, then tells it.
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    buf.peers[right][0, 0] = 100 + rank
    buf.put_signal(right, channel=1)
    buf.wait_signal(left, channel=1)
    got = float(buf.tensor[0, 0])
    buf.barrier()
    return {"rank": g.rank, "ws": g.world_size, "seen": seen, "from_left": got, "shared": buf.tensor.is_shared()}


def collectives(rank, world_size):
    out = {}
    for n in [1, 7, 1000, 300_000]:
        t = torch.arange(n, dtype=torch.float32) + rank
        symm.all_reduce(t)
        want = torch.arange(n, dtype=torch.float32) * world_size + sum(range(world_size))
        out[f"sum{n}"] = bool(torch.equal(t, want))
    t = torch.full((5, 3), float(rank))
    symm.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = bool(torch.equal(t, torch.full((5, 3), float(world_size - 1))))
    t = torch.full((6,), rank + 1, dtype=torch.int64)
    symm.all_reduce(t, op="product")
    out["prod"] = t.tolist()
    # A non-contiguous tensor is reduced in place too.
    base = torch.full((4, 4), float(rank))
    view = base.t()[1:3]
    symm.all_reduce(view)
    out["noncontig"] = bool(torch.equal(base.t()[1:3], torch.full((2, 4), float(sum(range(world_size))))))
    b = torch.arange(12, dtype=torch.int32).view(3, 4) * (10 if rank == 1 else 0)
    symm.broadcast(b, src=1)
    out["broadcast"] = bool(torch.equal(b, torch.arange(12, dtype=torch.int32).view(3, 4) * 10))
    mine = torch.full((3,), float(rank), dtype=torch.float64)
    lst = [torch.empty(3, dtype=torch.float64) for _ in range(world_size)]
    symm.all_gather(lst, mine)
    out["gather"] = [float(x[0]) for x in lst]
    whole = torch.empty(world_size * 3, dtype=torch.float64)
    symm.all_gather_into_tensor(whole, mine)
    out["gather_into"] = whole.tolist()
    # Agrees with gloo on the same data.
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4096, generator=g, dtype=torch.float64)
    y = x.clone()
    symm.all_reduce(x)
    dist.all_reduce(y)
    out["vs_gloo"] = bool(torch.allclose(x, y))
    return out


def dies_mid_collective(rank, world_size, victim):
    symm.join(timeout=5)
    t = torch.ones(64)
    symm.all_reduce(t)  # everyone alive: the scratch buffer exists
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        symm.all_reduce(t)
    except TimeoutError as e:
        return {"timeout": str(e)}
    return {"timeout": None}


def store_only(rank, world_size, path, results):
    """symm.join with a store, rank and world size: no process group."""
    try:
        g = symm.join(store=dist.FileStore(path, world_size), rank=rank, world_size=world_size, timeout=60)
        t = torch.full((2,), float(rank + 1))
        lst = [torch.empty(1) for _ in range(world_size)]
        symm.all_gather(lst, t[:1], group=g)
        results.put((rank, "ok", [float(x) for x in lst]))
    except BaseException as e:
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
