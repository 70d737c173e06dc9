"""PyTorch's side of benches/arena.rs.

  share SIZES...   median seconds of share_memory_() of a fresh CPU tensor
                   per size, one "size<TAB>seconds" line each.
  stream N         N tensors of 4-64 KiB through torch.multiprocessing.Queue
                   with the file_descriptor strategy, RLIMIT_NOFILE 256 in
                   both processes; prints arrived, errors, seconds and the
                   peak fds and mappings of both processes.
  big GIB          peak (RSS anon of both + /dev/shm growth) while sharing
                   a GIB GiB tensor with share_memory_() and reading it in
                   a child; prints the peak in bytes.
"""
import os, sys, time, resource, statistics, threading
import torch
import torch.multiprocessing as mp

torch.set_num_threads(2)


def fds():
    return len(os.listdir("/proc/self/fd"))


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def share(sizes):
    for n in sizes:
        reps = 50 if n <= 1 << 20 else 3
        ts = []
        for _ in range(reps + 1):
            t = torch.ones(n, dtype=torch.uint8)
            s = time.perf_counter()
            t.share_memory_()
            ts.append(time.perf_counter() - s)
            del t
        print(f"{n}\t{statistics.median(ts[1:])}", flush=True)


def consumer(q, res, n):
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    got = errors = 0
    pf = pm = 0
    first_error = ""
    for i in range(n):
        try:
            t = q.get(timeout=60)
        except Exception as e:  # what a receiver at its fd limit sees
            errors += 1
            first_error = first_error or repr(e)
            if errors > 20:
                break
            continue
        if t is None:
            break
        if int(t[0]) == (t.numel() & 0xFF):
            got += 1
        del t
        if i % 100 == 0:
            pf, pm = max(pf, fds()), max(pm, maps())
    res.put((got, errors, pf, pm, first_error))


def stream(n):
    mp.set_sharing_strategy("file_descriptor")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    ctx = mp.get_context("spawn")
    q, res = ctx.Queue(maxsize=64), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, res, n))
    p.start()
    import random
    rnd = random.Random(1)
    pf = pm = 0
    sent_err = ""
    s = time.perf_counter()
    for i in range(n):
        k = rnd.randint(4096, 65536)
        t = torch.empty(k, dtype=torch.uint8)
        t[0] = k & 0xFF
        try:
            q.put(t)
        except Exception as e:
            sent_err = repr(e)
            break
        if i % 100 == 0:
            pf, pm = max(pf, fds()), max(pm, maps())
    try:
        got, errors, cf, cm, err = res.get(timeout=120)
    except Exception as e:
        got, errors, cf, cm, err = -1, -1, -1, -1, repr(e)
    secs = time.perf_counter() - s
    p.join(10)
    if p.is_alive():
        p.kill()
    print(f"{got}\t{errors}\t{secs}\t{pf}\t{pm}\t{cf}\t{cm}\t{(err or sent_err)[:120]}")


def rss_anon(pid):
    with open(f"/proc/{pid}/status") as f:
        for l in f:
            if l.startswith("RssAnon:"):
                return int(l.split()[1]) * 1024
    return 0


def shmem():
    with open("/proc/meminfo") as f:
        for l in f:
            if l.startswith("Shmem:"):
                return int(l.split()[1]) * 1024
    return 0


def reader(q, done):
    t = q.get()
    # int64 view: every page is read, no widened copy (a uint8 sum would
    # allocate 8 bytes per element).
    _ = int(t.view(torch.int64).sum())
    done.put(1)
    time.sleep(1)


def big(gib):
    n = gib << 30
    base = shmem()
    ctx = mp.get_context("fork")
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=reader, args=(q, done))
    p.start()
    peak = [0]
    stop = [False]

    def sample():
        while not stop[0]:
            try:
                v = rss_anon(os.getpid()) + rss_anon(p.pid) + max(0, shmem() - base)
            except Exception:
                v = 0
            peak[0] = max(peak[0], v)
            time.sleep(0.01)

    th = threading.Thread(target=sample)
    th.start()
    t = torch.ones(n, dtype=torch.uint8)
    t.share_memory_()
    q.put(t)
    done.get(timeout=600)
    stop[0] = True
    th.join()
    p.join()
    print(peak[0])


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "share":
        share([int(a) for a in sys.argv[2:]])
    elif cmd == "stream":
        stream(int(sys.argv[2]))
    elif cmd == "big":
        big(int(sys.argv[2]))
