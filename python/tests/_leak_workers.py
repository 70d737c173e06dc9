"""Functions the leak tests run in other processes (importable under spawn)."""

import os
import resource

import torch


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def arena_mappings():
    """Arena segments (by-fd memfds) this process has mapped now."""
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "memfd:ss_arena_" in line})


def large_producer(queue, acks, n, numel, window):
    """Sends `n` fresh arena tensors above the large threshold, at most
    `window` of them not yet acknowledged by the consumer."""
    import storage_sharing.torch as st

    for i in range(n):
        if i >= window:
            acks.get(timeout=120)
        t = st.empty(numel)
        t[0] = i
        queue.put(t)
        del t


def large_queue_under_fd_limit(out, n, numel, segment_size, large_threshold, window):
    """Consumer at RLIMIT_NOFILE 1024 (its producer, a child, inherits it):
    receives `n` large tensors one by one; reports how many arrived in
    order and its peak descriptors and arena mappings."""
    import storage_sharing.torch as st

    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    # Enabled on import with the parent's options (its environment); other
    # options apply only after disable(), before this process's arena exists.
    st.disable()
    st.enable(segment_size=segment_size, large_threshold=large_threshold)
    ctx = torch.multiprocessing.get_context("spawn")
    queue, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=large_producer, args=(queue, acks, n, numel, window))
    p.start()
    got = peak_fds = peak_maps = 0
    error = None
    try:
        for i in range(n):
            t = queue.get(timeout=120)
            if int(t[0]) == i and t.numel() == numel:
                got += 1
            del t
            acks.put(1)
            peak_fds = max(peak_fds, open_fds())
            peak_maps = max(peak_maps, arena_mappings())
    except Exception as e:  # noqa: BLE001  (reported to the test)
        error = f"{type(e).__name__}: {e}"
    p.join(60)
    if p.is_alive():
        p.kill()
    out.put((got, peak_fds, peak_maps, p.exitcode, error))


def fresh_producer(queue, n, done):
    """Sends `n` tensors made by PyTorch (not in the arena), then stays
    until the consumer is done (PyTorch's file_descriptor strategy needs
    the sender alive until each tensor is received)."""
    import storage_sharing.torch  # noqa: F401  (enabled by the parent's environment)

    for i in range(n):
        queue.put(torch.full((16,), float(i)))
    done.wait(300)


def add_100_then_done(queue, done):
    t = queue.get()
    t.add_(100)
    done.set()
