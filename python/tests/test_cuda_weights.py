"""storage_sharing.cuda: a model's weights shared whole, with real
processes. Every test runs on the host backend (device "cpu"); those
parametrized over the device run on "cuda:0" too where a GPU is present
(the GPU run of scripts/gpu), and skip saying so where it is not."""

import ctypes
import gc
import os
import pickle
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import _pool_workers as pw  # noqa: E402

import storage_sharing as ss  # noqa: E402
from storage_sharing import cuda  # noqa: E402

NO_CUDA = "no CUDA device here: the GPU run (scripts/gpu) covers this case"
CUDA0 = pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))
DEVICES = ["cpu", CUDA0]
KINDS = ["vmm", "legacy"]


def segments_hold(segments, tensors):
    """Whether every tensor with bytes lies in one of the segments."""
    return all(any(b <= t.data_ptr() < b + n for b, n in segments) for t in tensors if t.numel())


@pytest.fixture(autouse=True)
def no_pool_names_left():
    """Every legacy-kind host pool this process made is unlinked once the
    pool is gone."""
    yield
    gc.collect()
    ours = [n for n in os.listdir("/dev/shm") if n.startswith(f"ss_pool_{os.getpid()}_")]
    assert ours == [], "a pool left its shm names behind"


@pytest.fixture
def killed_producers():
    """Pids of producers a test kills with -9. A legacy-kind host pool's
    segments are named shm objects; a consumer that sees its producer gone
    unlinks them (mappings stay valid): none may be left after the test."""
    pids = []
    yield pids
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"ss_pool_{pid}_") for pid in pids)]
    for name in left:
        os.unlink(os.path.join("/dev/shm", name))
    assert left == [], "a killed producer's shm names were left behind"


def wait_until(predicate, what):
    """Polls `predicate` (a hang guard, not a timing assertion)."""
    import time

    deadline = time.monotonic() + pw.GUARD
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


# ---- producer side, in one process ----


def test_views_of_one_storage_stay_views_and_only_reached_bytes_are_copied():
    big = torch.arange(10_000, dtype=torch.float32)
    sd = {
        "whole": big[:100].view(10, 10),
        "transposed": big[:100].view(10, 10).t(),  # non-contiguous view of the same storage
        "tail": big[9_990:],  # far end of the same storage
        "expanded": torch.tensor([3.0]).expand(5, 4),  # stride 0
        "empty": torch.empty(0, 3),
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "flags": torch.tensor([True, False, True]),
        "bf16": torch.linspace(0, 1, 7, dtype=torch.bfloat16),
    }
    pool = cuda.Pool.from_state_dict(sd, device="cpu", segment_size=1 << 20)
    got = pool.state_dict()
    assert list(got) == list(sd)
    for name, t in sd.items():
        assert torch.equal(got[name], t.resolve_conj()), name
        assert got[name].shape == t.shape and got[name].dtype == t.dtype
    assert got["transposed"].stride() == (1, 10) and got["expanded"].stride() == (0, 0)
    s = got["whole"].untyped_storage()
    assert got["transposed"].untyped_storage().data_ptr() == s.data_ptr() == got["tail"].untyped_storage().data_ptr()
    # The span [0, 10000 floats) is reached by whole and tail: one copy of it.
    assert s.nbytes() == 10_000 * 4
    assert segments_hold(pool.segments(), got.values())


def test_opened_weights_keep_the_storages_of_the_producer():
    big = torch.arange(1000, dtype=torch.float32)
    sd = {"a": big[:10], "b": big[500:].view(20, 25).t(), "c": torch.ones(3, dtype=torch.int64), "e": torch.empty(0)}
    pool = cuda.Pool.from_state_dict(sd, device="cpu")
    w = cuda.open_weights(pool.export(), timeout=pw.GUARD)
    for name, t in sd.items():
        assert torch.equal(w[name], t) and w[name].stride() == t.stride(), name
    assert w["a"].untyped_storage().data_ptr() == w["b"].untyped_storage().data_ptr(), "views of one storage"
    assert w["a"].untyped_storage().nbytes() == 1000 * 4, "a storage of its own, not the whole segment"
    assert w["c"].untyped_storage().data_ptr() != w["a"].untyped_storage().data_ptr()
    only_empty = cuda.Pool.from_state_dict({"e": torch.empty(0, 4)}, device="cpu")
    assert cuda.open_weights(only_empty.export(), timeout=pw.GUARD)["e"].shape == (0, 4)


