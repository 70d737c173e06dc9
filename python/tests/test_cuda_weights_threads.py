"""storage_sharing.cuda under the threads of one consumer process: reads
nested in reads while an update waits, close() while another thread
reads, a burst of opens, and what a consumer's writes are. The producer
and its consumer share this process (the host backend allows it), so
nothing here waits on another process."""

import threading

import pytest

torch = pytest.importorskip("torch")

import storage_sharing as ss  # noqa: E402
from storage_sharing import cuda  # noqa: E402

WORDS = 1 << 16


def wait_until(predicate, what, limit=20.0):
    """Polls `predicate` (a hang guard, not a timing assertion)."""
    import time

    end = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


@pytest.fixture
def pool_and_weights():
    pool = cuda.Pool.from_state_dict({"w": torch.ones(WORDS, dtype=torch.float64)}, max_consumers=128)
    weights = cuda.open_weights(pool.export(), timeout=30)
    yield pool, weights
    weights.close()


def update_to(pool, value, result):
    """An update that writes `value` everywhere (in a thread)."""
    try:
        with pool.update(timeout=30) as tensors:
            tensors["w"].fill_(value)
        result.append(pool.version)
    except Exception as e:  # reported to the test's thread
        result.append(e)


def test_a_nested_reading_enters_at_once_while_an_update_waits(pool_and_weights):
    pool, w = pool_and_weights
    done = []
    with w.reading() as outer:
        updater = threading.Thread(target=update_to, args=(pool, 2.0, done))
        updater.start()
        wait_until(lambda: w.update_pending, "the producer waits to write")
        # The same thread again: it must not queue behind the producer.
        with w.reading(timeout=5) as inner:
            assert inner == outer == 1
        # Worker threads this read started and waits for.
        seen = []
        workers = [threading.Thread(target=lambda: seen.append(read_once(w))) for _ in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(30)
        assert seen == [(1, 1.0, 1.0)] * 4, seen
        assert not done, "the producer wrote during a read"
    updater.join(30)
    assert done == [2]
    assert read_once(w) == (2, 2.0, 2.0)


def read_once(w):
    with w.reading(timeout=5) as v:
        t = w["w"]
        return v, float(t[0]), float(t[-1])


def test_close_waits_for_another_threads_read_and_never_tears_it(pool_and_weights):
    pool, w = pool_and_weights
    entered, go, seen = threading.Event(), threading.Event(), []

    def reader():
        with w.reading() as v:
            t = w["w"]
            first = float(t[0])
            entered.set()
            go.wait(30)
            seen.append((v, first, float(t[-1])))

    r = threading.Thread(target=reader)
    r.start()
    assert entered.wait(30)
    closer = threading.Thread(target=w.close)
    closer.start()
    wait_until(lambda: not closer.is_alive() or w._closing, "close() waits or returns")
    done = []
    updater = threading.Thread(target=update_to, args=(pool, 2.0, done))
    updater.start()
    # Had close() dropped the reader's hold, the update would go through now.
    updater.join(0.5)
    go.set()
    r.join(30)
    closer.join(30)
    updater.join(30)
    assert seen == [(1, 1.0, 1.0)], f"the read was torn by close(): {seen}"
    assert done == [2]
    assert w.closed


def test_close_refuses_new_reads_and_gives_up_after_its_timeout(pool_and_weights):
    pool, w = pool_and_weights
    entered, go = threading.Event(), threading.Event()

    def reader():
        with w.reading():
            entered.set()
            go.wait(30)

    r = threading.Thread(target=reader)
    r.start()
    assert entered.wait(30)
    with pytest.raises(ss.BusyError, match="other threads still open"):
        w.close(timeout=0.1)
    assert not w.closed
    go.set()
    r.join(30)
    w.close(timeout=5)
    assert w.closed
    with pytest.raises(ss.ClosedError):
        w.acquire()
    # The calling thread's own read ends with close(); its release is then a no-op.
    w2 = cuda.open_weights(pool.export(), timeout=30)
    with w2.reading():
        w2.close()
    assert pool.consumers >= 0 and w2.closed
    with pool.update(timeout=10):
        pass


def test_a_burst_of_opens_all_succeed(pool_and_weights):
    pool, _ = pool_and_weights
    handle, start, results = pool.export(), threading.Barrier(100), []

    def opener():
        start.wait(30)
        try:
            results.append(cuda.open_weights(handle, timeout=30))
        except Exception as e:
            results.append(e)

    threads = [threading.Thread(target=opener) for _ in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed and len(results) == 100, f"{len(failed)} of 100 opens failed: {failed[:1]}"
    for r in results:
        r.close()


def test_a_consumers_tensors_are_shared_memory_and_its_writes_are_unversioned(pool_and_weights):
    pool, w = pool_and_weights
    t = w["w"]
    assert t.is_shared() and t.untyped_storage().is_shared()
    ptr = t.data_ptr()
    t.share_memory_()
    assert t.data_ptr() == ptr, "share_memory_() moved pool memory to a copy"
    assert pool.state_dict()["w"].is_shared()
    # Documented: a consumer's write is the producer's memory, no new version.
    with w.reading():
        t[0] = 5.0
    assert float(pool.state_dict()["w"][0]) == 5.0 and pool.version == 1


def test_dropping_a_pool_waits_on_no_silent_connection():
    import gc
    import socket
    import time

    from storage_sharing import _native

    big = {f"layer.{i}.weight.with_a_long_name": torch.zeros(16) for i in range(5000)}
    pool = cuda.Pool.from_state_dict(big)
    name = _native.pool_handle_info(bytes(pool.export()))[0]
    silent = []
    for _ in range(2):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect("\0" + name)
        silent.append(s)  # connected, never reading the manifest
    wait_until(lambda: pool.consumers == 2, "the server took both")
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.wait(0.01):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    del pool
    gc.collect()
    took = time.monotonic() - start
    stop.set()
    ticker.join(10)
    for s in silent:
        s.close()
    # A hang guard, not a timing assertion: a drop that waited on the
    # silent peers took 10 s or more while holding the GIL.
    assert took < 5, f"dropping the pool took {took:.1f} s with 2 silent connections"
    assert ticks, "other Python threads froze while the pool was dropped"
