"""Tensors not born in the arena: a DataLoader whose collate_fn returns a
list (one tensor per sample, as detection models' collate does), 256
tensors per batch, PyTorch's file_descriptor strategy against enable().

    python python/benchmarks/fresh_tensors.py [--batches N] [--workers W] [--shape 3,64,64]

Each run is a spawned child process. Columns: batches/s (after the first
batch, which pays for starting the workers) and the peak descriptors of the
main process while it keeps one batch alive at a time.
"""

import argparse
import multiprocessing
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

PER_BATCH = 256


class Fresh(Dataset):
    """Every sample a new tensor made by PyTorch."""

    def __init__(self, n, shape):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full(self.shape, float(i % 251))


def as_list(samples):
    return list(samples)


def run(strategy, batches, workers, shape, out):
    import torch.multiprocessing as mp

    if strategy == "enable()":
        import storage_sharing.torch as st

        st.enable()
    else:
        mp.set_sharing_strategy(strategy)
    loader = DataLoader(Fresh(batches * PER_BATCH, shape), batch_size=PER_BATCH, num_workers=workers,
                        collate_fn=as_list, multiprocessing_context="fork")
    it = iter(loader)
    first = next(it)
    assert len(first) == PER_BATCH
    del first
    peak_fds = 0
    start = time.perf_counter()
    n = 0
    for b in it:
        n += 1
        peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))
        del b
    elapsed = time.perf_counter() - start
    out.put((n / elapsed if elapsed else 0.0, peak_fds))


def measure(strategy, batches, workers, shape):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=run, args=(strategy, batches, workers, shape, out))
    p.start()
    result = out.get(timeout=600)
    p.join(60)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shape", default="3,64,64")
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    print(f"{PER_BATCH} tensors of {'x'.join(map(str, shape))} float32 per batch, {args.workers} workers, {args.batches} batches")
    print(f"{'strategy':16} {'batches/s':>10} {'peak fds':>9}")
    for strategy in ("file_descriptor", "enable()"):
        rate, fds = measure(strategy, args.batches, args.workers, shape)
        print(f"{strategy:16} {rate:10.1f} {fds:9d}", flush=True)


if __name__ == "__main__":
    main()
