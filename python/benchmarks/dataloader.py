"""DataLoader with 2 workers: PyTorch's file_descriptor and file_system
strategies against storage_sharing's arena, side by side.

    python python/benchmarks/dataloader.py [--batches N] [--cases a,b,c]

Cases: (a) 64 x 3x224x224 uint8, (b) the same float32, (c) 256 tiny tensors
per batch. Columns: batches/s, peak fds of the main process, peak RSS+shm
(main and workers, from /proc: Rss + the /dev/shm bytes in use), and the
/dev/shm bytes left after the main process and its workers are killed
with -9 (each run is a child process killed that way at the end).
"""

import argparse
import multiprocessing
import os
import signal
import time

import torch
from torch.utils.data import DataLoader, Dataset

CASES = {
    "a": ("64x3x224x224 uint8", lambda: torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8), 64),
    "b": ("64x3x224x224 float32", lambda: torch.rand(3, 224, 224), 64),
    "c": ("256 tiny tensors", lambda: tuple(torch.full((4,), float(j)) for j in range(256)), 1),
}


class Repeat(Dataset):
    def __init__(self, case, n):
        self.item = CASES[case][1]()
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.item


def shm_used():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(case, strategy, batches, out):
    """In a child process: iterate, measure, report, then wait to be killed."""
    import torch.multiprocessing as mp

    if strategy == "arena":
        import storage_sharing.torch as st

        st.enable()
    else:
        mp.set_sharing_strategy(strategy)
    batch = CASES[case][2]
    loader = DataLoader(Repeat(case, batches * batch), batch_size=batch, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    next(it)  # workers up
    peak_fds = peak_mem = 0
    base_shm = shm_used()
    start = time.perf_counter()
    n = 0
    for b in it:
        n += 1
        peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))
        pids = [os.getpid()] + [w.pid for w in it._workers]
        peak_mem = max(peak_mem, sum(rss(p) for p in pids) + max(shm_used() - base_shm, 0))
        del b
    elapsed = time.perf_counter() - start
    out.put((n / elapsed if elapsed else 0.0, peak_fds, peak_mem, [w.pid for w in it._workers]))
    while True:
        time.sleep(1)


def measure(case, strategy, batches):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    before = shm_used()
    p = ctx.Process(target=run, args=(case, strategy, batches, out))
    p.start()
    rate, fds, mem, workers = out.get(timeout=600)
    for pid in [p.pid] + workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.join()
    time.sleep(0.5)
    return rate, fds, mem, max(shm_used() - before, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--cases", default="a,b,c")
    args = ap.parse_args()
    print(f"{'case':24} {'strategy':16} {'batches/s':>10} {'peak fds':>9} {'peak RSS+shm':>13} {'shm left':>9}")
    for case in args.cases.split(","):
        for strategy in ("file_descriptor", "file_system", "arena"):
            rate, fds, mem, left = measure(case, strategy, args.batches)
            print(f"{CASES[case][0]:24} {strategy:16} {rate:10.1f} {fds:9d} {mem / 2**20:11.0f}Mi {left / 2**20:7.1f}Mi", flush=True)


if __name__ == "__main__":
    main()
