"""storage_sharing.cuda across machines: a pool replicated through
torch.distributed (gloo over loopback), each rank a node with its own
pool on the host backend and local consumer processes. Real processes,
real collectives, real kill -9."""

import os

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)

import _replica_workers as rw  # noqa: E402

# On PyTorch 2.4 these rounds deadlock in destroy_process_group (gdb on
# 2.4.1): the main thread holds the GIL inside the gloo group's destructor,
# joining a worker thread, while that worker thread drops the last
# reference to a collective's work whose tensor still has a Python object
# and waits for the GIL to free it; where a round timed out or lost a peer,
# the worker is first stuck in the abandoned collective until the group
# timeout. They run on newer releases; the 20-broadcast test runs on 2.4.
REBUILDS_GROUPS = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5),
    reason=(
        "PyTorch 2.4 deadlock: destroy_process_group holds the GIL while joining a gloo worker thread "
        "that needs the GIL to free a work's tensor (after a timed-out round it first waits out the "
        "group timeout in the abandoned collective); runs on newer releases"
    ),
)

import storage_sharing as ss  # noqa: E402
from storage_sharing import _pool_replica as pr  # noqa: E402
from storage_sharing import cuda  # noqa: E402


def gather(out, count):
    """``count`` reports from the ranks' queue, by rank (a hang guard on each)."""
    got = {}
    for _ in range(count):
        key, report = out.get(timeout=rw.GUARD)
        got[key] = report
    return got


@pytest.fixture
def started():
    """Starts rank processes; any still running when the test ends (it
    failed) is killed."""
    procs = []

    def start(ctx, target, *args, daemon=True):
        p = ctx.Process(target=rw.in_forked_rank, args=(target, *args), daemon=daemon)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(rw.GUARD)
    ended = [p.pid for p in procs if p.exitcode == 0]
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"ss_pool_{pid}_") for pid in ended)]
    assert left == [], "a rank that exited left its legacy pool's shm names behind"


def test_three_nodes_two_readers_each_see_twenty_broadcasts_whole(tmp_path, started):
    """Rank 0 updates its pool 20 times and broadcasts each version to two
    replicas (one vmm, one legacy); on each of the three nodes two
    consumers read under reading() throughout. No read is torn, every
    consumer ends on the last version byte-equal to the source's, and
    the replicas publish the source's version numbers."""
    ctx = mp.get_context("fork")  # the ranks start at once, without importing torch again
    out = ctx.Queue()
    rounds = 20
    kinds = ["vmm", "vmm", "legacy"]
    # Not daemons: each forks its consumers.
    procs = [started(ctx, rw.node, rank, 3, str(tmp_path / "group"), kinds[rank], rounds, out, daemon=False) for rank in range(3)]
    reports = {}
    for _ in procs:
        rank, version, published, segments, readers = out.get(timeout=rw.GUARD)
        reports[rank] = (version, published, segments, readers)
    for p in procs:
        p.join(rw.GUARD)
        assert p.exitcode == 0
    for rank, (version, published, segments, readers) in reports.items():
        assert isinstance(readers, list), f"rank {rank} failed:\n{readers}"
        assert version == published == rounds + 1, f"rank {rank}"
        for pid, reads, seen, torn, equal in readers:
            assert torn == [], f"rank {rank} reader {pid} saw torn reads: {torn[:3]}"
            assert seen[-1] == rounds + 1 and equal, f"rank {rank} reader {pid} ended on {seen}"
            assert seen == sorted(seen) and reads >= len(seen)
    assert reports[0][2] > 1 and reports[1][2] == reports[2][2], "the replicas keep the source's segments in use"