def test_a_small_slice_brings_only_its_bytes():
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    pool = cuda.Pool.from_state_dict({"slice": big[5000:5010]}, device="cpu", segment_size=1 << 16)
    t = pool.state_dict()["slice"]
    assert torch.equal(t, big[5000:5010])
    assert t.untyped_storage().nbytes() < 4096 and sum(n for _, n in pool.segments()) < 1 << 20


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: {1: torch.ones(2)}, "keys must be str"),
        (lambda: {"x": [1, 2]}, "not a tensor"),
        (lambda: {"x": torch.ones(2).to_sparse()}, "strided"),
        (lambda: {"x": torch.ones(2, device="meta")}, "meta"),
        # empty: PyTorch before 2.5 cannot fill these dtypes on the CPU.
        (lambda: {"x": torch.empty(2, dtype=torch.float8_e4m3fnuz)}, "dtype"),
        (lambda: {"ok": torch.ones(2), "x": torch.empty(2, dtype=torch.float8_e5m2fnuz)}, "dtype"),
        (lambda: {"": torch.ones(2)}, "name must be 1 to"),
    ],
)
def test_what_a_pool_cannot_carry_is_named(bad, message):
    pool = cuda.Pool("cpu")
    with pytest.raises(ss.InvalidArgumentError, match=message):
        pool.add_state_dict(bad())
    assert pool.state_dict() == {}
    pool.add_state_dict({"fine": torch.ones(2)})  # the pool is still usable


def test_bad_pool_arguments_are_named():
    with pytest.raises(ss.InvalidArgumentError, match="pool device"):
        cuda.Pool("tpu")
    with pytest.raises(ss.InvalidArgumentError, match="kind"):
        cuda.Pool("cpu", kind="ipc")
    with pytest.raises(ss.InvalidArgumentError, match="device="):
        cuda.Pool.from_state_dict({})
    pool = cuda.Pool("cpu")
    pool.add_state_dict({"a": torch.ones(3)})
    with pytest.raises(ss.InvalidArgumentError, match="'a' already"):
        pool.add_state_dict({"a": torch.ones(3)})
    with pytest.raises(TypeError, match="export"):
        pickle.dumps(pool)


def test_manifest_is_frozen_after_export():
    pool = cuda.Pool.from_state_dict({"a": torch.ones(3)}, device="cpu")
    pool.export()
    with pytest.raises(ss.InvalidArgumentError, match="frozen"):
        pool.add_state_dict({"b": torch.ones(3)})


def test_allocating_is_for_cuda_pools():
    with pytest.raises(ss.InvalidArgumentError, match="host backend"):
        with cuda.Pool("cpu").allocating():
            pass


def test_allocating_needs_torchs_mem_pool(monkeypatch):
    monkeypatch.delattr(torch.cuda, "use_mem_pool", raising=False)  # PyTorch before 2.5 has none
    with pytest.raises(RuntimeError, match="use_mem_pool"):
        cuda._require_mem_pool()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_a_cuda_pool_without_cuda_is_a_clear_error():
    with pytest.raises(ss.Error, match="CUDA is not available") as caught:
        cuda.Pool("cuda:0")
    assert caught.value.kind == "CudaUnavailable"


def test_stock_descriptor_is_for_legacy_cuda_pools():
    pool = cuda.Pool.from_state_dict({"a": torch.ones(3)}, device="cpu", kind="legacy")
    with pytest.raises(ss.InvalidArgumentError, match="legacy-kind CUDA"):
        pool.stock_descriptor()
    with pytest.raises(ss.Error, match="CUDA device only") as caught:
        pool._native.stock_segments()  # the library refuses as well
    assert caught.value.kind == "Unsupported"


