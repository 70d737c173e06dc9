"""The arena fd server against other local processes.

Its abstract socket name has no permissions: once the producer's server is
gone, any process may bind the name and answer the consumers that still
ask there. A consumer takes a descriptor only from the producer process
its handle names, running as its own user, and maps it only sealed against
shrinking. A silent connection delays no other consumer.
"""

import fcntl
import os
import pickle
import socket
import time

import pytest

import storage_sharing as ss
from storage_sharing import _native

FORGED = b"STRANGER"


def _read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _gone_producer():
    """A producer (forked child) shares a block, hands over its handle, its
    fd server's name and a copy of the block's segment, then exits: its
    server is gone. The copy's hold slot still has the handle in flight, so
    a forger's memfd made from it opens as the real segment would."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            arena = ss.Arena(segment_size=1 << 20)
            block = arena.alloc(4096)
            block.memoryview()[:8] = b"GENUINE!"
            h = block.share()
            address = arena.fd_server_address()
            fd = arena.segment_fd(h.segment_id)
            segment = os.pread(fd, os.fstat(fd).st_size, 0)
            os.write(w, pickle.dumps((bytes(h), address, segment)))
            os.close(w)
            arena.close()
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    raw, address, segment = pickle.loads(_read_all(r))
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return ss.Handle.from_bytes(raw), address, segment


def _producer_start(h):
    """The producer's start tick a handle records (bytes 16..24)."""
    return int.from_bytes(bytes(h)[16:24], "little")


def _now_tick():
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _fork_at(pid, after_tick):
    """os.fork() with the child at `pid` (free now), steering the kernel's
    next pid through /proc/sys/kernel/ns_last_pid (root only); other
    processes fork too, so it tries again until the child has it. Waits
    first until the clock passed `after_tick` (the start tick of the pid's
    last process: start times count 10 ms ticks, and an attacker without
    root needs far longer to get a pid again). Returns what os.fork()
    does, or skips the test where the pid cannot be chosen."""
    while _now_tick() <= after_tick + 1:
        time.sleep(0.005)
    for _ in range(2000):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError as e:
            pytest.skip(f"cannot choose a pid here (/proc/sys/kernel/ns_last_pid: {e})")
        child = os.fork()
        if child == 0:
            if os.getpid() != pid:
                os._exit(0)
            return 0
        if child == pid:
            return child
        os.waitpid(child, 0)
    pytest.fail(f"pid {pid} kept going to other processes")


def _send_forged_segment(conn, forged):
    conn.recv(8)
    mfd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(mfd, forged)
    fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    socket.send_fds(conn, [b"\0"], [mfd])


def _stranger(address, forged, as_nobody, at_pid=None, answer=None, after_tick=0):
    """A forked child that binds `address` (as uid 65534 if `as_nobody`,
    as process `at_pid` if given) and answers a request with `answer(conn)`,
    by default a memfd of its own holding `forged`, sealed against
    shrinking (so only the peer check can refuse it). Returns its pid once
    it listens."""
    r, w = os.pipe()
    pid = os.fork() if at_pid is None else _fork_at(at_pid, after_tick)
    if pid == 0:
        code = 1
        try:
            os.close(r)
            if as_nobody:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            deadline = time.monotonic() + 30
            while True:
                try:
                    srv.bind("\0" + address)
                    break
                except OSError:
                    # The producer's listener may still be closing.
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            srv.listen(4)
            os.write(w, b"r")
            srv.settimeout(30)
            conn, _ = srv.accept()
            conn.settimeout(30)
            (answer or (lambda c: _send_forged_segment(c, forged)))(conn)
            conn.recv(1)  # until the consumer hangs up
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"r", "the stranger could not bind the name"
    os.close(r)
    return pid


def _forged_answer_is_refused(as_nobody, at_producers_pid=False):
    h, address, segment = _gone_producer()
    forged = bytearray(segment)
    forged[h.offset : h.offset + len(FORGED)] = FORGED
    at_pid = h.producer_pid if at_producers_pid else None
    stranger = _stranger(address, bytes(forged), as_nobody, at_pid, after_tick=_producer_start(h))
    cached = ss.remote_cache_size()
    try:
        with pytest.raises(PermissionError) as e:
            v = ss.open_shared(h, address, timeout=30.0)
            pytest.fail(f"opened the stranger's block: {bytes(v.memoryview()[:8])!r}")
        why = "the pid was reused" if at_producers_pid else f"not to process {h.producer_pid}"
        assert why in str(e.value), str(e.value)
        assert not ss.has_segment(h), "the stranger's descriptor was mapped"
        assert ss.remote_cache_size() == cached
    finally:
        try:
            os.kill(stranger, 9)
        except ProcessLookupError:
            pass
        os.waitpid(stranger, 0)


def test_another_user_answering_at_a_gone_producers_name_is_refused():
    if os.geteuid() != 0:
        pytest.skip("needs root to play uid 65534")
    _forged_answer_is_refused(as_nobody=True)


def test_a_process_of_this_user_that_is_not_the_producer_is_refused():
    _forged_answer_is_refused(as_nobody=False)


