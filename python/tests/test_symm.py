"""storage_sharing.symm with real processes: spawned ranks in a gloo
group, meeting through a TCPStore (the library's client) or a FileStore
(the Python store object, called back)."""

import queue
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import _symm_workers as workers  # noqa: E402

pytestmark = pytest.mark.torch

# Hang guard only: a healthy run takes seconds.
GUARD = 120


def launch(body, world_size, how, tmp_path, *args):
    """Runs ``body`` on ``world_size`` spawned ranks; returns their
    results by rank (or the processes and queue with ``keep``)."""
    ctx = torch.multiprocessing.get_context("spawn")
    server = None
    if how == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        where = server.port
    else:
        where = str(tmp_path / "filestore")
    results = ctx.Queue()
    procs = [ctx.Process(target=workers.run, args=(body, r, world_size, how, where, results) + args) for r in range(world_size)]
    for p in procs:
        p.start()
    return server, procs, results


def collect(procs, results, expected):
    got = {}
    try:
        for _ in range(expected):
            rank, status, value = results.get(timeout=GUARD)
            got[rank] = (status, value)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return got


def ok(got, world_size):
    for r in range(world_size):
        assert r in got, f"rank {r} reported nothing"
        status, value = got[r]
        assert status == "ok", value
    return {r: got[r][1] for r in range(world_size)}