@REBUILDS_GROUPS
def test_a_late_joiner_gets_the_current_version_and_another_model_is_refused(tmp_path, started):
    """Rank 1 receives two versions on a group of two; rank 2 starts later
    and joins a new group, where Pool.replica gives it version 3 while rank
    1's replica receives it. A pool of another model (layers in float16)
    is then refused by both, naming the first difference, with nothing
    written; the same group then carries version 4."""
    ctx = mp.get_context("fork")  # the ranks start at once, without importing torch again
    out, phase = ctx.Queue(), ctx.Queue()
    init1, init2 = str(tmp_path / "first"), str(tmp_path / "second")
    procs = [started(ctx, rw.joiner_source, init1, init2, out, phase), started(ctx, rw.joiner_replica, 1, init1, init2, out)]
    assert phase.get(timeout=rw.GUARD) == "first group done"
    procs.append(started(ctx, rw.joiner_replica, 2, None, init2, out))
    got = gather(out, 3)
    for p in procs:
        p.join(rw.GUARD)
    for rank, report in got.items():
        assert "failed" not in report, f"rank {rank}:\n{report['failed']}"
    source = got[0]
    assert (source["second"], source["third"], source["fourth"]) == (2, 3, 4)
    kind, message = source["other"]
    assert kind == "InvalidArgumentError" and "rank 1" in message and "rank 2" in message, message
    for rank in (1, 2):
        r = got[rank]
        assert r["third"] == 3 and r["third read"] == (3, True), (rank, r)
        kind, message = r["other"]
        assert kind == "InvalidArgumentError", (rank, r["other"])
        assert "tensor 3 ('layers.0.w'): dtype 'bfloat16' in the replica, 'float16' at the source" in message, message
        assert r["after refusal"] == (3, True, 3), "nothing was written, the version stays readable"
        assert r["fourth"] == 4 and r["fourth read"] == (4, True), (rank, r)


@REBUILDS_GROUPS
@pytest.mark.parametrize("victim", ["replica", "source"])
def test_a_rank_killed_mid_transfer_leaves_survivors_typed_errors_and_torn_until_repaired(tmp_path, victim, started):
    """Version 2 goes out in 4 KiB chunks; as soon as its first bytes land
    in a replica, a replica rank kills itself with -9, or a replica kills
    the source with -9. Every survivor's broadcast raises a typed error
    (within its timeout: the test's guard is far above it), each
    surviving replica is torn (its reader gets BusyError), and a complete
    broadcast of version 3 on a rebuilt group (with a new source where
    the source died) repairs them byte-equal."""
    ctx = mp.get_context("fork")  # the ranks start at once, without importing torch again
    out, pids = ctx.Queue(), ctx.Queue()
    init1, init2 = str(tmp_path / "first"), str(tmp_path / "second")
    procs = [started(ctx, rw.kill_rank, rank, init1, init2, victim, pids, out) for rank in range(3)]
    dead = procs[2] if victim == "replica" else procs[0]
    dead.join(rw.GUARD)
    assert dead.exitcode == -9, "the victim was killed"
    # A legacy host pool's shm names outlive a producer killed with -9
    # where no manager runs (its consumers, here in the same process, died
    # with it): what `ssctl gc` would collect.
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ss_pool_{dead.pid}_"):
            os.unlink(os.path.join("/dev/shm", name))
    survivors = [1, 2] if victim == "source" else [0, 1]
    if victim == "source":
        procs.append(started(ctx, rw.new_source, init2, out))
        survivors.append("new source")
    got = gather(out, len(survivors))
    for p in procs:
        p.join(rw.GUARD)
    for who, report in got.items():
        assert "failed" not in report, f"{who}:\n{report['failed']}"
        assert report["repair"] == 3, (who, report)
        if who == "new source":
            continue
        kind, message = report["broken"]
        assert kind in ("PeerGoneError", "WaitTimeoutError"), (who, report["broken"])
        if who != 0:
            assert "torn" in message, message
            assert report["read torn"][0] == "BusyError", (who, report["read torn"])
            assert report["repaired read"] == (3, True, []), (who, report["repaired read"])