def test_handle_is_small_and_picklable():
    pool = cuda.Pool.from_state_dict({f"w{i}": torch.ones(10) for i in range(300)}, device="cpu")
    h = pool.export()
    assert pool.export() == h
    data = pickle.dumps(h)
    assert len(data) < 256, "one handle, whatever the number of tensors"
    back = pickle.loads(data)
    assert back == h and back.producer_pid == os.getpid() and back.device == torch.device("cpu") and back.kind == "vmm"
    assert cuda.WeightsHandle.from_bytes(bytes(h)) == h


# ---- PyTorch's pluggable-allocator functions, called as PyTorch calls them ----


def test_torch_allocator_functions_place_blocks_in_the_current_pool():
    lib = ctypes.CDLL(ss._native.__file__)
    malloc, free = lib.ss_pool_torch_malloc, lib.ss_pool_torch_free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    pool = cuda.Pool("cpu", segment_size=1 << 20)
    ss._native.clear_current_pool()
    ss._native.take_alloc_error()
    assert malloc(4096, 0, None) is None, "no pool is current: NULL, PyTorch's out-of-memory"
    assert "pool" in ss._native.take_alloc_error()
    pool._native.make_current()
    try:
        p = malloc(3 << 20, 0, None)
        assert p and p % 512 == 0
        assert any(b <= p and p + (3 << 20) <= b + n for b, n in pool.segments())
        ctypes.memset(p, 0xAB, 3 << 20)
        assert malloc(-1, 0, None) is None and "negative" in ss._native.take_alloc_error()
        free(p, 3 << 20, 0, None)
        q = malloc(3 << 20, 0, None)
        assert q == p, "the freed block is placed again"
        free(q, 3 << 20, 0, None)
    finally:
        ss._native.clear_current_pool()


BORN_OUTLIVES_POOL = """
import ctypes, gc, torch
import storage_sharing as ss
from storage_sharing import cuda
lib = ctypes.CDLL(ss._native.__file__)
lib.ss_pool_torch_malloc.restype = ctypes.c_void_p
lib.ss_pool_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.ss_pool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
pool = cuda.Pool("cpu", segment_size=1 << 20)
pool._native.make_current()
p = lib.ss_pool_torch_malloc(1 << 16, 0, None)
ss._native.clear_current_pool()
del pool
gc.collect()
ctypes.memset(p, 7, 1 << 16)  # PyTorch still owns the block: it must be mapped
assert ctypes.string_at(p + 100, 1) == bytes([7])
lib.ss_pool_torch_free(p, 1 << 16, 0, None)
print("ok")
"""


def test_a_block_pytorch_holds_keeps_its_pool_alive():
    # Tensors born in a pool are PyTorch's caching-allocator blocks: the
    # user may drop the Pool object and keep the model, so the pool must
    # live until PyTorch frees its last block.
    done = subprocess.run([sys.executable, "-c", BORN_OUTLIVES_POOL], capture_output=True, text=True, timeout=pw.GUARD)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr)
    assert "in no live pool" not in done.stderr


