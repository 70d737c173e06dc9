"""Processes of the storage_sharing.cuda tests (importable under spawn):
a small language model with tied weights and views, producers and
consumers of its pool."""

import os
import time

import torch
from torch import nn

# Hang guards only: every wait below normally ends in well under a second.
GUARD = 120.0


class TinyLM(nn.Module):
    """Tied embedding/head, an int64 buffer, a stride-0 (expanded) buffer."""

    def __init__(self, vocab: int = 64, dim: int = 16, context: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("positions", torch.arange(context))
        self.register_buffer("scale", torch.full((1,), 0.5).expand(dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos(self.positions[: tokens.shape[-1]])
        h = self.norm(h + self.mlp(h)) * self.scale
        return self.head(h)


def tokens_for_test() -> torch.Tensor:
    return torch.arange(2 * 8).reshape(2, 8) % 64


def forward_single_thread(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The forward pass on one CPU thread (so that producer and consumer
    reduce in the same order) and without autograd. Children send it back
    as a list (exact for float32): a tensor on a queue would need the
    child alive until the parent took its descriptor."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(tokens).cpu()
    finally:
        torch.set_num_threads(threads)


def consume_model(handle, out):
    """Opens the pool, loads it into a model built on the meta device (so
    every parameter is the pool's memory), runs the forward pass."""
    from storage_sharing import cuda

    w = cuda.open_weights(handle, timeout=GUARD)
    with torch.device("meta"):
        model = TinyLM()
    with w.reading(timeout=GUARD) as version:
        model.load_state_dict(w, assign=True)
        result = forward_single_thread(model, tokens_for_test().to(w.device))
    segments = w.segments()
    in_pool = all(any(b <= t.data_ptr() < b + n for b, n in segments) for t in model.state_dict().values())
    tied = model.head.weight.data_ptr() == model.emb.weight.data_ptr()
    out.put((version, result.tolist(), tied, in_pool, w["scale"].stride(), len(w)))


def read_versions(handle, ready, stop, out):
    """Reads every tensor of the pool in a loop, each read inside a held
    version; reports each read whose values are not all that version (a
    torn mix), and the version of a last read after `stop`."""
    from storage_sharing import cuda

    w = cuda.open_weights(handle, timeout=GUARD)
    torn, seen, reads = [], [], 0
    ready.set()
    while True:
        stopping = stop.is_set()
        with w.reading(timeout=GUARD) as version:
            for name, t in w.items():
                lo, hi = t.min().item(), t.max().item()
                if lo != version or hi != version:
                    torn.append((version, name, lo, hi))
        reads += 1
        if not seen or seen[-1] != version:
            seen.append(version)
        if stopping:
            break
    out.put((os.getpid(), reads, seen, torn))


def hold_forever(handle, held):
    """Acquires a version and keeps it until killed."""
    from storage_sharing import cuda

    w = cuda.open_weights(handle, timeout=GUARD)
    w.acquire(timeout=GUARD)
    held.set()
    time.sleep(3600)


def produce_and_wait(device, kind, out, done):
    """A producer in a child: a pool of three tensors filled with 7,
    exported; the handle goes to `out`; waits for `done` (or a kill)."""
    from storage_sharing import cuda

    sd = {f"t{i}": torch.full((1000 + i,), 7.0) for i in range(3)}
    pool = cuda.Pool.from_state_dict(sd, device=device, kind=kind, segment_size=1 << 16)
    out.put(pool.export())
    done.wait(GUARD)


def produce_as_nobody(out, done):
    """A producer that is another user (uid 65534): its handle goes to `out`."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    from storage_sharing import cuda

    pool = cuda.Pool.from_state_dict({"x": torch.ones(100)}, device="cpu")
    out.put(pool.export())
    done.wait(GUARD)


def open_stock(descriptor):
    """A legacy pool opened with nothing but PyTorch: one shared storage per
    segment, then each tensor set onto its segment's storage."""
    device = descriptor["device"]
    torch.cuda.init()  # _new_shared_cuda expects CUDA initialized, as PyTorch's own rebuild does
    storages = [torch.UntypedStorage._new_shared_cuda(*segment) for segment in descriptor["segments"]]
    tensors = {}
    for name, (segment, byte_offset, dtype, shape, stride, offset) in descriptor["tensors"].items():
        dt = getattr(torch, dtype)
        itemsize = torch.empty(0, dtype=dt).element_size()
        t = torch.empty(0, dtype=dt, device=f"cuda:{device}")
        tensors[name] = t.set_(storages[segment], byte_offset // itemsize + offset, shape, stride)
    return tensors


def consume_with_stock_pytorch(descriptor, out):
    """Loads a legacy pool's stock descriptor into a model without
    storage_sharing, runs the forward pass."""
    with torch.device("meta"):
        model = TinyLM()
    model.load_state_dict(open_stock(descriptor), assign=True)
    out.put(forward_single_thread(model, tokens_for_test().cuda()).tolist())


def produce_and_hang_in_update(kind, out, writing):
    """A producer that opens an update, half writes it, and is killed there."""
    from storage_sharing import cuda

    pool = cuda.Pool.from_state_dict({"w": torch.full((1000,), 7.0)}, device="cpu", kind=kind)
    out.put(pool.export())
    out.get(timeout=GUARD)  # the consumer has opened the pool
    with pool.update(timeout=GUARD) as tensors:
        tensors["w"][:500].fill_(8)
        writing.set()
        time.sleep(3600)


def use_inherited_weights(weights, out):
    """In a forked child: the parent's weights refuse calls, their tensors
    still read."""
    import storage_sharing as ss

    try:
        weights.acquire(timeout=GUARD)
        out.put(("acquired", None))
    except ss.InvalidArgumentError as e:
        out.put((str(e), float(weights["w"].sum())))


def produce_then_fork(out, opened, done):
    """A producer that forks a child after a consumer opened its pool (a
    DataLoader worker, say), then waits to be killed."""
    from storage_sharing import cuda

    pool = cuda.Pool.from_state_dict({"w": torch.full((10,), 7.0)}, device="cpu")
    out.put(pool.export())
    # An event, not the queue: the parent reading `out` could take its own
    # message back before this process did.
    opened.wait(GUARD)
    child = os.fork()
    if child == 0:
        time.sleep(GUARD)
        os._exit(0)
    out.put(child)
    done.wait(GUARD)
