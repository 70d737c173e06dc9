"""Functions the tests run in other processes (importable under spawn)."""

import os
import signal
import time

import torch


def fill_first_with_4(queue, done):
    data = queue.get()
    data[0][:] = 4
    done.set()


def pool_fill(t):
    t.fill_(4)
    return t.add(1)


def send_arena_tensor_twice(queue, done, dtype):
    import storage_sharing.torch as st

    st.enable()
    t = st.empty(5, 5, dtype=dtype)
    t.fill_(1)
    queue.put(t)
    queue.put(t)
    done.wait(60)


def echo_sum(queue, out):
    t = queue.get()
    out.put(float(t.double().sum()))


def receive_then_report(queue, out):
    var = queue.get()
    out.put((type(var).__name__, var.requires_grad, var.grad is None, var.tolist()))


def take_param(p):
    return p + 1


def add_3(t):
    t.add_(3)


def pipe_roundtrip(conn):
    t = conn.recv()
    t.mul_(2)
    conn.send(t.sum().item())
    conn.close()


def hold_many(queue, out, n):
    import storage_sharing as ss

    got = [queue.get() for _ in range(n)]
    fds = len(os.listdir("/proc/self/fd"))
    out.put((fds, sum(int(t[0]) for t in got), ss.remote_cache_size()))
    time.sleep(0.2)


def produce_and_wait(queue, ready):
    """Allocates tensors in the arena, sends them, then waits to be killed."""
    import storage_sharing.torch as st

    st.enable()
    ts = [st.empty(1000).fill_(i) for i in range(8)]
    ts.append(st.empty(3 << 20, dtype=torch.uint8).fill_(7))  # a large block
    for t in ts:
        queue.put(t)
    ready.set()
    while True:
        time.sleep(1)


def consume_and_wait(queue, ready, out):
    got = queue.get()
    out.put(float(got.sum()))
    ready.set()
    while True:
        time.sleep(1)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


class SquareDataset(torch.utils.data.Dataset):
    def __init__(self, n, shape=(3, 8, 8), dtype=torch.float32):
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.full(self.shape, float(i)).to(self.dtype)
        return x, i, {"label": torch.tensor(i * 2), "pair": (torch.arange(i, i + 3), float(i))}


class ManySmall(torch.utils.data.Dataset):
    def __init__(self, n, k=256):
        self.n, self.k = n, k

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return tuple(torch.full((4,), float(i + j)) for j in range(self.k))


def user_init(worker_id):
    os.environ["SS_TEST_WORKER_INIT"] = str(worker_id)


def collate_noting_shared(samples):
    """default_collate, plus whether the worker saw its batch's first tensor as shared."""
    batch = torch.utils.data.default_collate(samples)
    return batch, batch[0].is_shared()
