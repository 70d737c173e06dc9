"""torch.multiprocessing with storage_sharing.torch.enable(): the CPU cases
PyTorch's own multiprocessing tests check, on arena tensors."""

import gc
import os

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")
from multiprocessing.reduction import ForkingPickler  # noqa: E402

import storage_sharing as ss  # noqa: E402
import _workers as w  # noqa: E402

CONTEXTS = ["fork", "spawn", "forkserver"]


def roundtrip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_dtype_shape_stride_offset_kept(torch_enabled, dtype):
    st = torch_enabled
    src = (torch.arange(60) % 7).to(dtype).reshape(3, 4, 5)
    t = st.to_arena(src)
    assert st.in_arena(t)
    for view in (t, t[1], t.transpose(0, 2), t[:, 1:3, ::2], t.flatten()[7:]):
        got = roundtrip(view)
        assert got.dtype == view.dtype and got.shape == view.shape
        assert got.stride() == view.stride() and got.storage_offset() == view.storage_offset()
        assert torch.equal(got, view)


def test_pickled_form_is_the_handle_not_the_bytes(torch_enabled):
    t = torch_enabled.empty(1 << 20)
    assert len(ForkingPickler.dumps(t)) < 2000


def test_views_of_one_storage_stay_views(torch_enabled):
    x = torch_enabled.to_arena(torch.randn(5, 5))
    data = [x.untyped_storage(), x, x[2], x[:, 1]]
    new = roundtrip(data)
    base = new[0].data_ptr()
    for t in new[1:]:
        assert t.untyped_storage().data_ptr() == base
    assert torch.equal(new[1], x) and torch.equal(new[2], x[2]) and torch.equal(new[3], x[:, 1])
    new[1][2, 1] = 123.0
    assert new[2][1] == 123.0 and new[3][2] == 123.0 and x[2, 1] == 123.0


@pytest.mark.parametrize("method", CONTEXTS)
def test_consumer_writes_are_seen_by_producer(torch_enabled, method):
    ctx = mp.get_context(method)
    x = torch_enabled.empty(5, 5).zero_()
    q, done = ctx.Queue(), ctx.Event()
    q.put([x, x[:, 1]])
    p = ctx.Process(target=w.fill_first_with_4, args=(q, done), daemon=True)
    p.start()
    assert done.wait(60)
    p.join(60)
    assert p.exitcode == 0
    assert x.eq(4).all()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_receive_from_child_producer(torch_enabled, method):
    ctx = mp.get_context(method)
    for dtype in (torch.float32, torch.int64):
        q, done = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=w.send_arena_tensor_twice, args=(q, done, dtype), daemon=True)
        p.start()
        t1, t2 = q.get(timeout=60), q.get(timeout=60)
        assert t1.eq(1).all() and torch.equal(t1, t2) and t1.dtype == dtype
        assert ss.remote_cache_size() >= 1
        del t1, t2
        done.set()
        p.join(60)
        assert p.exitcode == 0


def test_simple_queue_and_pipe(torch_enabled):
    ctx = mp.get_context("spawn")
    x = torch_enabled.to_arena(torch.arange(10.0))
    a, b = ctx.Pipe()
    p = ctx.Process(target=w.pipe_roundtrip, args=(b,))
    p.start()
    a.send(x)
    assert a.recv() == 90.0
    p.join(60)
    assert torch.equal(x, torch.arange(10.0) * 2), "the child doubled the producer's tensor in place"
    sq, out = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=w.echo_sum, args=(sq, out))
    p.start()
    sq.put(x)
    assert out.get() == 90.0
    p.join(60)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_fills_producer_buffers(torch_enabled, method):
    st = torch_enabled
    with mp.get_context(method).Pool(2) as pool:
        buffers = [st.empty(2, 2).zero_() for _ in range(4)]
        results = pool.map(w.pool_fill, buffers, 1)
    assert all(torch.equal(r, torch.full((2, 2), 5.0)) for r in results)
    assert all(torch.equal(b, torch.full((2, 2), 4.0)) for b in buffers)


def test_spawn_args_and_inherited_tensor(torch_enabled):
    x = torch_enabled.empty(5, 5).zero_()
    for method in ("spawn", "fork"):
        p = mp.get_context(method).Process(target=w.add_3, args=(x,))
        p.start()
        p.join(60)
        assert p.exitcode == 0
    assert x.eq(6).all()


