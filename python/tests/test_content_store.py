"""storage_sharing.content_store against torch.utils._content_store: the
CPU cases of PyTorch's own tests, in our words, plus interop both ways."""

import inspect
import os

import pytest

torch = pytest.importorskip("torch")

import torch.utils._content_store as theirs  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

import storage_sharing  # noqa: E402
import storage_sharing.content_store as ours  # noqa: E402

from _forks import wait_child  # noqa: E402

pytestmark = pytest.mark.torch


def same_storage(a, b):
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


def assert_same_tensor(got, want):
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert got.storage_offset() == want.storage_offset()
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
    assert torch.equal(got, want)


# -- PyTorch's cases, CPU ---------------------------------------------------


def test_written_views_and_later_mutation_read_back(tmp_path):
    a = torch.randn(4)
    b = torch.randn(6)
    a_grid = a.view(2, 2)
    w = ours.ContentStoreWriter(str(tmp_path))
    w.write_tensor("a", a)
    w.write_tensor("b", b)
    w.write_tensor("a_grid", a_grid)
    a.data.add_(1)  # not tracked by version counters: the writer must rehash
    w.write_tensor("a_after", a)
    w.write_tensor("b_again", b)
    w.write_tensor("a_grid_after", a_grid)
    del w

    r = ours.ContentStoreReader(str(tmp_path))
    old_a, old_b, old_grid = r.read_tensor("a"), r.read_tensor("b"), r.read_tensor("a_grid")
    assert torch.equal(old_a + 1, a)
    assert torch.equal(old_b, b)
    assert torch.equal(old_grid + 1, a_grid)
    assert same_storage(old_a, old_grid)
    new_a, new_b, new_grid = r.read_tensor("a_after"), r.read_tensor("b_again"), r.read_tensor("a_grid_after")
    assert torch.equal(new_a, a)
    assert torch.equal(new_b, b)
    assert torch.equal(new_grid, a_grid)
    assert same_storage(new_b, old_b)
    assert not same_storage(new_a, old_a)


def test_zero_dim_storage_hashes():
    s = torch.tensor(2).untyped_storage()
    assert ours.hash_storage(s) == theirs.hash_storage(s)


def test_hashing_again_gives_the_same_value():
    s = torch.tensor(2).untyped_storage()
    values = {ours.hash_storage(s) for _ in range(4)}
    assert values == {theirs.hash_storage(s)}


def test_load_tensor_prim_reads_through_our_reader(tmp_path, monkeypatch):
    from torch._prims import debug_prims
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    monkeypatch.setattr(debug_prims, "ContentStoreReader", ours.ContentStoreReader)
    load = torch.ops.debugprims.load_tensor.default
    x = torch.randn(4)

    def like_x(t):
        assert (t.size(), t.stride(), t.dtype, t.device) == (x.size(), x.stride(), x.dtype, x.device)

    ours.ContentStoreWriter(str(tmp_path)).write_tensor("x", x)
    with debug_prims.load_tensor_reader(str(tmp_path)):
        assert isinstance(debug_prims.LOAD_TENSOR_READER, ours.ContentStoreReader)
        first = load("x", (4,), (1,), dtype=torch.float32, device="cpu")
        second = load("x", (4,), (1,), dtype=torch.float32, device="cpu")
        assert torch.equal(first, x) and torch.equal(second, x)
        # The prim's reader has no cache: nothing aliases.
        assert not same_storage(x, first)
        assert not same_storage(first, second)
        with FakeTensorMode():
            fake = load("x", (4,), (1,), dtype=torch.float32, device="cpu")
            assert isinstance(fake, FakeTensor)
            like_x(fake)
        wide = load("x", (4,), (1,), dtype=torch.float64, device="cpu")
        assert wide.dtype == torch.float64
        assert torch.equal(wide.float(), x)
    # Outside the context: random data of the right shape.
    like_x(load("x", (4,), (1,), dtype=torch.float32, device="cpu"))


# -- the same module --------------------------------------------------------


