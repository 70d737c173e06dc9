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


def arena_shm_bytes():
    """Bytes of memory behind the arena segments this process maps now:
    the segments are the arena mappings of /proc/self/maps (by inode),
    their memory the allocated blocks of the descriptor this process holds
    for each (by fd) or of its /dev/shm name (by name)."""
    mapped = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "ss_arena_" in fields[5]:
                mapped[int(fields[4])] = fields[5].strip()
    held = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "ss_arena_" in os.readlink(f"/proc/self/fd/{fd}"):
                s = os.stat(f"/proc/self/fd/{fd}")
                held[s.st_ino] = s.st_blocks * 512
        except OSError:
            pass  # the listing's own descriptor, or one closed meanwhile
    total = 0
    for inode, path in mapped.items():
        if inode in held:
            total += held[inode]
        elif path.startswith("/dev/shm/"):
            total += os.stat(path).st_blocks * 512
        else:
            raise AssertionError(f"arena mapping {path} (inode {inode}) has no descriptor here to count its memory by")
    return total


class SmallItems(torch.utils.data.Dataset):
    """What most DataLoaders move: a few small tensors and a label per item."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


def send_one_tiny_tensor(queue, segment_size, done):
    """Enables with `segment_size`, sends one 64-byte tensor, reports the
    memory behind its own arena, then waits."""
    import storage_sharing.torch as st

    st.disable()
    st.enable(segment_size=segment_size)
    t = st.empty(16).fill_(3)
    queue.put(t)
    queue.put((arena_shm_bytes(), st.process_arena().stats()["reserved_bytes"]))
    done.wait(120)
