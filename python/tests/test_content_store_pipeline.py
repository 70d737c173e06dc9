"""storage_sharing.content_store's background writing: write_tensor copies
the bytes and returns, the rest is done by a pool. These check what a
caller can still count on: the value at the call is what is stored,
duplicates are stored once, the last tensor of a name wins, our readers
see queued tensors, errors come back, and a forked child writes too."""

import io
import os
import subprocess
import sys
import zipfile

import pytest

torch = pytest.importorskip("torch")

import torch.utils._content_store as theirs  # noqa: E402

import storage_sharing.content_store as ours  # noqa: E402
from storage_sharing._errors import Error  # noqa: E402

from _forks import wait_child  # noqa: E402

pytestmark = pytest.mark.torch

# Both ways of hashing, whatever this machine's core count picks.
PLACES = ["caller", "pool"]


def writer(loc, place, stable=True):
    w = ours.ContentStoreWriter(str(loc), stable_hash=stable)
    w._writer().set_hash_where(place)
    return w


@pytest.mark.parametrize("place", PLACES)
def test_changing_a_tensor_right_after_writing_it_changes_nothing_stored(tmp_path, place):
    w = writer(tmp_path, place)
    t = torch.zeros(1 << 20)  # 4 MiB: still queued when changed below
    want = []
    for i in range(12):
        t.fill_(i)
        want.append(t.clone())
        w.write_tensor(f"t{i}", t)
    t.fill_(-1)
    w.flush()
    r = theirs.ContentStoreReader(str(tmp_path))
    for i, v in enumerate(want):
        assert torch.equal(r.read_tensor(f"t{i}"), v), i


@pytest.mark.parametrize("place", PLACES)
def test_copies_of_one_content_in_flight_are_stored_once(tmp_path, place):
    w = writer(tmp_path, place)
    base = torch.randn(1 << 18)
    copies = [base.clone() for _ in range(16)]
    for i, c in enumerate(copies):
        w.write_tensor(f"copy{i}", c)
    w.flush()
    written, deduplicated, tensors, _ = w._native.stats()
    assert (written, deduplicated, tensors) == (1, 15, 16)
    assert len(os.listdir(tmp_path / "storages")) == 1
    r = theirs.ContentStoreReader(str(tmp_path))
    for i in range(16):
        assert torch.equal(r.read_tensor(f"copy{i}"), base)


@pytest.mark.parametrize("place", PLACES)
def test_the_last_tensor_written_under_a_name_is_the_one_kept(tmp_path, place):
    w = writer(tmp_path, place)
    for i in range(40):
        # Sizes differ, so later ones may finish first.
        w.write_tensor("x", torch.full(((40 - i) * 4096,), float(i)))
    w.flush()
    got = theirs.ContentStoreReader(str(tmp_path)).read_tensor("x")
    assert got.shape == (4096,)
    assert got[0].item() == 39.0


@pytest.mark.parametrize("place", PLACES)
def test_our_reader_sees_queued_tensors_while_the_writer_lives(tmp_path, place):
    w = writer(tmp_path, place, stable=False)
    tensors = {f"d/t{i}": torch.randn(1 << 16) for i in range(8)}
    for name, t in tensors.items():
        w.write_tensor(name, t)
    r = ours.ContentStoreReader(str(tmp_path))
    for name, t in tensors.items():
        assert torch.equal(r.read_tensor(name), t)
    assert len(w.seen_storage_hashes) == 8


def test_a_background_failure_is_raised_by_flush_naming_the_tensor(tmp_path):
    w = writer(tmp_path, "pool")
    # Bigger, so it is likely still being hashed when "a/b" is done.
    w.write_tensor("a", torch.ones(1 << 20)[:3])
    # "a" is a tensor file, so "a/b" cannot be made; found only when written.
    w.write_tensor("a/b", torch.ones(5))
    with pytest.raises(Error) as info:
        w.flush()
    assert "a/b" in str(info.value)
    w.flush()  # reported once
    w.write_tensor("c", torch.ones(2))
    w.close()
    # Entries go out in the order written, so "a" made it, as it would
    # have written in the call.
    r = theirs.ContentStoreReader(str(tmp_path))
    assert torch.equal(r.read_tensor("a"), torch.ones(1 << 20)[:3])
    assert torch.equal(r.read_tensor("c"), torch.ones(2))


def test_a_background_failure_is_raised_by_the_next_write(tmp_path):
    w = writer(tmp_path, "pool")
    w.write_tensor("a", torch.ones(3))
    w.write_tensor("a/b", torch.ones(5))
    w._native.wait_idle()
    with pytest.raises(Error, match="a/b"):
        w.write_tensor("c", torch.ones(2))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("stable", [True, False])
