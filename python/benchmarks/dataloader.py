"""DataLoader with 2 workers: PyTorch's file_descriptor and file_system
strategies against storage_sharing's arena, side by side.

    python python/benchmarks/dataloader.py [--batches N] [--cases a,b,c]
    python python/benchmarks/dataloader.py --new-user [--repeats N] [--shapes ID,ID]

--new-user: the shapes a new user tries first (small items with PyTorch's
default non-persistent workers over 5 epochs, an early break with a new
iterator, persistent workers, 4 workers, an IterableDataset, pin_memory,
large batches), stock PyTorch against enable(), each run a fresh Python
process, the two alternating, medians of --repeats runs. Columns: seconds
for the whole run, stock / enable() (above 1: enable() is faster), the
lowest and highest ratio of one stock run to the enable() run beside it
(a range that spans 1.0: within this machine's noise), peak
shared memory (growth of Shmem in /proc/meminfo: the whole machine's, so
other work on it shows up) and peak fds of the main process.

Cases: (a) 64 x 3x224x224 uint8, (b) the same float32, (c) 256 tiny tensors
per batch. Columns: batches/s, peak fds of the main process, peak RSS+shm
(main and workers, from /proc: Rss + the /dev/shm bytes in use), and the
/dev/shm bytes left after the main process and its workers are killed
with -9 (each run is a child process killed that way at the end).
"""

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
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


class SmallItems(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


class SmallStream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(start, self.n, step):
            yield torch.full((4,), float(i)), i


class LargeItems(Dataset):
    def __init__(self, n, dtype=torch.uint8):
        self.item = torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8).to(dtype)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.item


# id: (what the row says, dataset, items, batch_size, loader options,
# epochs, iterators broken early)
SHAPES = {
    "small": ("small, 2 workers, 5 epochs", "small", 256, 32, {}, 5, 0),
    "break": ("small, early break x20", "small", 4096, 32, {}, 0, 20),
    "persistent": ("small, persistent, 5 epochs", "small", 256, 32, {"persistent_workers": True}, 5, 0),
    "workers4": ("small, 4 workers, 5 epochs", "small", 256, 32, {"num_workers": 4}, 5, 0),
    "iterable": ("IterableDataset, 5 epochs", "stream", 256, 32, {}, 5, 0),
    "pin": ("small, pin_memory, 5 epochs", "small", 256, 32, {"pin_memory": True}, 5, 0),
    "prefetch": ("small, prefetch 8, 5 epochs", "small", 256, 32, {"prefetch_factor": 8}, 5, 0),
    "large": ("9.6 MB batches, 2 epochs", "large", 6400, 64, {}, 2, 0),
    "large-persistent": ("9.6 MB batches, persistent", "large", 6400, 64, {"persistent_workers": True}, 2, 0),
    "huge": ("38.5 MB batches, 2 epochs", "huge", 3200, 64, {}, 2, 0),
}
DATASETS = {
    "small": SmallItems,
    "stream": SmallStream,
    "large": LargeItems,
    "huge": lambda n: LargeItems(n, torch.float32),
}


def shmem():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def run_shape(name, arena):
    """The shape's whole run in this (fresh) process, timed; prints one JSON line."""
    if arena:
        import storage_sharing.torch as st

        st.enable()
    _, kind, items, batch, opts, epochs, breaks = SHAPES[name]
    kw = {"num_workers": 2, **opts}
    loader = DataLoader(DATASETS[kind](items), batch_size=batch, **kw)
    base = shmem()
    peak_shm = peak_fds = 0

    def sample():
        nonlocal peak_shm, peak_fds
        peak_shm = max(peak_shm, shmem() - base)
        peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))

    start = time.perf_counter()
    for _ in range(epochs):
        for i, b in enumerate(loader):
            if i % 4 == 0:
                sample()
    for _ in range(breaks):
        for b in loader:
            sample()
            break
    elapsed = time.perf_counter() - start
    print(json.dumps([elapsed, peak_shm, peak_fds]))


def measure_shape(name, arena):
    # A new interpreter running this file, as a user's script runs: under
    # multiprocessing's spawn the workers' shutdown on PyTorch 2.15 takes
    # seconds (each worker dies of "terminate called without an active
    # exception", stock or not), which would swamp the rows.
    cmd = [sys.executable, os.path.abspath(__file__), "--run-shape", name] + (["--arena"] if arena else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} (arena={arena}) exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def new_user_table(shapes, repeats):
    import statistics

    print(
        f"{'shape':30} {'stock s':>8} {'enable s':>9} {'stock/enable':>12} {'range':>11} "
        f"{'peak shm stock':>15} {'enable':>8} {'fds stock':>10} {'enable':>7}"
    )
    for name in shapes:
        runs = {False: [], True: []}
        for r in range(repeats):
            for arena in ((False, True) if r % 2 == 0 else (True, False)):
                runs[arena].append(measure_shape(name, arena))
        med = {a: [statistics.median(x[k] for x in runs[a]) for k in range(3)] for a in runs}
        (ts, ms, fs), (te, me, fe) = med[False], med[True]
        # The ratio of each alternating pair: a range that spans 1.0 means
        # the row is within this machine's noise.
        pairs = [s[0] / e[0] for s, e in zip(runs[False], runs[True])]
        print(
            f"{SHAPES[name][0]:30} {ts:8.2f} {te:9.2f} {ts / te:11.2f}x {min(pairs):5.2f}-{max(pairs):4.2f}x "
            f"{ms / 2**20:13.1f}Mi {me / 2**20:6.1f}Mi {fs:10.0f} {fe:7.0f}",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--cases", default="a,b,c")
    ap.add_argument("--new-user", action="store_true", help="stock PyTorch against enable() on the shapes a new user tries")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--run-shape", help=argparse.SUPPRESS)
    ap.add_argument("--arena", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="ids, from: " + " ".join(SHAPES))
    args = ap.parse_args()
    if args.run_shape:
        run_shape(args.run_shape, args.arena)
        return
    if args.new_user:
        new_user_table(args.shapes.split(","), args.repeats)
        return
    print(f"{'case':24} {'strategy':16} {'batches/s':>10} {'peak fds':>9} {'peak RSS+shm':>13} {'shm left':>9}")
    for case in args.cases.split(","):
        for strategy in ("file_descriptor", "file_system", "arena"):
            rate, fds, mem, left = measure(case, strategy, args.batches)
            print(f"{CASES[case][0]:24} {strategy:16} {rate:10.1f} {fds:9d} {mem / 2**20:11.0f}Mi {left / 2**20:7.1f}Mi", flush=True)


if __name__ == "__main__":
    main()
