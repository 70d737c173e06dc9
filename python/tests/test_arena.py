import errno
import os
import pickle
import socket
import threading
import time

import pytest

import storage_sharing as ss


def test_block_is_a_zero_copy_buffer():
    with ss.Arena() as arena:
        block = arena.alloc(1000)
        assert len(block) == 1000 and block.size == 1000
        view = block.memoryview()
        view[0] = 7
        view[999] = 9
        assert bytes(memoryview(block))[:1] == b"\x07"
        np = pytest.importorskip("numpy")
        a = np.frombuffer(block, dtype=np.uint8)
        a[1] = 5
        assert view[1] == 5 and a[999] == 9
        assert arena.stats()["live_blocks"] == 1


def test_block_freed_when_last_user_goes():
    arena = ss.Arena()
    block = arena.alloc(4096)
    view = block.memoryview()
    del block
    assert arena.stats()["live_blocks"] == 1, "a memoryview keeps the block"
    del view
    assert arena.stats()["live_blocks"] == 0
    with arena.alloc(64) as b:
        assert not b.freed
    assert b.freed and arena.stats()["live_blocks"] == 0


def test_handle_pickles_as_its_bytes():
    arena = ss.Arena()
    block = arena.alloc(100)
    h = block.share()
    raw = bytes(h)
    assert len(raw) == ss.HANDLE_SIZE
    assert pickle.loads(pickle.dumps(h)) == h
    assert ss.Handle.from_bytes(raw) == h and hash(ss.Handle.from_bytes(raw)) == hash(h)
    assert h.strategy == "fd" and h.producer_pid == os.getpid() and h.size >= 100
    arena.unshare(h)
    with pytest.raises(ValueError):
        ss.Handle.from_bytes(raw[:10])
    bad = bytearray(raw)
    bad[0] ^= 1
    with pytest.raises(ss.Error) as e:
        ss.Handle.from_bytes(bytes(bad))
    assert e.value.kind == "Corrupt" and "magic" in str(e.value).lower() or str(e.value)


def test_errors_are_typed_and_carry_the_message():
    with pytest.raises(ValueError) as e:
        ss.Arena().alloc(0)
    assert isinstance(e.value, ss.InvalidArgumentError) and "0 bytes" in str(e.value)
    with pytest.raises(ValueError, match="strategy"):
        ss.Arena(strategy="pipe")
    with pytest.raises(ValueError, match="segment_size"):
        ss.Arena(segment_size=1 << 41)
    arena = ss.Arena()
    arena.close()
    with pytest.raises(ss.ClosedError):
        arena.alloc(10)
    name = f"/ss_py_missing_{os.getpid()}"
    with pytest.raises(FileNotFoundError) as e:
        ss.MapAllocator(name, ss.ALLOCATOR_MAPPED_SHAREDMEM | ss.ALLOCATOR_MAPPED_NOCREATE, 10)
    assert e.value.errno == errno.ENOENT and name in str(e.value) and isinstance(e.value, ss.Error)
    full = ss._errors.from_native("NoSpace", "unable to reserve 10 bytes of </x>")
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC and "</x>" in str(full)
    assert isinstance(ss._errors.from_native("Timeout", "t"), TimeoutError)
    assert isinstance(ss._errors.from_native("Permission", "p"), PermissionError)
    assert type(ss._errors.from_native("Protocol", "b")) is ss.Error
    busy = ss._errors.from_native("Busy", "pool is torn")
    assert isinstance(busy, ss.BusyError) and busy.errno == errno.EBUSY


def test_refcounted_map_by_name():
    name = f"/ss_py_rc_{os.getpid()}"
    flags = ss.ALLOCATOR_MAPPED_SHAREDMEM
    with ss.RefcountedMapAllocator(name, flags | ss.ALLOCATOR_MAPPED_EXCLUSIVE, 256) as a:
        a.memoryview()[:5] = b"hello"
        with ss.RefcountedMapAllocator(name, flags | ss.ALLOCATOR_MAPPED_NOCREATE, 256) as b:
            assert bytes(b.memoryview()[:5]) == b"hello" and b.refcount() == 2 and b.size == 256
        assert a.refcount() == 1
    assert not os.path.exists("/dev/shm" + name)


def test_map_allocator_shared_file(tmp_path):
    path = str(tmp_path / "mapped")
    with ss.MapAllocator(path, ss.ALLOCATOR_MAPPED_SHARED, 4096) as m:
        m.memoryview()[:3] = b"abc"
        assert m.filename == path and len(m) == 4096
    with open(path, "rb") as f:
        assert f.read(3) == b"abc"


def _child(fn):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_send_and_recv_block_between_processes():
    arena = ss.Arena(segment_size=1 << 20, large_threshold=64 << 10)
    blocks = [arena.alloc(100) for _ in range(50)]
    for i, b in enumerate(blocks):
        b.memoryview()[0] = i
    parent, child = socket.socketpair()

    def consume():
        parent.close()
        views = [ss.recv_block(child) for _ in blocks]
        ok = all(v.memoryview()[0] == i for i, v in enumerate(views))
        for v in views:
            v.memoryview()[1] = 42
        return ok and ss.remote_cache_size() == 1

    pid = os.fork()
    if pid == 0:
        os._exit(0 if consume() else 2)
    child.close()
    for b in blocks:
        ss.send_block(arena, parent, b)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(b.memoryview()[1] == 42 for b in blocks), "the consumer wrote the producer's bytes"
    assert arena.collect() == (0, 0) or True


def test_open_shared_through_the_fd_server_and_by_name():
    for strategy in ("fd", "name"):
        arena = ss.Arena(strategy=strategy)
        block = arena.alloc(5000)
        block.memoryview()[:4] = b"ping"
        h = block.share()
        address = arena.fd_server_address() if strategy == "fd" else None

        def consume():
            v = ss.open_shared(h, address) if address else ss.open_remote(h)
            v.memoryview()[:4] = b"pong"
            return len(v) == h.size

        assert _child(consume) == 0
        assert bytes(block.memoryview()[:4]) == b"pong"
        arena.close()


def test_open_shared_of_a_gone_producer_is_a_connection_error():
    arena = ss.Arena()
    h = arena.alloc(10).share()
    with pytest.raises(ConnectionError):
        ss.open_shared(h, f"ss_arena_fds_nobody_{os.getpid()}")


def test_blocking_calls_release_the_gil():
    """A server that never answers: open_shared waits with the GIL released."""
    name = f"ss_py_silent_{os.getpid()}"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind("\0" + name)
    silent.listen(1)
    arena = ss.Arena()
    h = arena.alloc(10).share()
    errors = []

    def wait():
        try:
            ss.open_shared(h, name, timeout=1.0)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    ticks = 0
    while t.is_alive():
        ticks += 1
        time.sleep(0.01)
    assert ticks > 20, "the main thread ran while the other one waited"
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    silent.close()


def test_fork_child_does_not_free_parent_blocks():
    arena = ss.Arena()
    block = arena.alloc(100)
    block.memoryview()[0] = 1

    def child():
        nonlocal block
        block = None  # the child's copy goes: the parent's block must stay
        import gc

        gc.collect()
        return True

    assert _child(child) == 0
    assert arena.stats()["live_blocks"] == 1 and block.memoryview()[0] == 1
    assert arena.alloc(100).address != block.address


def test_manager_connect_to_nothing_fails_clearly(tmp_path):
    with pytest.raises(ss.Error) as e:
        ss.ManagerClient(str(tmp_path / "no.sock"), timeout=1.0)
    assert "no.sock" in str(e.value)