@REBUILDS_GROUPS
def test_a_reader_held_past_the_timeout_refuses_a_round_and_a_stalled_rank_times_it_out(tmp_path, started):
    """A replica whose local reader holds its version past the timeout
    votes no: both ranks raise WaitTimeoutError, nothing is written (the
    reader still reads version 1 whole, the replica is not torn), and the
    same group carries the next round. A source torn by an update that
    raised sends nothing (BusyError on both ranks; the replica keeps its
    version). A rank that never calls leaves the source a
    WaitTimeoutError when its timeout runs out."""
    ctx = mp.get_context("fork")  # the ranks start at once, without importing torch again
    out, events = ctx.Queue(), ctx.Queue()
    for rank in range(2):
        started(ctx, rw.held_and_stalled, rank, str(tmp_path / "group"), out, events)
    got = gather(out, 2)
    for rank, report in got.items():
        assert "failed" not in report, f"rank {rank}:\n{report['failed']}"
    source, replica = got[0], got[1]
    kind, message = source[2]
    assert kind == "WaitTimeoutError" and "rank 1: its local readers held their version past the timeout" in message, message
    kind, message = replica[2]
    assert kind == "WaitTimeoutError" and "nothing was written" in message, message
    assert replica["kept"] == (1, True, 1, False)
    assert source[3] == replica[3] == 3 and replica["read"] == (3, True)
    assert source["torn"][0] == replica["torn"][0] == "BusyError", (source["torn"], replica["torn"])
    assert "the source pool is torn" in source["torn"][1] and "the source pool is torn" in replica["torn"][1]
    assert replica["after torn source"] == (3, True)
    kind, message = source[4]
    assert kind == "WaitTimeoutError" and "within the timeout of 1.0 s" in message, message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU run (scripts/gpu) covers this case")
def test_cuda_pools_replicate_over_gloo_on_one_gpu(tmp_path, started):
    """The same code with CUDA pools: two ranks on one GPU (NCCL needs a
    GPU per rank), gloo moving the CUDA chunks; the replica ends on each
    version byte-equal, its tensors on the device."""
    ctx = mp.get_context("spawn")  # CUDA does not survive fork
    out = ctx.Queue()
    for rank in range(2):
        started(ctx, rw.cuda_pair, rank, str(tmp_path / "group"), out)
    got = gather(out, 2)
    for rank, report in got.items():
        assert "failed" not in report, f"rank {rank}:\n{report['failed']}"
        assert report["versions"] == [1, 2, 3], (rank, report)
    assert got[1]["equal"] == [True] * 3 and got[1]["on device"]


# ---- in one process: the manifest, its checks and the layout ----


def test_a_manifest_is_read_back_as_sent_and_a_replica_has_the_same_layout():
    sd = rw.model(5)
    sd["empty"] = torch.empty(0, 3)
    source = cuda.Pool.from_state_dict(sd, device="cpu", segment_size=8192)
    manifest, spans = pr.manifest_of(source)
    assert len(manifest["segments"]) == len(spans) > 1
    assert [n for _, n in spans] == manifest["segments"]
    sent = pr.json.dumps(manifest).encode()
    copy = pr.build_replica(cuda.Pool, pr.parse_manifest(sent), torch.device("cpu"), "legacy", None)
    assert pr.first_difference(pr.manifest_of(copy)[0], manifest) is None
    views = copy.state_dict()
    assert views["head.weight"].data_ptr() == views["emb.weight"].data_ptr() and views["emb.T"].stride() == (1, 16)
    for (base, n), (mine, _) in zip(spans, pr.manifest_of(copy)[1]):
        torch.frombuffer((torch.ctypes.c_ubyte * n).from_address(mine), dtype=torch.uint8).copy_(
            torch.frombuffer((torch.ctypes.c_ubyte * n).from_address(base), dtype=torch.uint8)
        )
    assert all(torch.equal(views[k], sd[k]) for k in sd)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda m: m["tensors"].__setitem__(0, ["x"] + m["tensors"][0][1:]), "tensor 0 ('emb.weight'): name 'emb.weight' in the replica, 'x'"),
        (lambda m: m["tensors"][4][3].__setitem__(0, 31), "tensor 4 ('layers.1.w'): sizes [32, 32] in the replica, [31, 32]"),
        (lambda m: m["tensors"].pop(), "the replica has 10 tensors, the source 9"),
    ],
)
def test_the_first_difference_is_named(change, needle):
    pool = cuda.Pool.from_state_dict(rw.model(1), device="cpu", segment_size=8192)
    mine, _ = pr.manifest_of(pool)
    theirs = pr.json.loads(pr.json.dumps(mine))
    change(theirs)
    assert needle in pr.first_difference(mine, theirs)


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"\xff", "not JSON"),
        (b'{"format": "other"}', "format 'other'"),
        (b'{"format": "%s", "segments": [0], "storages": [], "tensors": []}' % pr.FORMAT.encode(), "positive byte counts"),
        (
            b'{"format": "%s", "segments": [4096], "storages": [[0, 4000, 200]], "tensors": []}' % pr.FORMAT.encode(),
            "lies outside the segments",
        ),
        (
            b'{"format": "%s", "segments": [4096], "storages": [[0, 0, 64]], "tensors": [["a", 1, "float32", [1], [1], 0]]}'
            % pr.FORMAT.encode(),
            "names storage 1 of 1",
        ),
        (
            b'{"format": "%s", "segments": [4096], "storages": [[0, 0, 64]], "tensors": [["a", 0, "object", [1], [1], 0]]}'
            % pr.FORMAT.encode(),
            "dtype 'object'",
        ),
    ],
)
def test_a_malformed_manifest_is_refused_saying_why(data, needle):
    with pytest.raises(ss.InvalidArgumentError, match="malformed") as e:
        pr.parse_manifest(data)
    assert needle in str(e.value)


