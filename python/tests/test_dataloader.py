"""DataLoader workers with enable(): batches allocated in the workers'
arenas, identical to PyTorch's own, under fork, spawn and forkserver."""

import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

import storage_sharing as ss  # noqa: E402
import storage_sharing.torch as st  # noqa: E402
import _workers as w  # noqa: E402


def batches(dataset, **kw):
    return list(DataLoader(dataset, batch_size=4, num_workers=2, **kw))


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("persistent", [False, True])
def test_batches_identical_to_pytorch(method, persistent):
    ds = w.SquareDataset(22)
    kw = dict(multiprocessing_context=method, persistent_workers=persistent, worker_init_fn=w.user_init)
    st.disable()
    expected = batches(ds, **kw)
    mapped = ss.remote_cache_size()
    st.enable()
    try:
        loader = DataLoader(ds, batch_size=4, num_workers=2, **kw)
        for _ in range(2 if persistent else 1):
            got = list(loader)
            assert same(got, expected)
        assert ss.remote_cache_size() > mapped, "batches came from the workers' arena segments"
        assert loader.worker_init_fn is w.user_init, "the user's loader is left as it was"
    finally:
        st.disable()


def test_pin_memory_and_many_small_tensors():
    ds = w.ManySmall(8, k=256)
    st.enable()
    try:
        got = batches(ds, pin_memory=True, multiprocessing_context="fork")
    finally:
        st.disable()
    expected = batches(ds, multiprocessing_context="fork")
    assert same(got, expected) and len(got[0]) == 256


def _dead(pid):
    """A zombie (its SIGCHLD sent) or reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_worker_kill9_leaves_received_batches_readable(shm_names):
    st.enable()
    try:
        loader = DataLoader(w.SquareDataset(400), batch_size=4, num_workers=2, multiprocessing_context="spawn")
        it = iter(loader)
        first = next(it)
        pids = [p.pid for p in it._workers]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        # DataLoader's SIGCHLD handler raises wherever this thread is when a
        # worker's death is signalled, once per signal: wait (catching it)
        # until both are dead, so no signal is left to raise later.
        noticed = []
        deadline = time.monotonic() + 60
        while not all(_dead(pid) for pid in pids):
            assert time.monotonic() < deadline, f"workers {pids} still alive after SIGKILL"
            try:
                time.sleep(0.01)
            except RuntimeError as e:
                noticed.append(e)
        # DataLoader notices (RuntimeError), or the pipe broke mid-message.
        try:
            for _ in it:
                pass
        except Exception as e:  # noqa: BLE001  (which one depends on timing)
            noticed.append(e)
        assert noticed, "the loader went on as if its workers lived"
        assert torch.equal(first[0][1], torch.full((3, 8, 8), 1.0)), "still readable after its producer died"
        del it, loader
        assert shm_names(pids) == []
    finally:
        st.disable()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_batches_report_shared_as_with_pytorch(method):
    ds = w.SquareDataset(8)

    def flags():
        loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=method,
                            collate_fn=w.collate_noting_shared)
        return [(in_worker, batch[0].is_shared(), batch[2]["label"].is_shared()) for batch, in_worker in loader]

    expected = flags()
    assert expected == [(True, True, True)] * 2, "PyTorch: shared in the worker and once received"
    st.enable()
    try:
        assert flags() == expected
        own = st.empty(4)
        assert own.is_shared() and own[1:].is_shared() and own.untyped_storage().is_shared()
        assert not torch.zeros(4).is_shared()
    finally:
        st.disable()
    assert not torch.zeros(4).is_shared()