def test_signatures_are_pytorchs():
    for name in ["hash_storage"]:
        assert inspect.signature(getattr(ours, name)) == inspect.signature(getattr(theirs, name))
    pairs = [
        ("ContentStoreWriter", ["__init__", "write_storage", "write_tensor", "compute_tensor_metadata"]),
        ("ContentStoreReader", ["__init__", "read_storage", "read_tensor", "read_tensor_metadata"]),
    ]
    for cls, methods in pairs:
        for m in methods:
            a = inspect.signature(getattr(getattr(ours, cls), m))
            b = inspect.signature(getattr(getattr(theirs, cls), m))
            assert list(a.parameters) == list(b.parameters), (cls, m)
            for p in a.parameters:
                assert a.parameters[p].kind == b.parameters[p].kind, (cls, m, p)
                assert a.parameters[p].default == b.parameters[p].default, (cls, m, p)


@pytest.mark.parametrize("stable", [True, False])
def test_hash_equals_pytorchs_for_many_lengths(stable):
    g = torch.Generator().manual_seed(7)
    # The last length runs past the default hash's table of values (the
    # first 16 MiB of a storage).
    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 1000, 4097, (1 << 18) + 3, (17 << 20) + 3]:
        s = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).untyped_storage()
        assert ours.hash_storage(s, stable_hash=stable) == theirs.hash_storage(s, stable_hash=stable), n


def test_default_hash_leaves_the_generator_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    ours.hash_storage(torch.arange(100).untyped_storage())
    assert torch.equal(torch.rand(3), want)


def tensors_to_store():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    shared = torch.arange(24, dtype=torch.int64)
    return {
        "plain": torch.randn(5, 3),
        "transposed": base.t(),
        "row": base[2],
        "column_slice": base[1:5, 3:7],
        "nested/dir/deep": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "complex": torch.randn(3, dtype=torch.complex64),
        "shared_a": shared.view(4, 6),
        "shared_b": shared[5:17:3],
        "odd_bytes": torch.arange(5, dtype=torch.uint8),
    }


def write_all(module, loc, tensors, stable):
    w = module.ContentStoreWriter(str(loc), stable_hash=stable)
    for name, t in tensors.items():
        w.write_tensor(name, t)
    return w


@pytest.mark.parametrize("stable", [True, False])
@pytest.mark.parametrize("writer,reader", [(ours, theirs), (theirs, ours), (ours, ours)])
def test_files_interoperate(tmp_path, writer, reader, stable):
    tensors = tensors_to_store()
    write_all(writer, tmp_path, tensors, stable)
    r = reader.ContentStoreReader(str(tmp_path))
    got = {name: r.read_tensor(name) for name in tensors}
    for name, t in tensors.items():
        assert_same_tensor(got[name], t)
    assert same_storage(got["shared_a"], got["shared_b"])
    assert same_storage(got["transposed"], got["row"])
    assert same_storage(got["row"], got["column_slice"])
    assert not same_storage(got["plain"], got["row"])
    # A view stays a view: writing through one shows in the other.
    got["shared_a"][0, 5] = -1
    assert got["shared_b"][0].item() == -1


@pytest.mark.parametrize("stable", [True, False])
def test_both_writers_name_storages_alike(tmp_path, stable):
    tensors = tensors_to_store()
    write_all(ours, tmp_path / "ours", tensors, stable)
    write_all(theirs, tmp_path / "theirs", tensors, stable)
    listing = {side: sorted(os.listdir(tmp_path / side / "storages")) for side in ["ours", "theirs"]}
    assert listing["ours"] == listing["theirs"]
    for name in tensors:
        a = ours.ContentStoreReader(str(tmp_path / "ours")).read_tensor_metadata(name)
        b = theirs.ContentStoreReader(str(tmp_path / "theirs")).read_tensor_metadata(name)
        assert a == b, name


def test_write_storage_returns_the_hash_and_dedups(tmp_path):
    w = ours.ContentStoreWriter(str(tmp_path), stable_hash=True)
    s = torch.arange(10, dtype=torch.int32).untyped_storage()
    h = w.write_storage(s)
    assert h == theirs.hash_storage(s, stable_hash=True)
    assert w.write_storage(torch.arange(10, dtype=torch.int32).untyped_storage()) == h
    assert os.listdir(tmp_path / "storages") == [h]
    assert w.seen_storage_hashes == {h}
    back = theirs.ContentStoreReader(str(tmp_path)).read_storage(h)
    assert bytes(back) == bytes(s)


