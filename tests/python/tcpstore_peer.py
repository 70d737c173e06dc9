"""A PyTorch TCPStore rank for tests/store_tcp.rs.

usage: tcpstore_peer.py server <use_libuv 0|1>
         PyTorch serves (world size 2); prints "PORT <n>", then plays the
         exchange below against our client.
       tcpstore_peer.py client <port>
         PyTorch's client joins our server (world size 2) and plays it.
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


def main():
    role = sys.argv[1]
    if role == "server":
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30),
                              wait_for_workers=False, use_libuv=sys.argv[2] == "1")
        print("PORT", store.port, flush=True)
        exchange(store)
        store.wait(["c_done"], timedelta(seconds=30))
    else:
        store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, False, timedelta(seconds=30))
        exchange(store)


main()
