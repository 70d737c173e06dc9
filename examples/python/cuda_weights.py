"""A model's weights shared whole with another process, then updated in place.

The producer (this process) puts a small transformer-like model's state dict
in a pool, exports it, and starts a consumer process with the handle. The
consumer opens the pool once, loads it into a model built on the meta device
(``load_state_dict(..., assign=True)``: every parameter is the producer's
memory, nothing copied) and answers forward passes. The producer then
updates the weights in place, as a trainer would after a step, and the
consumer's next read sees the new version, never a mix of the two.

    python examples/python/cuda_weights.py                  # host backend (CPU)
    python examples/python/cuda_weights.py --device cuda:0  # on a GPU
    python examples/python/cuda_weights.py --device cuda:0 --born-in-pool

Prints what happened and exits 0 when the consumer's outputs match the
producer's for both versions.
"""

import argparse

import torch
import torch.multiprocessing as mp
from torch import nn

from storage_sharing import cuda


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class TinyModel(nn.Module):
    """Embedding and output head share one weight (tied), as in most LMs."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(1)  # the same reduction order in both processes
    with torch.no_grad():
        return model(tokens).cpu()


def consumer(handle: cuda.WeightsHandle, requests, answers) -> None:
    weights = cuda.open_weights(handle)
    with torch.device("meta"):
        model = TinyModel()
    model.load_state_dict(weights, assign=True)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr(), "still tied"
    while (tokens := requests.get()) is not None:
        with weights.reading() as version:  # the producer's updates wait for this
            answers.put((version, forward(model, tokens.to(weights.device))))
    weights.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (host backend, default) or cuda:N")
    parser.add_argument("--kind", default="vmm", choices=["vmm", "legacy"])
    parser.add_argument("--born-in-pool", action="store_true", help="CUDA only: build the model inside pool.allocating()")
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.born_in_pool:
        pool = cuda.Pool(args.device, kind=args.kind)
        with pool.allocating():
            model = TinyModel().to(args.device)  # parameters born in the pool: no copy
        pool.add_state_dict(model.state_dict())
    else:
        model = TinyModel().to(args.device)
        pool = cuda.Pool.from_state_dict(model.state_dict(), kind=args.kind)  # one copy in
    handle = pool.export()
    print(f"producer {handle.producer_pid}: {len(pool.state_dict())} tensors in {len(pool.segments())} segment(s), handle of {len(bytes(handle))} bytes")

    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=consumer, args=(handle, requests, answers))
    child.start()
    tokens = torch.randint(0, 256, (2, 16))
    ok = True

    requests.put(tokens)
    version, got = answers.get(timeout=120)
    expected = forward(model, tokens.to(args.device))
    ok &= version == 1 and torch.equal(got, expected)
    print(f"consumer read version {version}: output equal to the producer's: {torch.equal(got, expected)}")

    # A "training step": new weights written in place, then published.
    # Tied weights are one tensor under two names: scale each storage once.
    with pool.update(timeout=120) as tensors:
        seen = set()
        for t in tensors.values():
            if t.is_floating_point() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                t.mul_(0.5)
    print(f"producer published version {pool.version}")

    requests.put(tokens)
    version, got = answers.get(timeout=120)
    if not args.born_in_pool:  # born in the pool, the model is the pool's memory already
        model.load_state_dict(pool.state_dict())
    expected = forward(model, tokens.to(args.device))
    ok &= version == 2 and torch.equal(got, expected)
    print(f"consumer read version {version}: output equal to the producer's: {torch.equal(got, expected)}")

    requests.put(None)
    child.join(120)
    ok &= child.exitcode == 0
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
