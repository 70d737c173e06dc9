"""Symmetric-memory collectives (storage_sharing.symm) vs gloo's, on the
same spawned processes of one host.

    python python/benchmarks/symm.py                       # 2 and 4 ranks, 4 KiB .. 64 MiB
    python python/benchmarks/symm.py --ranks 2 --max-kib 1024 --iters 5   # a smoke run

Each cell is the median latency over --iters calls (after a warm-up call)
of all_reduce (sum), broadcast and all_gather of a float32 tensor of that
size per rank; rank 0 prints the table. "all_gather in place" gathers an
input that lies in a symmetric tensor (symm.empty), which peers read where
it is; its gloo column is gloo's all_gather of a plain tensor. "memcpy GiB/s" is the floor: rank
0 copying a buffer as large as an all_gather's output (world_size times
the size) between two tensors, timed in the same run; "symm GiB/s out"
is what each rank receives per second (all_gather: the whole output).
"""

import argparse
import ctypes
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from storage_sharing import symm


def sizes(max_kib):
    s = 4
    while s <= max_kib:
        yield s * 1024
        s *= 4


def timed(fn, iters):
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def rank_main(rank, world_size, port, max_kib, iters):
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    group = symm.join(timeout=120)
    rows = []
    for nbytes in sizes(max_kib):
        n = nbytes // 4
        x = torch.ones(n)
        lst = [torch.empty(n) for _ in range(world_size)]
        sx = symm.empty((n,), torch.float32)
        sx.tensor.fill_(1)
        cases = {
            "all_reduce": (lambda: dist.all_reduce(x), lambda: symm.all_reduce(x)),
            "broadcast": (lambda: dist.broadcast(x, 0), lambda: symm.broadcast(x, 0)),
            "all_gather": (lambda: dist.all_gather(lst, x), lambda: symm.all_gather(lst, x)),
            # gloo has no such call: compared with its all_gather above.
            "all_gather in place": (None, lambda: symm.all_gather(lst, sx)),
        }
        src, dst = torch.ones(n * world_size), torch.empty(n * world_size)
        dist.barrier()
        # A plain single-threaded memcpy (torch's copy_ may split across threads).
        floor = nbytes * world_size / (1 << 30) / timed(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes * world_size), iters)
        gloo = {}
        for name, (gloo_fn, symm_fn) in cases.items():
            dist.barrier()
            g = gloo[name] = timed(gloo_fn, iters) if gloo_fn else gloo["all_gather"]
            dist.barrier()
            before = group.gathers_in_place
            s = timed(symm_fn, iters)
            in_place = group.gathers_in_place - before
            assert in_place == (iters + 1 if name == "all_gather in place" else 0), f"{name}: {in_place} calls in place"
            rows.append((name, nbytes, g, s, floor))
    if rank == 0:
        for name, nbytes, g, s, floor in rows:
            size = f"{nbytes >> 10} KiB" if nbytes < (1 << 20) else f"{nbytes >> 20} MiB"
            gib = nbytes * (world_size if name.startswith("all_gather") else 1) / (1 << 30) / s
            print(f"| {world_size} | {name} | {size} | {g * 1e6:.0f} | {s * 1e6:.0f} | {g / s:.1f}x | {gib:.2f} | {floor:.2f} |", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-kib", type=int, default=64 * 1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print("| ranks | op | size per rank | gloo µs | symm µs | speed-up | symm GiB/s out | memcpy GiB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for ws in args.ranks:
        server = dist.TCPStore("127.0.0.1", 0, ws, is_master=True, wait_for_workers=False)
        torch.multiprocessing.spawn(rank_main, args=(ws, server.port, args.max_kib, args.iters), nprocs=ws)
        del server


if __name__ == "__main__":
    main()
