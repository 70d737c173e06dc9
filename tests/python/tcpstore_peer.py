"""A PyTorch TCPStore rank for tests/store/tcpstore_protocol.rs.

usage: tcpstore_peer.py server <use_libuv 0|1>
         PyTorch serves (world size 2); prints "PORT <n>", then plays the
         exchange below against our client.
       tcpstore_peer.py client <port>
         PyTorch's client joins our server (world size 2) and plays it.
       tcpstore_peer.py extended <port>
         PyTorch's client uses the queue, list_keys and barrier requests
         against our server (world size 1); a forked second client joins
         the two-rank barrier.
"""
import sys
from datetime import timedelta

import torch.distributed as dist


def exchange(store):
    # Our rank sets from_c; we answer from_py and bump a shared counter.
    assert store.get("from_c") == b"hello from C", store.get("from_c")
    store.set("from_py", b"hello\x00from python")
    assert store.add("counter", 10) >= 10
    store.wait(["after_add"], timedelta(seconds=20))
    assert store.get("counter") == b"15", store.get("counter")
    assert store.check(["from_c", "from_py"]) and not store.check(["never"])
    assert store.compare_set("cas", "", "first") == b"first"
    assert store.compare_set("cas", "wrong", "x") == b"first"
    assert store.multi_get(["from_c", "cas"]) == [b"hello from C", b"first"]
    store.multi_set(["m1", "m2"], ["a", "bb"])
    store.append("ap", "12")
    store.append("ap", "34")
    assert store.get("ap") == b"1234"
    assert store.delete_key("cas") and not store.delete_key("cas")
    try:
        store.wait(["never"], timedelta(milliseconds=100))
        raise AssertionError("wait for a missing key returned")
    except dist.DistStoreError:
        pass
    store.set("py_done", b"1")
    print("PY_OK", flush=True)


def expect_error(call, what):
    try:
        call()
    except dist.DistError:
        return
    raise AssertionError(what)


def extended(port):
    store = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=30))
    store.queue_push("q", "a")
    store.queue_push("q", b"bb")
    assert store.queue_len("q") == 2, store.queue_len("q")
    assert store.check(["q"])
    assert store.queue_pop("q") == b"a"
    assert store.queue_pop("q", block=False) == b"bb"
    assert store.queue_len("q") == 0 and not store.check(["q"])
    expect_error(lambda: store.queue_pop("q", block=False), "pop of an empty queue returned")
    assert store.queue_len("never_pushed") == 0
    store.set_timeout(timedelta(milliseconds=200))
    expect_error(lambda: store.queue_pop("q"), "blocking pop of an empty queue returned")
    store.set_timeout(timedelta(seconds=30))
    # A queue and a key of one name live side by side.
    store.set("both", "key")
    store.queue_push("both", "queued")
    assert store.get("both") == b"key" and store.queue_pop("both") == b"queued"
    store.set("lk1", "1")
    store.set("lk2", "2")
    store.queue_push("only_a_queue", "x")
    keys = set(store.list_keys())
    assert {"lk1", "lk2", "both"} <= keys and "only_a_queue" not in keys, keys
    store.barrier("b1", 1)
    store.barrier("b1", 1)
    assert store.get("b1") == b"2"
    expect_error(lambda: store.barrier("b2", 2, timedelta(milliseconds=200)), "a barrier of 2 passed with 1")
    import os
    pid = os.fork()
    if pid == 0:
        other = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=30))
        other.barrier("b3", 2)
        other.queue_push("from_child", "done")
        os._exit(0)
    store.barrier("b3", 2)
    assert store.queue_pop("from_child") == b"done"
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    print("PY_OK", flush=True)


def main():
    role = sys.argv[1]
    if role == "server":
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30),
                              wait_for_workers=False, use_libuv=sys.argv[2] == "1")
        print("PORT", store.port, flush=True)
        exchange(store)
        store.wait(["c_done"], timedelta(seconds=30))
    elif role == "extended":
        extended(int(sys.argv[2]))
    else:
        store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, False, timedelta(seconds=30))
        exchange(store)


main()
