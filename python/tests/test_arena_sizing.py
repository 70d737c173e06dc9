"""enable() is never the hungrier choice: a worker's arena segment costs
what its batches need (pages reserved as blocks are carved, not the whole
segment_size at creation), a small tensor kept past its epoch keeps its own
pages, not its dead worker's segment, and options are checked at enable().

Memory is counted from this process's side: the arena segments it maps
(/proc/self/maps) and the memory behind each (its descriptor's allocated
blocks). Bounds leave room for the hold-slot area of each segment and one
reservation step (1 MiB); the old sizing failed them by 100x or more."""

import gc

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")
from torch.utils.data import DataLoader  # noqa: E402

import storage_sharing as ss  # noqa: E402
import _leak_workers as lw  # noqa: E402

MiB = 1 << 20
WAIT = 60  # seconds: a hang guard only
# What one small-batch worker's segment may cost: one reservation step,
# its header and hold-slot area (164 KiB with 4096 slots), some slack.
PER_WORKER = 2 * MiB


def held_now(base):
    gc.collect()
    return lw.arena_shm_bytes() - base


def test_non_persistent_small_batches_cost_a_step_per_worker_not_a_segment(torch_enabled):
    loader = DataLoader(lw.SmallItems(64), batch_size=8, num_workers=2, multiprocessing_context="fork")
    gc.collect()
    ss.trim_remote_cache()
    base = lw.arena_shm_bytes()
    during, after = [], []
    for _ in range(5):
        n = 0
        for i, (x, y) in enumerate(loader):
            n += len(y)
            if i == 4:
                during.append(held_now(base))
        assert n == 64 and torch.equal(x[0], torch.full((4,), float(int(y[0]))))
        del x, y
        after.append(held_now(base))
    # Before: each worker's 256 MiB segment was reserved whole, 512 MiB
    # held in the main process during every epoch.
    assert max(during) <= 2 * PER_WORKER, f"bytes behind the workers' segments during each epoch: {during}"
    assert after == [0] * 5, f"bytes still held after each epoch: {after}"


def test_early_break_with_a_new_iterator_holds_one_generation_of_workers(torch_enabled):
    loader = DataLoader(lw.SmallItems(400), batch_size=4, num_workers=2, multiprocessing_context="fork")
    gc.collect()
    ss.trim_remote_cache()
    base = lw.arena_shm_bytes()
    peak = 0
    for k in range(10):
        for batch in loader:
            break
        # `batch` (over a worker of this round) outlives its iterator.
        assert int(batch[1][0]) == 0
        peak = max(peak, held_now(base))
    del batch
    assert peak <= 3 * PER_WORKER, f"peak bytes behind arena segments over 10 new iterators: {peak}"
    assert held_now(base) == 0


def test_kept_labels_keep_their_pages_not_their_dead_workers_segments(torch_enabled):
    # A metric history: the 32 labels of each epoch's last batch, 6 epochs.
    loader = DataLoader(lw.SmallItems(64), batch_size=32, num_workers=2, multiprocessing_context="fork")
    gc.collect()
    ss.trim_remote_cache()
    base = lw.arena_shm_bytes()
    history, held = [], []
    for _ in range(6):
        for x, labels in loader:
            pass
        history.append(labels)
        del x, labels
        held.append(held_now(base))
    assert all(torch.equal(h, torch.arange(32, 64)) for h in history), "the kept tensors keep their values"
    # Before: 256 MiB more per epoch (the dead worker's whole segment).
    # Now: per dead segment, the kept block's page, its header and the
    # page of its hold slot.
    assert held[-1] <= 6 * 64 * 1024, f"bytes held after each epoch for 6 x 256 bytes kept: {held}"
    del history
    assert held_now(base) == 0


def test_four_workers_moving_3kb_hold_a_step_each(torch_enabled):
    loader = DataLoader(lw.SmallItems(96), batch_size=8, num_workers=4, multiprocessing_context="fork")
    gc.collect()
    ss.trim_remote_cache()
    base = lw.arena_shm_bytes()
    peak = 0
    for _ in loader:
        peak = max(peak, held_now(base))
    assert peak <= 4 * PER_WORKER, f"peak bytes behind 4 workers' segments: {peak} (before: 4 x 256 MiB)"


def test_a_large_segment_size_is_an_upper_bound_not_a_reservation(torch_enabled):
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=lw.send_one_tiny_tensor, args=(q, 1 << 30, done), daemon=True)
    p.start()
    try:
        gc.collect()
        base = lw.arena_shm_bytes()
        t = q.get(timeout=WAIT)
        producer_bytes, producer_reserved = q.get(timeout=WAIT)
        here = held_now(base)
    finally:
        done.set()
        p.join(WAIT)
    assert torch.equal(t, torch.full((16,), 3.0))
    # Before: the 1 GiB segment was reserved whole for these 64 bytes.
    assert producer_reserved == MiB, f"the producer reserved {producer_reserved} data bytes"
    assert producer_bytes <= PER_WORKER and here <= PER_WORKER, (producer_bytes, here)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(segment_size=-1, large_threshold=-1), "segment_size"),
        (dict(segment_size=0, large_threshold=0), "segment_size"),
        (dict(segment_size=1000, large_threshold=100), "segment_size"),
        (dict(segment_size=1 << 60), "segment_size"),
        (dict(segment_size=64 * MiB, large_threshold=0), "large_threshold"),
        (dict(segment_size=64 * MiB, large_threshold=-5), "large_threshold"),
        (dict(segment_size=64 * MiB, large_threshold=32 * MiB), "large_threshold"),
        (dict(segment_size=1.5e6), "segment_size"),
        (dict(large_threshold="big"), "large_threshold"),
    ],
)
def test_enable_checks_each_option_and_names_it(kwargs, option):
    st = pytest.importorskip("storage_sharing.torch")
    st.disable()
    with pytest.raises((ValueError, TypeError)) as e:
        st.enable(**kwargs)
    assert option in str(e.value), str(e.value)
    assert not st.is_enabled(), "a refused enable() patches nothing"
