"""Checks the TCPStore wire facts of docs/tcpstore-protocol.md against the
installed torch: raw bytes to PyTorch's libuv and classic servers, and
PyTorch's client bytes seen through a logging relay.

usage: python scripts/tcpstore_probe.py     (prints one line per fact; exits 1 on a mismatch)
"""
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

MAGIC = struct.pack("<I", 0x3C85F7CE)
HELLO = b"\x00" + MAGIC
failures = []


def s_(b):
    return struct.pack("<Q", len(b)) + b


def q(n):
    return struct.pack("<Q", n)


def talk(port, data, wait=0.3):
    """Sends data on a fresh connection; returns the bytes back and how it ended."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(wait)
    s.sendall(data)
    out, end = b"", "open"
    try:
        while True:
            d = s.recv(4096)
            if not d:
                end = "closed"
                break
            out += d
    except socket.timeout:
        pass
    except ConnectionResetError:
        end = "closed"
    s.close()
    return out, end


def fact(backend, name, got, want):
    ok = got == want
    print(f"[{'ok' if ok else 'MISMATCH'}] {backend}: {name}" + ("" if ok else f": got {got!r}, want {want!r}"))
    if not ok:
        failures.append(name)


def server_facts(libuv):
    b = "libuv" if libuv else "classic"
    st = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False, use_libuv=libuv)
    p = st.port
    fact(b, "PING echoes its u32 after VALIDATE", talk(p, HELLO + b"\x0d" + struct.pack("<I", 0xABCD)), (struct.pack("<I", 0xABCD), "open"))
    fact(b, "SET has no reply; GET answers u64 length + bytes",
         talk(p, HELLO + b"\x01" + s_(b"/k") + s_(b"v") + b"\x03" + s_(b"/k")), (q(1) + b"v", "open"))
    fact(b, "ADD answers the new i64; a missing key counts as 0",
         talk(p, HELLO + b"\x04" + s_(b"/n") + struct.pack("<q", 5) + b"\x04" + s_(b"/n") + struct.pack("<q", -7)),
         (struct.pack("<q", 5) + struct.pack("<q", -2), "open"))
    fact(b, "ADD parses the stored text like stoll ('12x' + 1 = 13)",
         talk(p, HELLO + b"\x01" + s_(b"/t") + s_(b"12x") + b"\x04" + s_(b"/t") + struct.pack("<q", 1)), (struct.pack("<q", 13), "open"))
    fact(b, "ADD on text without digits closes the connection",
         talk(p, HELLO + b"\x01" + s_(b"/x") + s_(b"text") + b"\x04" + s_(b"/x") + struct.pack("<q", 1))[1], "closed")
    fact(b, "CHECK answers 0 when all keys are set, 1 otherwise; 0 keys is 0",
         talk(p, HELLO + b"\x05" + q(1) + s_(b"/k") + b"\x05" + q(2) + s_(b"/k") + s_(b"/zz") + b"\x05" + q(0)), (b"\x00\x01\x00", "open"))
    fact(b, "WAIT answers 0 at once when set; CANCEL_WAIT answers 1",
         talk(p, HELLO + b"\x06" + q(1) + s_(b"/k") + b"\x06" + q(1) + s_(b"/absent") + b"\x0c"), (b"\x00\x01", "open"))
    fact(b, "CANCEL_WAIT with no wait pending answers 1", talk(p, HELLO + b"\x0c"), (b"\x01", "open"))
    cs = b"\x00sentinel"
    fact(b, "COMPARE_SET(missing, S, S) answers S and creates nothing",
         talk(p, HELLO + b"\x02" + s_(b"/m") + s_(cs) + s_(cs) + b"\x05" + q(1) + s_(b"/m")), (s_(cs) + b"\x01", "open"))
    fact(b, "COMPARE_SET(present, S, S) answers the value unchanged",
         talk(p, HELLO + b"\x02" + s_(b"/k") + s_(cs) + s_(cs) + b"\x03" + s_(b"/k")), (s_(b"v") + s_(b"v"), "open"))
    fact(b, "COMPARE_SET(missing, '', d) sets d and answers d",
         talk(p, HELLO + b"\x02" + s_(b"/c") + s_(b"") + s_(b"d")), (s_(b"d"), "open"))
    fact(b, "COMPARE_SET(present, current, d) sets d and answers d",
         talk(p, HELLO + b"\x02" + s_(b"/c") + s_(b"d") + s_(b"e") + b"\x03" + s_(b"/c")), (s_(b"e") + s_(b"e"), "open"))
    fact(b, "APPEND to a missing key creates it; no reply",
         talk(p, HELLO + b"\x09" + s_(b"/ap") + s_(b"12") + b"\x09" + s_(b"/ap") + s_(b"34") + b"\x03" + s_(b"/ap")), (s_(b"1234"), "open"))
    fact(b, "MULTI_SET then MULTI_GET answers each value in order",
         talk(p, HELLO + b"\x0b" + q(2) + s_(b"/m1") + s_(b"a") + s_(b"/m2") + s_(b"bb") + b"\x0a" + q(2) + s_(b"/m2") + s_(b"/m1")),
         (s_(b"bb") + s_(b"a"), "open"))
    fact(b, "DELETE_KEY answers 1 then 0",
         talk(p, HELLO + b"\x08" + s_(b"/m1") + b"\x08" + s_(b"/m1")), (struct.pack("<q", 1) + struct.pack("<q", 0), "open"))
    fact(b, "an unknown query type closes the connection", talk(p, HELLO + b"\x7f")[1], "closed")
    fact(b, "a 2^40-byte key length closes the connection", talk(p, HELLO + b"\x03" + q(1 << 40) + b"/z")[1], "closed")
    got = talk(p, HELLO + b"\x03" + s_(b"/nothing"))
    fact(b, "GET of a missing key", got, (s_(b""), "open") if libuv else (b"", "closed"))
    got = talk(p, b"\x0d" + struct.pack("<I", 7))[1]
    fact(b, "requests before VALIDATE are not answered", got, "open" if libuv else "closed")


def client_facts():
    """What PyTorch's client sends, seen through a relay."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    seen = []

    def relay():
        c, _ = lst.accept()
        s = socket.create_connection(("127.0.0.1", server.port))

        def pump(a, b, tag):
            while True:
                d = a.recv(65536)
                if not d:
                    return
                seen.append((tag, d))
                b.sendall(d)
        threading.Thread(target=pump, args=(s, c, "S"), daemon=True).start()
        pump(c, s, "C")
    threading.Thread(target=relay, daemon=True).start()
    # The client's constructor holds the GIL while it talks, so it runs in a
    # child process and the relay here keeps pumping.
    code = ("import torch.distributed as d, datetime as t;"
            f"s=d.TCPStore('127.0.0.1',{lst.getsockname()[1]},1,False,t.timedelta(seconds=10));"
            "s.set('k','v'); s.get('k')")
    subprocess.run([sys.executable, "-c", code], check=True)
    time.sleep(0.2)
    sent = b"".join(d for tag, d in seen if tag == "C")
    fact("client", "opens with VALIDATE(magic) then PING(u32)", (sent[:5], sent[5]), (HELLO, 0x0D))
    rest = sent[10:]
    fact("client", "world_size given: ADD 'init/' 1 without the '/' prefix", rest[:22], b"\x04" + s_(b"init/") + struct.pack("<q", 1))
    rest = rest[22:]
    fact("client", "user keys get the '/' prefix; get() is WAIT then GET",
         rest, b"\x01" + s_(b"/k") + s_(b"v") + b"\x06" + q(1) + s_(b"/k") + b"\x03" + s_(b"/k"))


print("torch", torch.__version__)
server_facts(True)
server_facts(False)
client_facts()
sys.exit(1 if failures else 0)
