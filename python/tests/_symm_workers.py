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


# Tensors given to gloo, kept until the process group is destroyed. In
# PyTorch 2.5 and 2.6, destroy_process_group() can deadlock when a gloo
# worker thread drops the last reference to such a tensor (it waits for
# the GIL, which the main thread holds while joining that worker: seen
# with gdb, ~ProcessGroupGloo in std::thread::join, the worker in
# ~AsyncAllreduceWork taking the GIL); a tensor still referenced here is
# not freed by the worker.
_GLOO_TENSORS = []


def run(body, rank, world_size, how, where, results, *args):
    try:
        init(rank, world_size, how, where)
        report = (rank, "ok", body(rank, world_size, *args))
    except BaseException as e:  # reported to the test, which asserts
        report = (rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    results.put(report)
    # Delivered before the teardown, whatever the teardown does.
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()
    _GLOO_TENSORS.clear()


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
    _GLOO_TENSORS.append(y)
    out["vs_gloo"] = bool(torch.allclose(x, y))
    return out


def dies_mid_collective(rank, world_size, victim, op="all_reduce"):
    symm.join(timeout=5)
    buf = symm.empty((64,), torch.float32)
    t = buf.tensor
    lst = [torch.empty(64) for _ in range(world_size)]
    calls = {"all_reduce": lambda: symm.all_reduce(t), "all_gather_in_place": lambda: symm.all_gather(lst, buf)}
    calls[op]()  # everyone alive: the scratch buffer exists
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        calls[op]()
    except TimeoutError as e:
        return {"timeout": str(e)}
    return {"timeout": None}


def gathers_in_place(rank, world_size):
    """all_gathers of inputs in symmetric tensors: read in place when every
    rank's input lies in the same allocation, through the scratch block
    otherwise; returns the failures and how many went in place."""
    g = symm.join(timeout=60)
    failures = []
    n = 70001
    buf = symm.empty((n,), torch.float32)
    lst = [torch.empty(n) for _ in range(world_size)]
    # The input changes as soon as a call returns: a peer still reading it
    # would see the next round's values.
    for i in range(40):
        buf.tensor.fill_(rank * 1000 + i)
        symm.all_gather(lst, buf)
        if [float(x[n - 1]) for x in lst] != [float(r * 1000 + i) for r in range(world_size)] or not all(bool((x == x[0]).all()) for x in lst):
            failures.append(f"round {i}: {[float(x[0]) for x in lst]}")
            break
    before = g.gathers_in_place
    # Each rank's own row of a symmetric output is its input.
    whole = symm.empty((world_size, 513), torch.int64)
    whole.tensor[rank] = rank + 1
    symm.all_gather_into_tensor(whole, whole.tensor[rank])
    if not torch.equal(whole.tensor, torch.arange(1, world_size + 1).repeat_interleave(513).view(world_size, 513)):
        failures.append(f"rows in place: {whole.tensor[:, 0].tolist()}")
    rows = g.gathers_in_place - before
    # Rank 0 alone passes a symmetric input, then the ranks pass different
    # allocations: both go through the scratch block, and still gather.
    other = symm.empty((n,), torch.float32)
    other.tensor.fill_(-rank)
    buf.tensor.fill_(rank + 0.5)
    before = g.gathers_in_place
    symm.all_gather(lst, buf if rank == 0 else buf.tensor.clone())
    if [float(x[7]) for x in lst] != [r + 0.5 for r in range(world_size)]:
        failures.append(f"mixed: {[float(x[7]) for x in lst]}")
    symm.all_gather(lst, buf if rank % 2 else other)
    if [float(x[7]) for x in lst] != [r + 0.5 if r % 2 else float(-r) for r in range(world_size)]:
        failures.append(f"different allocations: {[float(x[7]) for x in lst]}")
    through_scratch = 2 - (g.gathers_in_place - before)
    # A view in the middle of the allocation, and a closed allocation.
    mid = [torch.empty(100) for _ in range(world_size)]
    symm.all_gather(mid, buf.tensor[5:105])
    if [float(m[99]) for m in mid] != [r + 0.5 for r in range(world_size)]:
        failures.append(f"view: {[float(m[99]) for m in mid]}")
    buf.close()
    x = torch.full((3,), float(rank))
    outs = [torch.empty(3) for _ in range(world_size)]
    symm.all_gather(outs, x)
    if [float(o[0]) for o in outs] != [float(r) for r in range(world_size)]:
        failures.append("plain after close")
    return {"failures": failures, "in_place": g.gathers_in_place, "rows": rows, "through_scratch": through_scratch}


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


# Every dtype the collectives reduce natively, and one they hand to torch.
NATIVE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ODD_SIZES = [1, 17, 1023, 70001]


def rank_input(rank, n, dtype, lo, hi):
    """Rank ``rank``'s integer-valued input (any rank can make any rank's):
    sums and products of these are exact in every dtype, or wrap alike."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def expected(inputs, op, dtype):
    """The reduction by torch itself, cast back as PyTorch casts."""
    stacked = torch.stack([x.to(torch.float64) if x.is_floating_point() else x.to(torch.int64) for x in inputs])
    if op == "sum":
        r = stacked.sum(0)
    elif op == "product":
        r = stacked.prod(0)
    elif op == "max":
        r = stacked.max(0).values
    else:
        r = stacked.min(0).values
    return r.to(dtype)


def reductions_of_every_dtype(rank, world_size):
    """all_reduce of each native dtype and op at sizes not divisible by
    the world size, against torch's own reduction; returns the failures."""
    failures = []
    for dtype in NATIVE_DTYPES:
        lo = 0 if dtype == torch.uint8 else -100 if dtype in (torch.int8, torch.int16, torch.int32, torch.int64) else -8
        for n in ODD_SIZES:
            for op in ["sum", "max", "min", "product"]:
                # Products stay small (exact in bfloat16) except for the
                # integers, which wrap alike in torch and here.
                span = (lo, 100) if op != "product" or not dtype.is_floating_point else (-2, 3)
                inputs = [rank_input(r, n, dtype, *span) for r in range(world_size)]
                t = inputs[rank].clone()
                symm.all_reduce(t, op=op)
                want = expected(inputs, op, dtype)
                if not torch.equal(t, want):
                    bad = (t != want).nonzero()[:3].flatten().tolist()
                    failures.append(f"{dtype} n={n} {op}: first wrong at {bad}")
    # Random floats: the sum agrees with torch's to rounding.
    for n in [3, 65_537]:
        g = torch.Generator().manual_seed(n)
        inputs = [torch.randn(n, generator=g) for _ in range(world_size)]
        t = inputs[rank].clone()
        symm.all_reduce(t)
        if not torch.allclose(t, torch.stack(inputs).sum(0), rtol=1e-6, atol=1e-6):
            failures.append(f"randn float32 n={n}")
    # A dtype without a native reduction goes through torch.
    z = torch.full((7,), complex(rank, 1), dtype=torch.complex64)
    symm.all_reduce(z)
    if not torch.equal(z, torch.full((7,), complex(sum(range(world_size)), world_size), dtype=torch.complex64)):
        failures.append(f"complex64 sum: {z.tolist()}")
    # A strided view of a bfloat16 tensor is reduced in place.
    base = torch.full((9, 4), float(rank + 1), dtype=torch.bfloat16)
    symm.all_reduce(base[:, 1], op="max")
    col = torch.full((9,), float(world_size), dtype=torch.bfloat16)
    if not torch.equal(base[:, 1], col) or not torch.equal(base[:, 0], torch.full((9,), float(rank + 1), dtype=torch.bfloat16)):
        failures.append("strided bfloat16 max")
    return failures


def copies_of_every_dtype(rank, world_size):
    """broadcast and all_gather of odd sizes and every native dtype, into
    contiguous, strided and other-dtype outputs; returns the failures."""
    failures = []
    for dtype in NATIVE_DTYPES + [torch.bool, torch.complex128]:
        for n in ODD_SIZES:
            inputs = [rank_input(r, n, dtype, 0, 2 if dtype == torch.bool else 50) for r in range(world_size)]
            root = n % world_size
            b = inputs[rank].clone()
            symm.broadcast(b, src=root)
            if not torch.equal(b, inputs[root]):
                failures.append(f"broadcast {dtype} n={n}")
            lst = [torch.empty(n, dtype=dtype) for _ in range(world_size)]
            symm.all_gather(lst, inputs[rank])
            if not all(torch.equal(lst[r], inputs[r]) for r in range(world_size)):
                failures.append(f"all_gather {dtype} n={n}")
            whole = torch.empty(world_size, n, dtype=dtype)
            symm.all_gather_into_tensor(whole, inputs[rank])
            if not torch.equal(whole, torch.stack(inputs)):
                failures.append(f"all_gather_into_tensor {dtype} n={n}")
    # In place: the input is this rank's row of the output.
    whole = torch.zeros(world_size, 13, dtype=torch.int32)
    whole[rank] = rank + 1
    symm.all_gather_into_tensor(whole, whole[rank])
    if not torch.equal(whole, torch.arange(1, world_size + 1, dtype=torch.int32).repeat_interleave(13).view(world_size, 13)):
        failures.append("all_gather_into_tensor in place")
    # Strided outputs go through a temporary (outputs of another dtype are
    # refused, as torch.distributed refuses them).
    mine = torch.full((6,), float(rank), dtype=torch.float32)
    outs = [torch.zeros(6, 2, dtype=torch.float32)[:, 0] if r % 2 else torch.zeros(6, dtype=torch.float32) for r in range(world_size)]
    symm.all_gather(outs, mine)
    if [o.tolist() for o in outs] != [[float(r)] * 6 for r in range(world_size)]:
        failures.append(f"all_gather strided: {[o.tolist() for o in outs]}")
    # A strided broadcast target.
    grid = torch.full((5, 3), float(rank))
    symm.broadcast(grid[:, 2], src=world_size - 1)
    if grid[:, 2].tolist() != [float(world_size - 1)] * 5 or grid[:, 0].tolist() != [float(rank)] * 5:
        failures.append("strided broadcast")
    return failures


def wrong_sizes_are_named(rank, world_size):
    """Bad arguments raise before any rank waits; returns the messages."""
    out = {}
    try:
        symm.all_gather([torch.empty(3) for _ in range(world_size)], torch.ones(4))
    except ValueError as e:
        out["gather"] = str(e)
    try:
        symm.broadcast(torch.ones(4), src=world_size)
    except Exception as e:  # the native error: an invalid-argument class
        out["broadcast"] = f"{type(e).__name__}: {e}"
    symm.barrier()
    return out


def _error_of(call):
    """The error ``call`` raises on this rank, as "Class: message"."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _matched_sum_works(world_size):
    t = torch.arange(5, dtype=torch.float32)
    symm.all_reduce(t)
    return bool(torch.equal(t, torch.arange(5, dtype=torch.float32) * world_size))


def mismatches_fail_every_rank(rank, world_size):
    """Collectives where the last rank passes other arguments than the
    others; returns each case's error on this rank and whether a matched
    all_reduce works right after it."""
    symm.join(timeout=20)
    odd = rank == world_size - 1
    f32, f64 = torch.float32, torch.float64
    sym = symm.empty((8,), f32)
    sym.tensor.fill_(rank)
    cases = {
        "size": lambda: symm.all_reduce(torch.ones(6 if odd else 4)),
        "dtype": lambda: symm.all_reduce(torch.ones(4, dtype=f64 if odd else f32)),
        "op": lambda: symm.all_reduce(torch.ones(4), op="max" if odd else "sum"),
        "complex": lambda: symm.all_reduce(torch.ones(4, dtype=torch.complex128 if odd else torch.complex64)),
        "grow": lambda: symm.all_reduce(torch.ones(100_000 if odd else 4)),
        "broadcast_size": lambda: symm.broadcast(torch.ones(6 if odd else 4), src=0),
        "broadcast_root": lambda: symm.broadcast(torch.ones(4), src=1 if odd else 0),
        "gather_size": lambda: symm.all_gather([torch.empty(6 if odd else 4) for _ in range(world_size)], torch.ones(6 if odd else 4)),
        "gather_dtype": lambda: symm.all_gather_into_tensor(torch.empty(world_size * 4, dtype=f64 if odd else f32), torch.ones(4, dtype=f64 if odd else f32)),
        "gather_in_place": lambda: symm.all_gather([torch.empty(6 if odd else 4) for _ in range(world_size)], sym.tensor[: 6 if odd else 4]),
        "barrier": lambda: symm.barrier() if odd else symm.all_reduce(torch.ones(4)),
        "cast_into": lambda: symm.all_gather_into_tensor(torch.empty(world_size * 4, dtype=torch.int64 if odd else f32), torch.ones(4)),
        "sparse": lambda: symm.all_reduce(torch.ones(4).to_sparse() if odd else torch.ones(4)),
    }
    out = {}
    for name, call in cases.items():
        out[name] = _error_of(call)
        out[name + "_after"] = _matched_sum_works(world_size)
    out["in_place_untouched"] = sym.tensor.tolist() == [float(rank)] * 8
    return out


def confusing_inputs_are_named(rank, world_size):
    """Inputs every rank gets wrong alike; returns the errors."""
    symm.join(timeout=20)
    ws = world_size
    out = {
        "negative": _error_of(lambda: symm.empty((-1,))),
        "negative_2d": _error_of(lambda: symm.empty((2, -3), torch.int64)),
        "not_a_dtype": _error_of(lambda: symm.empty((2,), "float32")),
        "sparse_reduce": _error_of(lambda: symm.all_reduce(torch.ones(4).to_sparse())),
        "csr_gather": _error_of(lambda: symm.all_gather([torch.empty(4) for _ in range(ws)], torch.ones(2, 2).to_sparse_csr())),
        "sparse_output": _error_of(lambda: symm.all_gather_into_tensor(torch.zeros(ws * 4).to_sparse(), torch.ones(4))),
        "meta": _error_of(lambda: symm.broadcast(torch.empty(4, device="meta"), src=0)),
        "expanded": _error_of(lambda: symm.all_reduce(torch.zeros(1).expand(4))),
        "cast_list": _error_of(lambda: symm.all_gather([torch.empty(4, dtype=torch.float16) for _ in range(ws)], torch.ones(4))),
        "negative_root": _error_of(lambda: symm.broadcast(torch.ones(4), src=-1)),
    }
    out["zero_size"] = list(symm.empty((0, 5)).tensor.shape)
    # A SymmTensor itself is taken for its tensor, as all_gather takes it.
    sym = symm.empty((3,), torch.int32)
    sym.tensor.fill_(rank + 1)
    symm.all_reduce(sym)
    symm.broadcast(sym, src=0)
    out["symm_tensor"] = sym.tensor.tolist()
    out["after"] = _matched_sum_works(ws)
    return out