@pytest.mark.parametrize("how", ["tcp", "file"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_peers_see_each_others_memory_and_signals(tmp_path, how, world_size):
    server, procs, results = launch(workers.peers_and_signals, world_size, how, tmp_path)
    out = ok(collect(procs, results, world_size), world_size)
    for r in range(world_size):
        assert out[r]["rank"] == r and out[r]["ws"] == world_size
        assert out[r]["seen"] == [float(p) for p in range(world_size)]
        assert out[r]["from_left"] == 100 + (r - 1) % world_size
    del server


@pytest.mark.parametrize("how,world_size", [("tcp", 2), ("file", 3), ("tcp", 4)])
def test_collectives_match_their_definitions_and_gloo(tmp_path, how, world_size):
    server, procs, results = launch(workers.collectives, world_size, how, tmp_path)
    out = ok(collect(procs, results, world_size), world_size)
    prod = 1
    for r in range(world_size):
        prod *= r + 1
    for r in range(world_size):
        o = out[r]
        assert all(o[k] for k in o if k.startswith("sum")), o
        assert o["max"] and o["noncontig"] and o["broadcast"] and o["vs_gloo"], o
        assert o["prod"] == [prod] * 6
        assert o["gather"] == [float(p) for p in range(world_size)]
        assert o["gather_into"] == [float(p) for p in range(world_size) for _ in range(3)]
    del server


@pytest.mark.parametrize("how,op", [("tcp", "all_reduce"), ("file", "all_reduce"), ("tcp", "all_gather_in_place")])
def test_rank_killed_mid_collective_times_out_naming_it(tmp_path, how, op):
    world_size, victim = 3, 1
    server, procs, results = launch(workers.dies_mid_collective, world_size, how, tmp_path, victim, op)
    got = collect(procs, results, world_size - 1)
    assert procs[victim].exitcode == -9
    for r in range(world_size):
        if r == victim:
            assert r not in got
            continue
        status, value = got[r]
        assert status == "ok", value
        assert value["timeout"] is not None, "the collective finished without the dead rank"
        assert f"rank {victim}" in value["timeout"], value["timeout"]
    del server


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_reads_symmetric_inputs_in_place(tmp_path, world_size):
    server, procs, results = launch(workers.gathers_in_place, world_size, "tcp", tmp_path)
    out = ok(collect(procs, results, world_size), world_size)
    for r in range(world_size):
        assert out[r]["failures"] == [], out[r]
        # 40 rounds, the rows of one tensor and a view: in place; a rank
        # without a symmetric input, or ranks in different allocations:
        # through the scratch block.
        assert (out[r]["in_place"], out[r]["rows"], out[r]["through_scratch"]) == (42, 1, 2), out[r]
    del server


def test_join_with_a_store_and_no_process_group(tmp_path):
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    path = str(tmp_path / "fs")
    procs = [ctx.Process(target=workers.store_only, args=(r, 2, path, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = ok(collect(procs, results, 2), 2)
    assert out[0] == out[1] == [1.0, 2.0]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_of_every_dtype_and_odd_size_matches_torch(tmp_path, world_size):
    server, procs, results = launch(workers.reductions_of_every_dtype, world_size, "tcp", tmp_path)
    out = ok(collect(procs, results, world_size), world_size)
    for r in range(world_size):
        assert out[r] == [], out[r]
    del server


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_and_all_gather_of_every_dtype_and_odd_size(tmp_path, world_size):
    server, procs, results = launch(workers.copies_of_every_dtype, world_size, "tcp", tmp_path)
    out = ok(collect(procs, results, world_size), world_size)
    for r in range(world_size):
        assert out[r] == [], out[r]
    del server


def test_wrong_sizes_and_ranks_are_named(tmp_path):
    server, procs, results = launch(workers.wrong_sizes_are_named, 2, "tcp", tmp_path)
    out = ok(collect(procs, results, 2), 2)
    for r in range(2):
        assert "output 0 has 3 elements; the input has 4" in out[r]["gather"], out[r]
        assert "source rank 2 is not in a group of 2" in out[r]["broadcast"], out[r]
    del server


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_collectives_fail_every_rank_and_the_group_goes_on(tmp_path, world_size):
    """gloo aborts or returns garbage; here every rank raises, naming the
    ranks and what each passed, and the next matched call works."""
    server, procs, results = launch(workers.mismatches_fail_every_rank, world_size, "tcp", tmp_path)
    out = ok(collect(procs, results, world_size), world_size)
    last = world_size - 1
    named = {
        "size": ["rank 0 passed all_reduce of 4 float32 elements (4 bytes each) with op sum", f"rank {last} passed all_reduce of 6 float32"],
        "dtype": [f"rank {last} passed all_reduce of 4 float64 elements (8 bytes each)"],
        "op": ["with op sum but", "with op max"],
        "complex": ["4 complex64 elements", f"rank {last} passed all_reduce of 4 complex128"],
        "grow": ["of 4 float32", f"rank {last} passed all_reduce of 100000 float32"],
        "broadcast_size": ["broadcast of 4 float32 elements (4 bytes each) from rank 0", f"rank {last} passed broadcast of 6 float32"],
        "broadcast_root": ["from rank 0 but", f"rank {last} passed broadcast of 4 float32 elements (4 bytes each) from rank 1"],
        "gather_size": ["all_gather of 4 float32", f"rank {last} passed all_gather of 6 float32"],
        "gather_dtype": ["all_gather of 4 float32", f"rank {last} passed all_gather of 4 float64"],
        "gather_in_place": ["all_gather of 4 float32", f"rank {last} passed all_gather of 6 float32"],
        "barrier": ["rank 0 passed all_reduce", f"rank {last} passed barrier"],
    }
    for r in range(world_size):
        o = out[r]
        for case, parts in named.items():
            assert o[case].startswith("InvalidArgumentError: symm "), (r, case, o[case])
            for part in parts:
                assert part in o[case], (r, case, o[case])
            assert o[case + "_after"], (r, case, "a matched all_reduce failed after the mismatch")
        refused = f"InvalidArgumentError: symm all_gather: rank(s) {last} refused their own arguments"
        if r == last:
            assert o["cast_into"].startswith("ValueError: symm.all_gather_into_tensor: output has dtype torch.int64 but the input has torch.float32"), o
            assert o["sparse"].startswith("ValueError: symm.all_reduce: tensor is a sparse_coo tensor"), o
        else:
            assert o["cast_into"].startswith(refused), o
            assert o["sparse"].startswith(refused.replace("all_gather", "all_reduce")), o
        assert o["cast_into_after"] and o["sparse_after"], o
        assert o["in_place_untouched"], o
    del server


def test_negative_sizes_sparse_and_other_inputs_are_named(tmp_path):
    server, procs, results = launch(workers.confusing_inputs_are_named, 2, "tcp", tmp_path)
    out = ok(collect(procs, results, 2), 2)
    for r in range(2):
        o = out[r]
        assert o["negative"] == "ValueError: symm.empty: dimension 0 of shape (-1,) is negative (-1); every size must be >= 0", o
        assert o["negative_2d"].startswith("ValueError: symm.empty: dimension 1 of shape (2, -3) is negative (-3)"), o
        assert o["not_a_dtype"].startswith("TypeError: symm.empty: dtype must be a torch.dtype"), o
        assert o["sparse_reduce"].startswith("ValueError: symm.all_reduce: tensor is a sparse_coo tensor; symmetric collectives take dense"), o
        assert o["csr_gather"].startswith("ValueError: symm.all_gather: tensor is a sparse_csr tensor"), o
        assert o["sparse_output"].startswith("ValueError: symm.all_gather_into_tensor: output is a sparse_coo tensor"), o
        assert o["meta"].startswith("ValueError: symm.broadcast: tensor is on meta; symmetric collectives take CPU tensors"), o
        assert "has elements that share memory" in o["expanded"], o
        assert o["cast_list"].startswith("ValueError: symm.all_gather: output 0 has dtype torch.float16 but the input has torch.float32"), o
        assert o["negative_root"].startswith("ValueError: symm.broadcast: source rank -1 is not in a group of 2"), o
        assert o["zero_size"] == [0, 5] and o["after"], o
        assert o["symm_tensor"] == [3, 3, 3], o
    del server
