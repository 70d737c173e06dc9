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


def _stranger(address, forged, as_nobody):
    """A forked child that binds `address` (as uid 65534 if `as_nobody`)
    and answers every request with a memfd of its own holding `forged`,
    sealed against shrinking (so only the peer check can refuse it).
    Returns its pid once it listens."""
    r, w = os.pipe()
    pid = os.fork()
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
            conn.recv(8)
            mfd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(mfd, forged)
            fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            socket.send_fds(conn, [b"\0"], [mfd])
            conn.recv(1)  # until the consumer hangs up
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"r", "the stranger could not bind the name"
    os.close(r)
    return pid


def _forged_answer_is_refused(as_nobody):
    h, address, segment = _gone_producer()
    forged = bytearray(segment)
    forged[h.offset : h.offset + len(FORGED)] = FORGED
    stranger = _stranger(address, bytes(forged), as_nobody)
    cached = ss.remote_cache_size()
    try:
        with pytest.raises(PermissionError) as e:
            v = ss.open_shared(h, address, timeout=30.0)
            pytest.fail(f"opened the stranger's block: {bytes(v.memoryview()[:8])!r}")
        assert f"not to process {h.producer_pid}" in str(e.value), str(e.value)
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
