"""Shared memory, descriptors and mappings stay bounded by what is live:
DataLoader epochs with non-persistent workers, large tensors through a
Queue, and tensors PyTorch made (not born in the arena)."""

import gc

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")
from multiprocessing.reduction import ForkingPickler  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import storage_sharing as ss  # noqa: E402
import _leak_workers as lw  # noqa: E402
import _workers as w  # noqa: E402


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_non_persistent_workers_leave_nothing_mapped_after_each_epoch(torch_enabled, method):
    loader = DataLoader(w.SquareDataset(16), batch_size=4, num_workers=2, multiprocessing_context=method)
    gc.collect()
    ss.trim_remote_cache()
    base = (ss.remote_cache_size(), lw.arena_mappings())
    after = []
    # Spawned workers import torch first (about 1.5 s each): 3 epochs
    # show the growth there as well as 8 do.
    epochs = 8 if method == "fork" else 3
    for _ in range(epochs):
        n = 0
        for batch in loader:
            n += len(batch[1])
        assert n == 16
        del batch
        gc.collect()
        after.append((ss.remote_cache_size(), lw.arena_mappings()))
    # Before: one more worker segment kept mapped per epoch, for good.
    assert after == [base] * epochs, f"(remote segments, arena mappings) after each epoch: {after}, before: {base}"


def test_last_batch_kept_past_the_epoch_goes_with_it(torch_enabled):
    loader = DataLoader(w.SquareDataset(8), batch_size=4, num_workers=2, multiprocessing_context="fork")
    base = ss.remote_cache_size()
    for _ in range(4):
        kept = list(loader)
        assert ss.remote_cache_size() > base, "the batches are over the workers' segments"
        assert torch.equal(kept[1][0][0], torch.full((3, 8, 8), 4.0))
        del kept
        gc.collect()
        assert ss.remote_cache_size() == base


def test_large_tensors_through_a_queue_under_1024_fds(torch_enabled):
    # 1100 blocks of 64 KiB + 4 bytes, each above the 64 KiB threshold: one
    # segment per tensor. Before: every segment stayed open in the
    # consumer (TooManyFilesError near 1012) and in the producer.
    n, numel = 1100, (64 << 10) // 4 + 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=lw.large_queue_under_fd_limit, args=(out, n, numel, 1 << 20, 64 << 10, 16))
    p.start()
    got, peak_fds, peak_maps, producer_exit, error = out.get(timeout=600)
    p.join(60)
    assert error is None, error
    assert got == n and producer_exit == 0
    assert peak_fds < 100, f"consumer peak descriptors {peak_fds} for {n} tensors received one by one"
    assert peak_maps < 40, f"consumer peak arena mappings {peak_maps}"


def test_fresh_tensors_cost_no_descriptor_each(torch_enabled):
    if not torch_enabled._torch_compat.can_move_storages():
        pytest.skip("this PyTorch cannot move a storage into the arena (no UntypedStorage._swap_data_ptr_): its own sharing, a descriptor each")
    n = 2000
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=lw.fresh_producer, args=(q, n, done))
    p.start()
    base = lw.open_fds()
    kept, peak = [], base
    try:
        for i in range(n):
            t = q.get(timeout=120)
            assert torch.equal(t, torch.full((16,), float(i)))
            kept.append(t)  # all alive at once: PyTorch's way holds one fd per tensor
            peak = max(peak, lw.open_fds())
        done.set()
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert p.exitcode == 0
    assert peak - base < 32, f"{peak - base} more descriptors for {n} live tensors"
    assert ss.remote_cache_size() <= 2


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_fresh_tensor_is_shared_in_place_like_share_memory(torch_enabled, method):
    st = torch_enabled
    ctx = mp.get_context(method)
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=lw.add_100_then_done, args=(q, done))
    p.start()
    t = torch.arange(4.0)
    view = t[1:]
    q.put(t)
    assert done.wait(60)
    p.join(60)
    if st._torch_compat.can_move_storages():
        assert t.is_shared() and st.in_arena(t), "moved to an arena block in place, as share_memory_ moves it"
    else:
        assert t.is_shared() and not st.in_arena(t), "PyTorch without _swap_data_ptr_: its own shared memory"
    assert torch.equal(t, torch.arange(4.0) + 100), "the receiver's writes are the sender's"
    assert torch.equal(view, t[1:]) and view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def test_storage_pytorch_shared_already_keeps_its_memory(torch_enabled):
    st = torch_enabled
    t = torch.arange(4.0).share_memory_()
    before = t.untyped_storage().data_ptr()
    ForkingPickler.loads(ForkingPickler.dumps(t))
    assert t.untyped_storage().data_ptr() == before and not st.in_arena(t), "PyTorch's shared memory is not moved"
