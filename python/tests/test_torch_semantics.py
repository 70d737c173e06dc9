"""Arena tensors keep PyTorch's sharing semantics: a received tensor sent on
stays shared with its producer (A -> B -> C), share_memory_() leaves arena
memory where it is, empty tensors work, is_shared() holds in a process
that never called enable(), and enable()'s options cannot silently change."""

import gc
import os

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")
from multiprocessing.reduction import ForkingPickler  # noqa: E402

import _relay_workers as rw  # noqa: E402

WAIT = 60  # seconds: a hang guard only


def roundtrip(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def run_chain(ctx, x, drop_a, drop_b, st):
    """A (this process) sends x to B, B sends it on to C; returns what B and
    C report, by name. With drop_a, A lets go of its tensor once B has it
    and allocates over freed blocks (which would land on x's block were it
    reused); C starts receiving only then."""
    a_to_b, b_to_c, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    b_wrote, c_wrote, finish, go = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    b = ctx.Process(target=rw.relay_b, args=(a_to_b, b_to_c, b_wrote, c_wrote, out, finish, drop_b), daemon=True)
    c = ctx.Process(target=rw.relay_c, args=(b_to_c, b_wrote, c_wrote, out, finish, go), daemon=True)
    b.start()
    c.start()
    a_to_b.put(x)
    fillers = []
    if drop_a:
        assert b_wrote.wait(WAIT) if drop_b else True
        del x
        gc.collect()
        st.process_arena().collect()
        fillers = [st.empty(4).fill_(-1) for _ in range(64)]
    go.set()
    got = {}
    try:
        for _ in range(2):
            name, values, shared = out.get(timeout=WAIT)
            got[name] = (values, shared)
    finally:
        finish.set()
        b.join(WAIT)
        c.join(WAIT)
    assert b.exitcode == 0 and c.exitcode == 0
    assert all(f.eq(-1).all() for f in fillers)
    return got


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_received_tensor_sent_on_stays_shared_with_its_producer(torch_enabled, method):
    st = torch_enabled
    x = st.empty(4).zero_()
    x[0] = 100
    got = run_chain(mp.get_context(method), x, drop_a=False, drop_b=False, st=st)
    expected = [100.0, 300.0, 200.0, 0.0]
    assert x.tolist() == expected, "A sees what B and C wrote"
    assert got["B"] == (expected, True)
    assert got["C"] == (expected, True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_block_sent_on_lives_while_the_last_receiver_holds_it(torch_enabled, method):
    # A frees its tensor and B drops its copy before C opens the handle B
    # sent: the share in flight, then C's view, keep the block from reuse.
    st = torch_enabled
    x = st.empty(4).zero_()
    x[0] = 100
    got = run_chain(mp.get_context(method), x, drop_a=True, drop_b=True, st=st)
    assert got["C"] == ([100.0, 300.0, 200.0, 0.0], True)


def test_received_tensor_sent_on_in_process_stays_over_the_same_bytes(torch_enabled):
    st = torch_enabled
    x = st.empty(4).zero_()
    y = roundtrip(x)
    z = roundtrip(y)
    z[3] = 5
    assert x[3] == 5 and y[3] == 5
    assert z.is_shared() and st.in_arena(z)


def test_a_storage_received_in_its_own_process_is_the_storage_sent(torch_enabled):
    # PyTorch's test_multiprocessing _test_preserve_sharing: the storage,
    # a tensor and two views through one Queue come back over the very
    # storage that was sent (its _cdata), the views still views of it.
    x = torch.randn(5, 5)
    data = [x.untyped_storage(), x, x[2], x[:, 1]]
    q = mp.get_context("spawn").Queue()
    q.put(data)
    got = q.get(timeout=WAIT)
    assert got[0]._cdata == data[0]._cdata
    assert all(t.untyped_storage()._cdata == data[0]._cdata for t in got[1:])
    got[3][4] = 7
    assert x[4, 1] == 7
    if torch_enabled._torch_compat.can_move_storages():
        assert torch_enabled.in_arena(x), "a fresh storage moves into the arena under file_descriptor"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_storage_back_from_another_process_is_the_storage_sent(torch_enabled, method):
    # Stock PyTorch: parent -> child -> parent gives back the very storage
    # (same _cdata, same data_ptr). Before: a second mapping of the
    # parent's own segment, at another address.
    st = torch_enabled
    ctx = mp.get_context(method)
    to_b, to_a, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    x = st.empty(8).fill_(2)
    p = ctx.Process(target=rw.send_back, args=(to_b, to_a, done), daemon=True)
    p.start()
    try:
        to_b.put(x)
        y = to_a.get(timeout=WAIT)
    finally:
        done.set()
        p.join(WAIT)
    assert p.exitcode == 0
    assert y.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)


def test_fresh_storages_keep_pytorchs_segments_under_file_system(torch_enabled):
    st = torch_enabled
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        x = torch.zeros(4)
        y = roundtrip(x)
        assert x.is_shared() and not st.in_arena(x), "PyTorch's named segment, as without enable()"
        y[1] = 3
        assert x[1] == 3
    finally:
        mp.set_sharing_strategy(before)


@pytest.mark.parametrize("received", [False, True])
def test_share_memory_keeps_arena_memory_in_place(torch_enabled, received):
    st = torch_enabled
    x = st.empty(6).zero_()
    t = roundtrip(x) if received else x
    ptr = t.data_ptr()
    assert t.share_memory_() is t
    t.untyped_storage().share_memory_()
    assert t.data_ptr() == ptr and t.is_shared()
    t[1] = 9
    assert x[1] == 9, "still the same bytes"
    if not received:
        assert st.in_arena(t)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_share_memory_in_the_receiver_keeps_its_writes_visible(torch_enabled, method):
    ctx = mp.get_context(method)
    x = torch_enabled.empty(8).zero_()
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=rw.share_memory_then_write, args=(q, done), daemon=True)
    p.start()
    q.put(x)
    assert done.get(timeout=WAIT) is True, "share_memory_() did not move the received tensor"
    p.join(WAIT)
    assert p.exitcode == 0
    assert x.eq(7).all()


