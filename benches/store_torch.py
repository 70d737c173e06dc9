"""Helper of benches/store.rs.

store_torch.py server <use_libuv 0|1>   serve a PyTorch TCPStore, print its port, live until stdin closes
store_torch.py client <port> <n>        time n set+get round trips with PyTorch's client, print "US <median µs>"
"""
import statistics
import sys
import time
from datetime import timedelta

import torch.distributed as dist

if sys.argv[1] == "server":
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False,
                      use_libuv=sys.argv[2] == "1")
    print("PORT", s.port, flush=True)
    sys.stdin.read()
else:
    port, n = int(sys.argv[2]), int(sys.argv[3])
    c = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=60), wait_for_workers=False)
    value = b"x" * 32
    for i in range(200):
        c.set("bench/py", value)
        c.get("bench/py")
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n // 5):
            c.set("bench/py", value)
            c.get("bench/py")
        samples.append((time.perf_counter() - t0) / (n // 5) * 1e6)
    print("US", statistics.median(samples), flush=True)
