"""PyTorch's side of benches/sharing.rs: per-message latency of sending an
already-shared 4 KiB / 16 MiB tensor through torch.multiprocessing.Queue to
a child and getting an ack, with both sharing strategies, next to a 1-byte
pipe round trip between the same two Python processes. Prints one
"label<TAB>median_us<TAB>p90_us" line per row."""
import os, sys, time
import torch
import torch.multiprocessing as mp

def child(q, ack, r, w):
    while True:
        msg = q.get()
        if msg is None:
            break
        if msg == "pipe":
            while True:
                b = os.read(r, 1)
                if b == b"q":
                    break
                os.write(w, b)
            ack.put(1)
            continue
        t = msg
        _ = int(t[0]) ^ int(t[-1])
        del t, msg
        ack.put(1)

def stats(us):
    us.sort()
    return us[len(us) // 2], us[len(us) * 9 // 10]

def main():
    n_small, n_big = (int(a) for a in sys.argv[1:3])
    ctx = mp.get_context("fork")  # the pipe fds are inherited
    q, ack = ctx.SimpleQueue(), ctx.SimpleQueue()
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = ctx.Process(target=child, args=(q, ack, r1, w2))
    p.start()
    q.put("pipe")
    us = []
    for i in range(n_small + 50):
        t0 = time.perf_counter()
        os.write(w1, b"x")
        os.read(r2, 1)
        if i >= 50:
            us.append((time.perf_counter() - t0) * 1e6)
    os.write(w1, b"q")
    ack.get()
    rows = [("python 1-byte pipe round trip", stats(us))]
    for strategy in ("file_descriptor", "file_system"):
        mp.set_sharing_strategy(strategy)
        for label, size, n in (("4 KiB", 4096, n_small), ("16 MiB", 16 << 20, n_big)):
            t = torch.zeros(size, dtype=torch.uint8).share_memory_()
            us = []
            for i in range(n + 10):
                t0 = time.perf_counter()
                q.put(t)
                ack.get()
                if i >= 10:
                    us.append((time.perf_counter() - t0) * 1e6)
            rows.append(("torch mp queue %s %s" % (label, strategy), stats(us)))
    q.put(None)
    p.join()
    for label, (med, p90) in rows:
        print("%s\t%.1f\t%.1f" % (label, med, p90))

if __name__ == "__main__":
    main()
