"""storage_sharing.content_store where it must do better than PyTorch's
module: names that leave the store are refused (PyTorch's reader loads
them), hash_storage takes a tensor, and a store whose owner (another
user) shrinks its files gives right tensors or a clear error."""

import os
import signal
import time
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.utils._content_store as theirs  # noqa: E402

import storage_sharing  # noqa: E402
import storage_sharing.content_store as ours  # noqa: E402

from _forks import wait_child  # noqa: E402

pytestmark = pytest.mark.torch


# -- hash_storage of a tensor ------------------------------------------------


@pytest.mark.parametrize("stable", [False, True], ids=["default", "stable"])
def test_hash_storage_takes_a_tensor_as_its_whole_storage(stable):
    t = torch.arange(10, dtype=torch.float32)
    want = theirs.hash_storage(t.untyped_storage(), stable_hash=stable)
    assert ours.hash_storage(t, stable_hash=stable) == want
    assert ours.hash_storage(t[2:5], stable_hash=stable) == want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        typed = t.storage()
    assert ours.hash_storage(typed, stable_hash=stable) == want
    with pytest.raises(TypeError, match="UntypedStorage"):
        ours.hash_storage([1, 2, 3], stable_hash=stable)


# -- names that leave the store ---------------------------------------------


def _store_with_a_secret_outside(tmp_path):
    """A store with tensor x, and entries naming x's storage at places
    outside tensors/: store/secret, outside/secret, and links to them."""
    loc = tmp_path / "store"
    w = ours.ContentStoreWriter(str(loc), stable_hash=True)
    x = torch.arange(4, dtype=torch.float32)
    w.write_tensor("x", x)
    w.close()
    meta = theirs.ContentStoreReader(str(loc)).read_tensor_metadata("x")
    torch.save(meta, loc / "secret")
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save(meta, outside / "secret")
    os.symlink(outside / "secret", loc / "tensors" / "link")
    os.symlink(outside, loc / "tensors" / "folder_link")
    return loc, outside, x


def _escaping_names(outside):
    return {
        "dotdot": "../secret",
        "dotdot_deeper": "../../outside/secret",
        "absolute": str(outside / "secret"),
        "linked_entry": "link",
        "linked_folder": "folder_link/secret",
    }


@pytest.mark.parametrize("kind", ["dotdot", "dotdot_deeper", "absolute", "linked_entry", "linked_folder"])
def test_names_leaving_the_store_are_refused_never_loaded(tmp_path, kind):
    loc, outside, x = _store_with_a_secret_outside(tmp_path)
    name = _escaping_names(outside)[kind]
    # PyTorch's reader follows the name out of the store: the hazard.
    assert torch.equal(theirs.ContentStoreReader(str(loc)).read_tensor(name), x)
    r = ours.ContentStoreReader(str(loc))
    with pytest.raises(storage_sharing.Error) as info:
        r.read_tensor(name)
    assert info.value.kind in ("InvalidArgument", "Permission"), info.value
    with pytest.raises(storage_sharing.Error):
        r.read_tensor_metadata(name)
    # The store itself still reads.
    assert torch.equal(r.read_tensor("x"), x)


def test_an_entry_only_pytorchs_loader_parses_is_still_read(tmp_path):
    # float8_e4m3fnuz is not in the library's entry format: the entry is
    # PyTorch's, read safely by us, then parsed by torch.load.
    x = torch.arange(6, dtype=torch.float32).to(torch.float8_e4m3fnuz)
    w = theirs.ContentStoreWriter(str(tmp_path), stable_hash=True)
    w.write_tensor("nested/f8", x)
    del w
    got = ours.ContentStoreReader(str(tmp_path)).read_tensor("nested/f8")
    assert got.dtype == torch.float8_e4m3fnuz
    assert torch.equal(got.view(torch.uint8), x.view(torch.uint8))


# -- a store whose owner shrinks its files -----------------------------------


def _shrink_forever(paths, as_nobody):
    """In a forked child: as the files' owner, truncate each file and grow
    it back with its bytes, over and over."""
    files = [(os.open(p, os.O_RDWR), open(p, "rb").read()) for p in paths]
    pid = os.fork()
    if pid != 0:
        for fd, _ in files:
            os.close(fd)
        return pid
    try:
        if as_nobody:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        n = 0
        while True:
            for fd, data in files:
                os.ftruncate(fd, [0, 4096, len(data) // 2][n % 3])
                os.ftruncate(fd, len(data))
                os.pwrite(fd, data, 0)
                time.sleep(0.002)  # whole for a moment, so some reads land then
            n += 1
    finally:
        os._exit(1)


def test_reader_of_a_store_its_owner_shrinks_gives_right_data_or_an_error(tmp_path):
    loc = tmp_path / "store"
    x = torch.randn(1 << 20)
    w = ours.ContentStoreWriter(str(loc), stable_hash=True)
    w.write_tensor("x", x)
    w.close()
    as_nobody = os.geteuid() == 0
    for root, dirs, files in os.walk(loc):
        for p in [root] + [os.path.join(root, f) for f in files]:
            if as_nobody:
                os.chown(p, 65534, 65534)
            elif os.path.isfile(p):
                os.chmod(p, 0o666)  # writable by others: untrusted as well
    held = ours.ContentStoreReader(str(loc), cache=False).read_tensor("x")
    storages = [str(loc / "storages" / h) for h in os.listdir(loc / "storages")]
    pid = _shrink_forever(storages, as_nobody)
    try:
        good = refused = 0
        for _ in range(200):
            try:
                t = ours.ContentStoreReader(str(loc), cache=False).read_tensor("x")
            except storage_sharing.Error as e:
                assert e.kind == "Corrupt" and "storage" in str(e), e
                refused += 1
            else:
                assert torch.equal(t, x)
                good += 1
            assert torch.equal(held, x)
        print(f"{good} right, {refused} refused with a clear error")
    finally:
        os.kill(pid, signal.SIGKILL)
        wait_child(pid)