def test_a_process_that_got_the_producers_pid_is_refused():
    # The producer exited; the next process to get its pid (same user,
    # so SO_PEERCRED's pid and uid match the handle) binds its server's
    # name. Only the start time tells it apart.
    if os.geteuid() != 0:
        pytest.skip("needs root to choose a pid (/proc/sys/kernel/ns_last_pid)")
    _forged_answer_is_refused(as_nobody=False, at_producers_pid=True)


def test_reshare_refuses_a_process_that_got_the_producers_pid():
    if os.geteuid() != 0:
        pytest.skip("needs root to choose a pid (/proc/sys/kernel/ns_last_pid)")
    # A producer shares a block; this process opens it, then the producer
    # exits. The process that gets its pid answers the reshare request
    # at the producer's name with a handle of its choosing.
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.close(go_w)
            arena = ss.Arena(segment_size=1 << 20)
            block = arena.alloc(4096)
            block.memoryview()[:8] = b"GENUINE!"
            os.write(w, pickle.dumps((bytes(block.share()), arena.fd_server_address())))
            os.close(w)
            os.read(go_r, 1)  # until the consumer has opened the block
            arena.close()
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    os.close(go_r)
    raw, address = pickle.loads(_read_all(r))
    os.close(r)
    h = ss.Handle.from_bytes(raw)
    view = ss.open_shared(h, address, timeout=30.0)
    assert bytes(view.memoryview()[:8]) == b"GENUINE!"
    os.write(go_w, b"x")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    def echo_the_held_handle(conn):
        request = b""
        while len(request) < 8 + len(raw):
            request += conn.recv(8 + len(raw) - len(request))
        conn.sendall(b"\0" + request[8:])

    stranger = _stranger(address, b"", False, at_pid=h.producer_pid, answer=echo_the_held_handle, after_tick=_producer_start(h))
    try:
        with pytest.raises(PermissionError) as e:
            made = _native.reshare(h, address, 30.0)
            pytest.fail(f"took a handle from the stranger: {made!r}")
        assert "the pid was reused" in str(e.value), str(e.value)
    finally:
        try:
            os.kill(stranger, 9)
        except ProcessLookupError:
            pass
        os.waitpid(stranger, 0)
        del view


def test_an_unsealed_segment_descriptor_is_refused():
    arena = ss.Arena(segment_size=1 << 20)
    h = arena.alloc(100).share()
    fd = arena.segment_fd(h.segment_id)
    copy = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.write(copy, os.pread(fd, os.fstat(fd).st_size, 0))
        with pytest.raises(PermissionError) as e:
            ss.import_segment_fd(h, copy)
        assert "not sealed against shrinking" in str(e.value)
        assert not ss.has_segment(h)
    finally:
        os.close(copy)
        arena.unshare(h)
        arena.close()


def test_a_silent_connection_delays_no_consumer():
    arena = ss.Arena()
    block = arena.alloc(5000)
    block.memoryview()[:5] = b"hello"
    h = block.share()
    address = arena.fd_server_address()
    silent = []
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + address)
        silent.append(s)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            v = ss.open_shared(h, address, timeout=3.0)
            code = 0 if bytes(v.memoryview()[:5]) == b"hello" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the consumer could not open the block beside silent connections"
    for s in silent:
        s.close()
    arena.close()


def _silent_connections(address, processes, per_process):
    """Forked children that each open `per_process` connections to the fd
    server at `address` and never send a word. Returns their pids once all
    are connected."""
    pids = []
    for _ in range(processes):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                conns = []
                for _ in range(per_process):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect("\0" + address)
                    conns.append(s)
                os.write(w, b"c")
                time.sleep(60)
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"c"
        os.close(r)
        pids.append(pid)
    return pids


def _consumer(h, address, timeout):
    """A forked consumer's outcome: "ok", or the class of its exception."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                v = ss.open_shared(h, address, timeout=timeout)
                said = "ok" if bytes(v.memoryview()[:5]) == b"hello" else "wrong bytes"
            except Exception as e:  # noqa: BLE001 - reported to the parent
                said = f"{type(e).__name__}: {e}"
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    said = _read_all(r).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return said


def _end(pids):
    for pid in pids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_silent_connections_never_make_a_live_producer_look_gone():
    # 64 silent connections of one process took every slot of the server,
    # and consumers failed at once with PeerGoneError though the producer
    # lived. Now one process gets a few slots, and a consumer whose
    # request finds no room hears "busy" and asks again until its timeout.
    arena = ss.Arena()
    block = arena.alloc(5000)
    block.memoryview()[:5] = b"hello"
    h = block.share()
    address = arena.fd_server_address()
    try:
        hog = _silent_connections(address, 1, 64)
        try:
            assert _consumer(h, address, 20.0) == "ok"
        finally:
            _end(hog)
        # Every slot taken by many processes: the answer is late or
        # "busy", never "gone".
        h = block.share()
        hogs = _silent_connections(address, 20, 4)
        try:
            said = _consumer(h, address, 0.2)
            assert said == "ok" or said.startswith("BusyError"), said
            if said != "ok":
                assert "is busy" in said and "lives" in said, said
                # The silent connections time out on the server's side,
                # and a consumer that waits long enough gets its answer.
                assert _consumer(h, address, 20.0) == "ok"
        finally:
            _end(hogs)
    finally:
        arena.close()
