"""kill -9 of a producer or of a consumer: nothing left in /dev/shm, no
daemon, and the survivor keeps its tensors readable."""

import gc
import os
import signal

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import _workers as w  # noqa: E402


def manager_daemons_of(pids):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid in pids and b"shm_manager" in cmd:
            found.append(int(entry))
    return found


def test_producer_kill9(torch_enabled, shm_names):
    # A by-name arena of an earlier test may have started this process's
    # manager (the wheel installs one the package finds); enable() starts none.
    daemons_before = manager_daemons_of([os.getpid()])
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=w.produce_and_wait, args=(q, ready), daemon=True)
    p.start()
    got = [q.get(timeout=60) for _ in range(9)]
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    for i, t in enumerate(got[:8]):
        assert t.eq(i).all(), "a survivor keeps reading the dead producer's blocks"
    assert got[8].eq(7).all() and got[8].numel() == 3 << 20
    got[0].add_(1)  # and writing them
    assert shm_names([p.pid]) == [] and manager_daemons_of([p.pid, os.getpid()]) == daemons_before
    del got
    gc.collect()


def test_consumer_kill9_gives_the_blocks_back(torch_enabled, shm_names):
    st = torch_enabled
    ctx = mp.get_context("spawn")
    arena = st.process_arena()
    arena.collect()
    before = arena.stats()["deferred_blocks"]
    q, ready, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=w.consume_and_wait, args=(q, ready, out), daemon=True)
    p.start()
    x = st.empty(1000).fill_(1)
    q.put(x)
    assert out.get(timeout=60) == 1000.0 and ready.wait(60)
    del x
    gc.collect()
    assert arena.stats()["deferred_blocks"] == before + 1, "the consumer holds the block"
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    reclaimed, recycled = arena.collect()
    assert reclaimed >= 1 and recycled >= 1 and arena.stats()["deferred_blocks"] == before
    assert shm_names([p.pid, os.getpid()]) == []