def test_share_memory_of_ordinary_tensors_is_pytorchs(torch_enabled):
    t = torch.zeros(4)
    assert not t.is_shared()
    t.share_memory_()
    assert t.is_shared()


def test_zero_size_tensors(torch_enabled):
    st = torch_enabled
    e = st.empty(0, 5)
    assert e.shape == (0, 5) and e.numel() == 0
    assert st.to_arena(torch.empty(0)).shape == (0,)
    s = st.new_storage(0)
    assert s.nbytes() == 0
    # As PyTorch's own empty shared storages: shared, sent as empty.
    assert torch.UntypedStorage._new_shared(0).is_shared() and s.is_shared() and e.is_shared()
    assert roundtrip(e).shape == (0, 5)
    with pytest.raises(ValueError, match="nbytes"):
        st.new_storage(-1)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_zero_size_tensor_through_a_queue(torch_enabled, method):
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=rw.report_received, args=(q, out), daemon=True)
    p.start()
    q.put(torch_enabled.empty(0, 5, dtype=torch.int64))
    shape, values, _ = out.get(timeout=WAIT)
    p.join(WAIT)
    assert p.exitcode == 0 and shape == (0, 5) and values == []


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_is_shared_in_a_receiver_started_before_enable(method):
    import storage_sharing.torch as st

    st.disable()
    assert "STORAGE_SHARING_TORCH" not in os.environ
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=rw.report_received, args=(q, out), daemon=True)
    p.start()  # before enable(): nothing in its environment says so
    st.enable()
    try:
        x = st.empty(3).fill_(2)
        q.put(x)
        shape, values, shared = out.get(timeout=WAIT)
        p.join(WAIT)
    finally:
        st.disable()
    assert p.exitcode == 0 and values == [2.0, 2.0, 2.0]
    assert shared, "arena memory is shared memory in the receiver too"


def test_enable_with_other_options_is_refused(torch_enabled):
    st = torch_enabled
    st.empty(4)  # the arena exists
    env = os.environ[st.ENV]
    with pytest.raises(ValueError, match="enabled already with segment_size=268435456"):
        st.enable(segment_size=32 << 20, large_threshold=1 << 20)
    assert os.environ[st.ENV] == env, "children are not told other options"
    assert st._options == {"segment_size": st.DEFAULT_SEGMENT_SIZE, "large_threshold": st.DEFAULT_LARGE_THRESHOLD}
    st.enable()  # the same options: nothing changes
    st.disable()
    with pytest.raises(ValueError, match="arena was made with"):
        st.enable(segment_size=32 << 20, large_threshold=1 << 20)


def test_enable_options_apply_before_the_arena_exists():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=rw.enable_twice_before_any_arena, args=(out,), daemon=True)
    p.start()
    (seg_bytes, env), refused, env_after = out.get(timeout=WAIT)
    p.join(WAIT)
    assert p.exitcode == 0
    assert seg_bytes == 32 << 20 and env == f"{32 << 20}:{2 << 20}", "applied: no arena was made yet"
    assert refused is not None and "enabled already with segment_size=33554432" in refused
    assert env_after == env


def test_reshare_refuses_unheld_and_foreign_answers(torch_enabled):
    import storage_sharing as ss
    from storage_sharing import _native

    st = torch_enabled
    arena = st.process_arena()
    x = st.empty(4)
    address = arena.fd_server_address()
    unopened = arena._native.share(x.data_ptr())
    with pytest.raises(ValueError, match="only a consumer that holds the block"):
        _native.reshare(unopened, address)  # proves no hold: refused, no share made
    arena.unshare(unopened)
    # A handle naming another producer (our parent) sent to this process's
    # server: whoever answers must be the producer itself.
    raw = bytearray(bytes(arena._native.share(x.data_ptr())))
    arena.unshare(ss.Handle.from_bytes(bytes(raw)))
    raw[8:12] = os.getppid().to_bytes(4, "little")
    with pytest.raises(PermissionError, match="not to process"):
        _native.reshare(ss.Handle.from_bytes(bytes(raw)), address)