def test_a_forked_child_writes_while_the_parent_has_tensors_queued(tmp_path, place, stable):
    # The default hash runs on the pool and fills its table while the
    # parent's tensors are hashed: the child must use neither.
    w = writer(tmp_path, place, stable)
    big = [torch.full((1 << 20,), float(i)) for i in range(8)]
    for i, t in enumerate(big):
        w.write_tensor(f"parent{i}", t)
    child_tensor = torch.arange(float(1 << 20))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            w.write_tensor("child", child_tensor)
            w.flush()
            code = 0 if os.path.exists(tmp_path / "tensors" / "child") else 2
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    w.close()
    r = theirs.ContentStoreReader(str(tmp_path))
    assert torch.equal(r.read_tensor("child"), child_tensor)
    # The child named the storage as PyTorch does.
    h = theirs.hash_storage(child_tensor.untyped_storage(), stable_hash=stable)
    assert (tmp_path / "storages" / h).is_file()
    for i, t in enumerate(big):
        assert torch.equal(r.read_tensor(f"parent{i}"), t)


def test_bad_names_and_views_are_refused_in_the_call(tmp_path):
    w = writer(tmp_path, "pool")
    with pytest.raises(Error, match="tensor name"):
        w.write_tensor("../escape", torch.ones(2))
    with pytest.raises(Error):
        w.write_tensor("", torch.ones(2))
    w.flush()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("stable", [True, False])
def test_pipelined_storage_files_hold_what_torch_save_writes(tmp_path, place, stable):
    tensors = {"a": torch.randn(1000), "b": torch.arange(77, dtype=torch.int16), "c": torch.randn(1 << 20)}
    w = writer(tmp_path / "ours", place, stable)
    t = theirs.ContentStoreWriter(str(tmp_path / "theirs"), stable_hash=stable)
    for name, x in tensors.items():
        w.write_tensor(name, x)
        t.write_tensor(name, x)
    w.close()
    names = sorted(os.listdir(tmp_path / "theirs" / "storages"))
    assert sorted(os.listdir(tmp_path / "ours" / "storages")) == names
    for h in names:
        ours_bytes = (tmp_path / "ours" / "storages" / h).read_bytes()
        # torch.save to a stream names its folder "archive", as ours does;
        # only the serialization id (digits of the writer's choosing) differs.
        stream = io.BytesIO()
        torch.save(theirs.ContentStoreReader(str(tmp_path / "theirs")).read_storage(h), stream)
        want = zipfile.ZipFile(io.BytesIO(stream.getvalue()))
        got = zipfile.ZipFile(io.BytesIO(ours_bytes))
        # Ours always writes the two records later PyTorch releases' torch.save
        # added (2.4 has neither, 2.15 both); an older torch.save leaves them
        # out, and its torch.load reads files with them: there, the records it
        # writes must match and it must load ours.
        newer = {"archive/.format_version", "archive/.storage_alignment"}
        older_torch = not newer & set(want.namelist())
        assert [n for n in got.namelist() if not (older_torch and n in newer)] == want.namelist()
        for record in want.namelist():
            if not record.endswith("serialization_id"):
                assert got.read(record) == want.read(record), record
        if older_torch:
            loaded = torch.load(io.BytesIO(ours_bytes))
            if isinstance(loaded, torch.TypedStorage):
                loaded = loaded._untyped_storage
            expected = theirs.ContentStoreReader(str(tmp_path / "theirs")).read_storage(h)
            as_bytes = lambda s: torch.empty(0, dtype=torch.uint8).set_(s)  # noqa: E731
            assert torch.equal(as_bytes(loaded), as_bytes(expected))
        else:
            assert len(ours_bytes) == len(stream.getvalue())


def test_a_failure_still_pending_when_the_writer_is_deleted_is_a_warning(tmp_path):
    w = writer(tmp_path, "pool")
    w.write_tensor("a", torch.ones(3))
    w.write_tensor("a/b", torch.ones(5))
    with pytest.warns(RuntimeWarning, match="a/b"):
        del w


def test_a_writer_alive_at_exit_has_written_everything(tmp_path):
    # A module-level writer is never collected before the interpreter
    # exits; what it queued must still reach the folder.
    script = (
        "import torch\n"
        "from storage_sharing.content_store import ContentStoreWriter\n"
        f"W = ContentStoreWriter({str(tmp_path)!r})\n"
        "for i in range(8):\n"
        "    W.write_tensor(f't{i}', torch.full((1 << 18,), float(i)))\n"
        "import threading\n"
        "threading.Thread(target=lambda w=W: threading.Event().wait(), daemon=True).start()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    r = ours.ContentStoreReader(str(tmp_path))
    for i in range(8):
        assert torch.equal(r.read_tensor(f"t{i}"), torch.full((1 << 18,), float(i)))