# ---- producer and consumers in separate processes ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_model_in_another_process_gives_the_same_forward(device, kind, start):
    if start == "fork" and device != "cpu":
        pytest.skip("CUDA does not survive fork: spawn only on a GPU")
    torch.manual_seed(0)
    model = pw.TinyLM().to(device)
    expected = pw.forward_single_thread(model, pw.tokens_for_test().to(device))
    pool = cuda.Pool.from_state_dict(model.state_dict(), kind=kind)
    assert pool.device == torch.device(device)
    handle = pool.export()
    ctx = mp.get_context(start)
    out = ctx.Queue()
    p = ctx.Process(target=pw.consume_model, args=(handle, out), daemon=True)
    p.start()
    version, got, tied, in_pool, scale_stride, count = out.get(timeout=pw.GUARD)
    p.join(pw.GUARD)
    assert p.exitcode == 0
    assert version == 1 and count == len(model.state_dict())
    assert torch.equal(torch.tensor(got), expected), "the consumer's forward pass equals the producer's"
    assert tied and in_pool and scale_stride == (0,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_updates_under_concurrent_readers_are_never_torn(device, kind):
    # Several storages over several segments, each big enough that a write
    # takes a while: a reader let in mid-update would see two values.
    sd = {f"layer{i}": torch.full((1 << 18,), 1.0) for i in range(4)}
    pool = cuda.Pool.from_state_dict(sd, device=device, kind=kind, segment_size=1 << 20)
    handle = pool.export()
    assert pool.version == 1
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    readers = []
    for _ in range(3):
        ready = ctx.Event()
        p = ctx.Process(target=pw.read_versions, args=(handle, ready, stop, out), daemon=True)
        p.start()
        readers.append((p, ready))
    for _, ready in readers:
        assert ready.wait(pw.GUARD)
    for _ in range(25):
        with pool.update(timeout=pw.GUARD) as tensors:
            following = pool.version + 1
            for t in tensors.values():
                t.fill_(following)
        assert pool.version == following
    stop.set()
    results = [out.get(timeout=pw.GUARD) for _ in readers]
    for p, _ in readers:
        p.join(pw.GUARD)
        assert p.exitcode == 0
    for pid, reads, seen, torn in results:
        assert torn == [], f"reader {pid} saw a mix of versions: {torn[:3]}"
        assert seen == sorted(seen) and seen[-1] == 26, f"reader {pid} saw versions {seen}"
        assert reads >= 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_consumer_gives_its_hold_back(kind):
    pool = cuda.Pool.from_state_dict({"w": torch.zeros(1000)}, device="cpu", kind=kind)
    handle = pool.export()
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    p = ctx.Process(target=pw.hold_forever, args=(handle, held), daemon=True)
    p.start()
    assert held.wait(pw.GUARD)
    assert pool.consumers == 1
    with pytest.raises(ss.WaitTimeoutError):
        with pool.update(timeout=0.2):
            pass  # the consumer holds version 1: the update may not start
    os.kill(p.pid, signal.SIGKILL)
    p.join(pw.GUARD)
    assert p.exitcode == -signal.SIGKILL
    with pool.update(timeout=pw.GUARD) as tensors:
        tensors["w"].fill_(2)
    assert pool.version == 2
    wait_until(lambda: pool.consumers == 0, "the server to drop the dead consumer")


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_producer_is_peer_gone_not_garbage(kind, killed_producers):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=pw.produce_and_wait, args=("cpu", kind, out, done), daemon=True)
    p.start()
    killed_producers.append(p.pid)
    handle = out.get(timeout=pw.GUARD)
    w = cuda.open_weights(handle, timeout=pw.GUARD)
    with w.reading(timeout=pw.GUARD) as version:
        assert version == 1 and all(t.eq(7).all() for t in w.values())
    os.kill(p.pid, signal.SIGKILL)
    p.join(pw.GUARD)
    with pytest.raises(ss.PeerGoneError, match=str(p.pid)):
        w.acquire(timeout=pw.GUARD)
    assert w.held is None
    with pytest.raises(ss.PeerGoneError):
        w.check_producer()
    assert all(t.eq(7).all() for t in w.values()), "the mapping outlives the producer"
    w.close()
    with pytest.raises(ss.ClosedError):
        w["t0"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_producer_killed_mid_update_is_peer_gone_not_a_mix(kind, killed_producers):
    ctx = mp.get_context("spawn")
    out, writing = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=pw.produce_and_hang_in_update, args=(kind, out, writing), daemon=True)
    p.start()
    killed_producers.append(p.pid)
    w = cuda.open_weights(out.get(timeout=pw.GUARD), timeout=pw.GUARD)
    out.put("opened")
    assert writing.wait(pw.GUARD)
    os.kill(p.pid, signal.SIGKILL)
    p.join(pw.GUARD)
    with pytest.raises(ss.PeerGoneError, match=str(p.pid)):
        w.acquire(timeout=pw.GUARD)  # not a wait for a publish that never comes