def test_autograd_leaf_and_parameter_sharing(torch_enabled):
    st = torch_enabled
    ctx = mp.get_context("spawn")
    for requires_grad in (True, False):
        var = st.to_arena(torch.arange(1.0, 26).view(5, 5)).requires_grad_(requires_grad)
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=w.receive_then_report, args=(q, out), daemon=True)
        p.start()
        q.put(var)
        name, rg, no_grad, values = out.get(timeout=60)
        p.join(60)
        assert (name, rg, no_grad) == ("Tensor", requires_grad, True) and values == var.tolist()
    param = torch.nn.Parameter(st.to_arena(torch.arange(1.0, 26).view(5, 5)))
    assert roundtrip(param).__class__ is torch.nn.Parameter
    iparam = torch.nn.Parameter(st.to_arena(torch.tensor([0])), requires_grad=False)
    p = ctx.Process(target=w.take_param, args=(iparam,))
    p.start()
    p.join(60)
    assert p.exitcode == 0


def test_non_leaf_still_refused(torch_enabled):
    var = torch_enabled.to_arena(torch.arange(1.0, 26)).requires_grad_(True) * 2
    with pytest.raises(RuntimeError, match="requires_grad"):
        mp.SimpleQueue().put(var)


def test_empty_and_ordinary_tensors_fall_back(torch_enabled):
    for dtype in (torch.float32, torch.int64):
        empty = torch.tensor([], dtype=dtype)
        q = mp.Queue()
        q.put(empty)
        assert torch.equal(q.get(timeout=10), empty)
    x = torch.randn(5, 5)
    data = [x.untyped_storage(), x, x[2], x[:, 1]]
    new = roundtrip(data)
    # Where PyTorch would copy it into a segment of its own, the storage
    # moves into an arena block in place instead (as share_memory_ moves it),
    # where PyTorch can swap a storage's memory; else PyTorch's own way.
    moved = torch_enabled._torch_compat.can_move_storages()
    assert torch_enabled.in_arena(x) == moved and x.is_shared()
    assert torch.equal(new[1], x) and torch.equal(new[2], x[2]) and torch.equal(new[3], x[:, 1])
    new[1][2, 1] = 42.0
    assert float(x[2, 1]) == 42.0 and float(new[3][2]) == 42.0, "one memory"
    # PyTorch's own reduction sends meta tensors from 2.5 on (2.4 fails stock).
    if torch_enabled._torch_compat._minor_version(str(torch.__version__)) >= (2, 5):
        meta = torch.ones(3, device="meta")
        assert roundtrip(meta).shape == (3,)


def test_is_shared_and_share_memory_unchanged(torch_enabled):
    t = torch.randn(5, 5)
    assert not t.is_shared()
    t.share_memory_()
    assert t.is_shared()
    torch.tensor([]).share_memory_()


def test_fds_stay_flat_with_many_tensors(torch_enabled):
    st = torch_enabled
    ctx = mp.get_context("spawn")
    n = 1000
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=w.hold_many, args=(q, out, n))
    p.start()
    tensors = [st.empty(16).fill_(1) for _ in range(n)]
    for t in tensors:
        q.put(t)
    fds, total, segments = out.get(timeout=120)
    p.join(60)
    assert total == n and segments == 1
    assert fds < 64, f"the consumer held {fds} fds for {n} tensors"


def test_blocks_come_back_when_consumer_lets_go(torch_enabled):
    st = torch_enabled
    arena = st.process_arena()
    arena.collect()
    before = arena.stats()["deferred_blocks"]
    x = st.empty(100)
    payload = ForkingPickler.dumps(x)
    # Opened as a consumer would (in its own process it would have no sent
    # storage to come back to): a view with a hold of its own.
    st._sent.clear()
    y = ForkingPickler.loads(payload)
    assert y.untyped_storage()._cdata != x.untyped_storage()._cdata
    del x
    gc.collect()
    assert arena.stats()["deferred_blocks"] == before + 1, "freed by the producer, held by the open view"
    del y
    gc.collect()
    _, recycled = arena.collect()
    assert recycled >= 1 and arena.stats()["deferred_blocks"] == before


def test_disable_restores_pytorch(torch_enabled):
    st = torch_enabled
    x = st.empty(10).fill_(2)
    st.disable()
    assert not st.is_enabled() and "STORAGE_SHARING_TORCH" not in os.environ
    y = roundtrip(x)  # PyTorch's reduction moves it into its own shm
    assert torch.equal(y, torch.full((10,), 2.0))
    assert torch.UntypedStorage._new_shared(8).is_shared()
    st.enable()
    arena_storage = torch.UntypedStorage._new_shared(8)
    assert st.in_arena(arena_storage) and arena_storage.is_shared()