def test_compute_tensor_metadata_is_pytorchs(tmp_path):
    t = torch.randn(3, 4)[1:, ::2]
    a = ours.ContentStoreWriter(str(tmp_path)).compute_tensor_metadata(t)
    b = theirs.ContentStoreWriter(str(tmp_path)).compute_tensor_metadata(t)
    assert a == b


def test_conjugate_view_keeps_its_flag_both_ways(tmp_path):
    t = torch.randn(4, dtype=torch.complex64).conj()
    ours.ContentStoreWriter(str(tmp_path / "o")).write_tensor("c", t)
    theirs.ContentStoreWriter(str(tmp_path / "t")).write_tensor("c", t)
    for side in ["o", "t"]:
        for reader in [ours, theirs]:
            back = reader.ContentStoreReader(str(tmp_path / side)).read_tensor("c")
            assert back.is_conj()
            assert torch.equal(back.resolve_conj(), t.resolve_conj())


def test_reader_without_cache_gives_fresh_storages(tmp_path):
    x = torch.randn(8)
    ours.ContentStoreWriter(str(tmp_path)).write_tensor("x", x)
    cached = ours.ContentStoreReader(str(tmp_path))
    assert same_storage(cached.read_tensor("x"), cached.read_tensor("x"))
    fresh = ours.ContentStoreReader(str(tmp_path), cache=False)
    assert fresh.storage_cache is None
    a, b = fresh.read_tensor("x"), fresh.read_tensor("x")
    assert not same_storage(a, b)
    a.add_(1)
    assert torch.equal(b, x)


def test_missing_tensor_is_file_not_found(tmp_path):
    ours.ContentStoreWriter(str(tmp_path)).write_tensor("x", torch.zeros(1))
    r = ours.ContentStoreReader(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        r.read_tensor("nope")


def test_damaged_storage_file_is_an_error_not_a_crash(tmp_path):
    w = ours.ContentStoreWriter(str(tmp_path), stable_hash=True)
    w.write_tensor("x", torch.randn(64))
    w.flush()  # the files are in the folder from here on
    (name,) = os.listdir(tmp_path / "storages")
    with open(tmp_path / "storages" / name, "r+b") as f:
        f.truncate(100)
    with pytest.raises(Exception) as info:
        ours.ContentStoreReader(str(tmp_path)).read_tensor("x")
    assert name in str(info.value)


@pytest.mark.parametrize("writer", [theirs, ours], ids=["torch_wrote", "we_wrote"])
def test_a_flipped_data_byte_is_reported_on_read(tmp_path, writer):
    # The bytes are checked against their zip record's CRC-32 as they are
    # copied in; PyTorch's reader checks no CRC and hands the damage out.
    x = torch.arange(1 << 20, dtype=torch.float32)
    w = writer.ContentStoreWriter(str(tmp_path), stable_hash=True)
    w.write_tensor("x", x)
    del w  # the files are in the folder from here on
    (name,) = os.listdir(tmp_path / "storages")
    path = tmp_path / "storages" / name
    data = path.read_bytes()
    at = data.index(x.numpy()[-100:].tobytes())
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x04]))
    with pytest.raises(storage_sharing.Error) as info:
        ours.ContentStoreReader(str(tmp_path)).read_tensor("x")
    assert info.value.kind == "Corrupt"
    assert name in str(info.value) and "CRC-32" in str(info.value)
    assert not torch.equal(theirs.ContentStoreReader(str(tmp_path)).read_tensor("x"), x)


def test_default_hash_in_a_forked_child_after_the_parent_used_all_cores():
    # The parent's big hash starts the hashing threads; a forked child has
    # none of them and must hash on its own thread, not wait for them.
    big = torch.randn(1 << 20).untyped_storage()
    ours.hash_storage(big)
    want = theirs.hash_storage(big)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, ours.hash_storage(big).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    assert wait_child(pid) == 0
    got = os.read(r, 100).decode()
    os.close(r)
    assert got == want