def test_threads_of_a_consumer_share_one_hold():
    import threading

    pool = cuda.Pool.from_state_dict({"w": torch.zeros(10)}, device="cpu")
    w = cuda.open_weights(pool.export(), timeout=pw.GUARD)
    versions = []
    t = threading.Thread(target=lambda: versions.append(w.acquire(timeout=pw.GUARD)))
    t.start()
    t.join(pw.GUARD)
    versions.append(w.acquire(timeout=pw.GUARD))
    assert versions == [1, 1] and w.held == 1
    w.release()
    with pytest.raises(ss.WaitTimeoutError, match=str(os.getpid())):
        with pool.update(timeout=0.2):
            pass  # the other thread's acquire still holds version 1
    w.release()
    assert w.held is None
    with pytest.raises(ss.InvalidArgumentError, match="acquire"):
        w.release()
    with pool.update(timeout=pw.GUARD) as tensors:
        tensors["w"].fill_(2)
    with w.reading(timeout=pw.GUARD) as version:
        assert version == 2 and w["w"].eq(2).all()


def test_max_consumers_is_a_clear_refusal_and_a_closed_consumer_frees_its_place():
    pool = cuda.Pool.from_state_dict({"w": torch.ones(10)}, device="cpu", max_consumers=1)
    handle = pool.export()
    first = cuda.open_weights(handle, timeout=pw.GUARD)
    with pytest.raises(ss.BusyError, match="max_consumers"):
        cuda.open_weights(handle, timeout=pw.GUARD)
    first.close()
    del first
    gc.collect()  # the last tensor over the mapping went: the connection closes
    wait_until(lambda: pool.consumers == 0, "the server to see the consumer leave")
    second = cuda.open_weights(handle, timeout=pw.GUARD)
    assert second["w"].eq(1).all()


def test_weights_inherited_through_fork_refuse_calls_and_still_read():
    pool = cuda.Pool.from_state_dict({"w": torch.full((10,), 3.0)}, device="cpu")
    w = cuda.open_weights(pool.export(), timeout=pw.GUARD)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=pw.use_inherited_weights, args=(w, out), daemon=True)
    p.start()
    message, total = out.get(timeout=pw.GUARD)
    p.join(pw.GUARD)
    assert "fork" in message and total == 30.0
    with w.reading(timeout=pw.GUARD) as version:
        assert version == 1, "the child's copy left the parent's connection and slot alone"


def test_a_killed_producer_with_a_forked_child_is_peer_gone():
    ctx = mp.get_context("spawn")
    out, opened, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=pw.produce_then_fork, args=(out, opened, done), daemon=True)
    p.start()
    w = cuda.open_weights(out.get(timeout=pw.GUARD), timeout=pw.GUARD)
    opened.set()
    forked = out.get(timeout=pw.GUARD)
    try:
        os.kill(p.pid, signal.SIGKILL)
        # Not p.join(): the forked child holds p's sentinel pipe too.
        wait_until(lambda: p.exitcode is not None, "the producer to die")

        # The forked child lets go of p's sockets in its fork handler, which
        # runs when the child is first scheduled: maybe after the kill.
        def producer_seen_gone():
            try:
                w.acquire(timeout=5.0)
            except ss.PeerGoneError as e:
                assert str(p.pid) in str(e)
                return True
            w.release()
            return False

        wait_until(producer_seen_gone, "the consumer to see the producer gone")
    finally:
        os.kill(forked, signal.SIGKILL)


def test_an_update_that_raises_leaves_the_pool_torn_until_the_next_publish():
    pool = cuda.Pool.from_state_dict({"w": torch.zeros(10)}, device="cpu")
    handle = pool.export()
    with pytest.raises(RuntimeError, match="half written"):
        with pool.update(timeout=pw.GUARD) as tensors:
            tensors["w"][:5].fill_(1)
            raise RuntimeError("half written")
    assert pool.version == 1
    w = cuda.open_weights(handle, timeout=pw.GUARD)
    with pytest.raises(ss.BusyError, match="torn"):
        w.acquire(timeout=1.0)
    with pool.update(timeout=pw.GUARD) as tensors:
        tensors["w"].fill_(1)
    with w.reading(timeout=pw.GUARD) as version:
        assert version == 2 and w["w"].eq(1).all()


