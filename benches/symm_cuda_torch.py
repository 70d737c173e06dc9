"""PyTorch's CUDA symmetric memory, timed as benches/symm_cuda.rs times ours:
two ranks on device 0 (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, a gloo
group for the rendezvous), barrier + stream synchronise, a run of barriers
enqueued back to back, and the put/wait round trip.

    python benches/symm_cuda_torch.py [rounds=2000]

Prints the rows of a table (rank 0); `skipped: …` where there is no CUDA
device or no torch.distributed._symmetric_memory.
"""
import os
import queue
import statistics
import sys
import tempfile
import time


def median_us(samples):
    return statistics.median(samples) * 1e6


def rank_main(rank, init_file, rounds, out):
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    t0 = time.perf_counter()
    buf = symm_mem.empty(1 << 18, dtype=torch.float32, device="cuda:0")  # 1 MiB
    torch.cuda.synchronize()
    alloc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    rendezvous_s = time.perf_counter() - t0
    stream = torch.cuda.current_stream()
    for _ in range(50):
        handle.barrier(channel=0)
    stream.synchronize()

    one = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        handle.barrier(channel=0)
        stream.synchronize()
        one.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(rounds):
        handle.barrier(channel=1)
    stream.synchronize()
    pipelined_us = (time.perf_counter() - t0) / rounds * 1e6

    peer = 1 - rank
    rtt = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if rank == 0:
            handle.put_signal(peer, channel=2)
            handle.wait_signal(peer, channel=2)
        else:
            handle.wait_signal(peer, channel=2)
            handle.put_signal(peer, channel=2)
        stream.synchronize()
        rtt.append(time.perf_counter() - t0)
    handle.barrier(channel=0)
    stream.synchronize()
    if rank == 0:
        backend = symm_mem.get_backend(torch.device("cuda:0")) if hasattr(symm_mem, "get_backend") else "?"
        out.put(
            [
                f"| PyTorch {torch.__version__} ({backend} backend): barrier + synchronize | {median_us(one):.1f} |",
                f"| PyTorch: barrier, {rounds} enqueued back to back, per barrier | {pipelined_us:.1f} |",
                f"| PyTorch: put_signal + wait_signal round trip (+ sync) | {median_us(rtt):.1f} |",
                f"| PyTorch: first symm_mem.empty of 1 MiB (context included) | {alloc_s * 1e6:.0f} |",
                f"| PyTorch: rendezvous of 1 MiB (gloo group) | {rendezvous_s * 1e6:.0f} |",
            ]
        )
    dist.destroy_process_group()


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    try:
        import torch
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        return
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    import torch.multiprocessing as mp

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        ranks = [ctx.Process(target=rank_main, args=(r, os.path.join(d, "init"), rounds, out)) for r in range(2)]
        for p in ranks:
            p.start()
        rows = None
        # Wait for rank 0's rows, but not for a rank that already died.
        while rows is None and not any(p.exitcode not in (None, 0) for p in ranks):
            try:
                rows = out.get(timeout=1)
            except queue.Empty:
                pass
        for p in ranks:
            p.join(60 if rows else 1)
            if p.exitcode is None:
                p.kill()
        failed = [r for r, p in enumerate(ranks) if p.exitcode != 0]
    if rows:
        print("| operation (2 ranks, one device) | median µs |")
        print("|---|---|")
        print("\n".join(rows))
    if failed:
        sys.exit(f"rank(s) {failed} failed")


if __name__ == "__main__":
    main()
