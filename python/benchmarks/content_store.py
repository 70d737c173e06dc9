"""Content store: PyTorch's torch.utils._content_store vs
storage_sharing.content_store, writing and reading the same tensors.

    python python/benchmarks/content_store.py                # 1 GiB, half duplicates
    python python/benchmarks/content_store.py --total-mib 64 # a smoke run

Tensors of --tensor-mib each add up to --total-mib; every second one has
the content of the one before it (a distinct storage with equal bytes, so
it is hashed and deduplicated, not written). Each case writes into a fresh
folder under --dir (removed afterwards), then reads every tensor back with
a fresh reader. PyTorch's default hash is compiled by torch.compile on its
first use; that warm-up is done before timing.
"""

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.utils._content_store as theirs

import storage_sharing.content_store as ours


def make_tensors(total_mib, tensor_mib):
    n = max(2, total_mib // tensor_mib)
    numel = tensor_mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        out.append(out[-1].clone() if i % 2 else torch.randn(numel, generator=g))
    return out


def run_case(module, tensors, stable, root, hash_where):
    loc = tempfile.mkdtemp(dir=root)
    try:
        t0 = time.perf_counter()
        w = module.ContentStoreWriter(loc, stable_hash=stable)
        if module is ours and hash_where != "auto":
            w._writer().set_hash_where(hash_where)
        for i, t in enumerate(tensors):
            w.write_tensor(f"t{i}", t)
        del w
        t1 = time.perf_counter()
        r = module.ContentStoreReader(loc)
        total = 0.0
        for i in range(len(tensors)):
            total += float(r.read_tensor(f"t{i}")[0])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    finally:
        shutil.rmtree(loc, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where the stores are written (default: the temp folder)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--hashes", default="stable,default", help="which hashes to time: stable, default or both")
    ap.add_argument(
        "--hash-where",
        default="auto",
        choices=["auto", "caller", "pool"],
        help="where our writer hashes: in write_tensor's call, or in its pool over a copy (auto: by core count)",
    )
    args = ap.parse_args()
    tensors = make_tensors(args.total_mib, args.tensor_mib)
    gib = sum(t.nbytes for t in tensors) / (1 << 30)
    # Compile PyTorch's default-hash kernel before timing.
    theirs.hash_storage(torch.zeros(16).untyped_storage())
    print(f"{len(tensors)} tensors, {gib:.2f} GiB, half duplicates; {os.cpu_count()} CPUs\n")
    print("| hash | module | write s | write GiB/s | read s | read GiB/s | write speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for stable in [h == "stable" for h in args.hashes.split(",")]:
        times = {}
        for name, module in [("torch", theirs), ("storage_sharing", ours)]:
            best = None
            for _ in range(args.repeat):
                w, r = run_case(module, tensors, stable, args.dir, args.hash_where)
                best = (w, r) if best is None else (min(best[0], w), min(best[1], r))
            times[name] = best
        for name in ["torch", "storage_sharing"]:
            w, r = times[name]
            speed = f"{times['torch'][0] / w:.1f}x" if name != "torch" else ""
            label = "sha1 (stable)" if stable else "default"
            print(f"| {label} | {name} | {w:.2f} | {gib / w:.2f} | {r:.2f} | {gib / r:.2f} | {speed} |")


if __name__ == "__main__":
    main()