# ---- handles that must not open ----


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, os.urandom(64), b"storage_sharing" * 8])
def test_forged_handle_bytes_are_refused(data):
    with pytest.raises(ss.InvalidArgumentError):
        cuda.WeightsHandle.from_bytes(data)
    with pytest.raises(ss.InvalidArgumentError):
        cuda.open_weights(data)
    with pytest.raises(ss.InvalidArgumentError, match="WeightsHandle"):
        cuda.open_weights("not a handle")


def test_a_gone_producers_handle_is_refused():
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=pw.produce_and_wait, args=("cpu", "vmm", out, done), daemon=True)
    p.start()
    handle = out.get(timeout=pw.GUARD)
    done.set()
    p.join(pw.GUARD)
    assert p.exitcode == 0
    with pytest.raises(ss.PeerGoneError, match=f"pid {p.pid}"):
        cuda.open_weights(handle, timeout=2.0)


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user (uid 65534) needs root")
def test_a_strangers_pool_is_refused():
    ctx = mp.get_context("fork")
    out, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=pw.produce_as_nobody, args=(out, done), daemon=True)
    p.start()
    try:
        handle = out.get(timeout=pw.GUARD)
        with pytest.raises(ss.PermissionDeniedError):
            cuda.open_weights(handle, timeout=pw.GUARD)
    finally:
        done.set()
        p.join(pw.GUARD)
    gc.collect()


# ---- born in the pool (CUDA only) ----


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_born_in_the_pool_with_no_copy():
    pool = cuda.Pool("cuda:0")
    torch.manual_seed(0)
    with pool.allocating():
        model = pw.TinyLM().cuda()
    params = list(model.state_dict().values())
    assert segments_hold(pool.segments(), params), "model.cuda() placed the parameters in the pool"
    before = [t.data_ptr() for t in params]
    pool.add_state_dict(model.state_dict())
    assert [t.data_ptr() for t in pool.state_dict().values()] == before, "no copy"
    expected = pw.forward_single_thread(model, pw.tokens_for_test().cuda())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=pw.consume_model, args=(pool.export(), out), daemon=True)
    p.start()
    _, got, tied, in_pool, _, _ = out.get(timeout=pw.GUARD)
    p.join(pw.GUARD)
    assert torch.equal(torch.tensor(got), expected) and tied and in_pool


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_stock_pytorch_opens_a_legacy_pool():
    torch.manual_seed(0)
    model = pw.TinyLM().cuda()
    expected = pw.forward_single_thread(model, pw.tokens_for_test().cuda())
    pool = cuda.Pool.from_state_dict(model.state_dict(), kind="legacy")
    pool.export()
    descriptor = pool.stock_descriptor()
    assert descriptor["format"] == cuda.STOCK_FORMAT
    data = pickle.dumps(descriptor)
    assert b"storage_sharing." not in data.replace(cuda.STOCK_FORMAT.encode(), b""), "builtins only"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=pw.consume_with_stock_pytorch, args=(descriptor, out), daemon=True)
    p.start()
    got = out.get(timeout=pw.GUARD)
    p.join(pw.GUARD)
    assert p.exitcode == 0 and torch.equal(torch.tensor(got), expected)


# ---- the example ----

# The repository: SS_SOURCE_TREE when the suite runs from a copy (the installed-wheel run).
ROOT = os.environ.get("SS_SOURCE_TREE") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "python", "cuda_weights.py")


@pytest.mark.parametrize("args", [[], ["--kind", "legacy"], pytest.param(["--device", "cuda:0", "--born-in-pool"], marks=CUDA0.marks)])
def test_the_example_runs(args):
    done = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=pw.GUARD * 2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "version 2: output equal to the producer's: True" in done.stdout and done.stdout.rstrip().endswith("ok")