def test_a_view_outside_its_storage_is_refused_when_the_replica_is_built():
    m = {"format": pr.FORMAT, "segments": [4096], "storages": [[0, 0, 64]], "tensors": [["a", 0, "float32", [100], [1], 0]]}
    with pytest.raises(ss.InvalidArgumentError, match='tensor "a": the view reaches 400 bytes'):
        pr.build_replica(cuda.Pool, pr.parse_manifest(pr.json.dumps(m).encode()), torch.device("cpu"), "vmm", None)


def test_an_update_waits_for_a_broadcast_of_the_same_pool():
    """The turn a broadcast reads under: an update in another thread times
    out while it is taken, naming it; the same thread may not nest them."""
    import threading

    pool = cuda.Pool.from_state_dict({"w": torch.ones(4)}, device="cpu")
    pool.export()
    turn = pr.turn_of(pool)
    with turn.taken(None, "pool.broadcast()"):
        errors = []

        def update():
            try:
                with pool.update(timeout=0.05):
                    pass
            except ss.WaitTimeoutError as e:
                errors.append(str(e))

        t = threading.Thread(target=update)
        t.start()
        t.join(rw.GUARD)
        assert errors and "busy with pool.broadcast()" in errors[0]
        with pytest.raises(ss.InvalidArgumentError, match="wait for itself"):
            with pool.update(timeout=1):
                pass
    with pool.update(timeout=1) as tensors:
        tensors["w"].fill_(2)
    assert pool.version == 2
    for bad in (-1, float("nan")):
        with pytest.raises(ss.InvalidArgumentError, match="non-negative number of seconds"):
            with pool.update(timeout=bad):
                pass


def test_broadcast_needs_an_initialized_group_and_a_member_src(tmp_path):
    pool = cuda.Pool.from_state_dict({"w": torch.ones(4)}, device="cpu")
    assert not dist.is_initialized()
    with pytest.raises(ss.InvalidArgumentError, match="not initialized"):
        pool.broadcast(src=0)
    with pytest.raises(ss.InvalidArgumentError, match="chunk_bytes"):
        pool.broadcast(src=0, chunk_bytes=0)
    with pytest.raises(ss.InvalidArgumentError, match="timeout"):
        pool.broadcast(src=0, timeout=-1)
    rw.join(str(tmp_path / "alone"), 0, 1)
    try:
        with pytest.raises(ss.InvalidArgumentError, match=r"src 5 is not a \(global\) rank of the group, whose ranks are \[0\]"):
            pool.broadcast(src=5)
        with pytest.raises(ss.InvalidArgumentError, match="the source calls pool.broadcast"):
            cuda.Pool.replica(src=0, device="cpu")
        assert pool.broadcast(src=0, timeout=rw.TIMEOUT) == 1, "a group of one: the version, nothing to send"
    finally:
        rw.leave()
