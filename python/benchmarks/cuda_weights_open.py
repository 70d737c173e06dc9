"""What a consumer's open_weights costs in Python, split in two: the
library's open (one connection, one mapping per segment) and building the
tensor views; each in a fresh process, median of --runs.

    python python/benchmarks/cuda_weights_open.py                  # host backend
    python python/benchmarks/cuda_weights_open.py --device cuda:0  # on a GPU

The state dict is shaped like a small transformer's: --layers layers of six
tensors each (bf16, 64 x 64), plus embeddings; the numbers are about the
count of tensors, not their bytes (the GPU benchmark of docs/cuda-weights.md
times a 1.5B-parameter model).
"""

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from storage_sharing import _native, cuda


def consumer(handle, device, out):
    start = time.perf_counter()
    native = _native.CudaWeights(bytes(handle), 60.0)
    opened = time.perf_counter()
    weights = cuda.Weights(native, torch.device(device))
    built = time.perf_counter()
    out.put((opened - start, built - opened, len(weights)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=56)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sd = {f"layers.{i}.{name}": torch.zeros(64, 64, dtype=torch.bfloat16) for i in range(args.layers) for name in ("q", "k", "v", "o", "up", "down")}
    sd["embed.weight"] = torch.zeros(1000, 64, dtype=torch.bfloat16)
    sd["head.weight"] = sd["embed.weight"]  # tied
    pool = cuda.Pool.from_state_dict(sd, device=args.device)
    handle = pool.export()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    runs = []
    for _ in range(args.runs):
        p = ctx.Process(target=consumer, args=(handle, args.device, out))
        p.start()
        runs.append(out.get(timeout=120))
        p.join(120)
    library = statistics.median(r[0] for r in runs) * 1e3
    views = statistics.median(r[1] for r in runs) * 1e3
    print(f"{runs[0][2]} tensors on {args.device}: library open {library:.2f} ms, tensor views {views:.2f} ms (median of {args.runs} fresh processes)")


if __name__ == "__main__":
    main()
