"""Functions run in other processes by test_torch_semantics.py (importable
under spawn): a tensor received and sent on, share_memory_() on a received
tensor, processes that receive without enable()."""

import gc

import torch

WAIT = 60  # seconds: a hang guard only


def relay_b(from_a, to_c, b_wrote, c_wrote, out, finish, drop_after_send):
    """B: receives A's tensor, sends it on to C, writes element 2."""
    t = from_a.get(timeout=WAIT)
    if drop_after_send:
        t[2] = 200
        to_c.put(t)
        del t
        gc.collect()  # B lets go of its hold: C's share alone keeps the block
        b_wrote.set()
        out.put(("B", None, None))
    else:
        to_c.put(t)
        t[2] = 200
        b_wrote.set()
        assert c_wrote.wait(WAIT)
        out.put(("B", t.tolist(), t.is_shared()))
    finish.wait(WAIT)


def relay_c(from_b, b_wrote, c_wrote, out, finish, go):
    """C: receives from B (once `go` is set), writes element 1."""
    assert go.wait(WAIT)
    t = from_b.get(timeout=WAIT)
    t[1] = 300
    c_wrote.set()
    assert b_wrote.wait(WAIT)
    out.put(("C", t.tolist(), t.is_shared()))
    finish.wait(WAIT)


def share_memory_then_write(queue, done):
    """Receives a tensor, calls share_memory_() on it, then writes it."""
    t = queue.get(timeout=WAIT)
    before = t.data_ptr()
    t.share_memory_()
    t.untyped_storage().share_memory_()
    t.fill_(7)
    done.put(t.data_ptr() == before)


def report_received(queue, out):
    """Reports what arrived: shape, values, is_shared()."""
    t = queue.get(timeout=WAIT)
    out.put((tuple(t.shape), t.tolist(), t.is_shared()))


def enable_twice_before_any_arena(out):
    """A fresh process: enable() with some options, disable(), then other
    options (applied: no arena was made yet); then other options again
    while enabled (refused)."""
    import os

    import storage_sharing.torch as st

    st.enable(segment_size=64 << 20, large_threshold=1 << 20)
    st.disable()
    st.enable(segment_size=32 << 20, large_threshold=2 << 20)
    st.empty(10)  # the arena is made now, with the options in force
    applied = (st.process_arena().stats()["segment_bytes"], os.environ[st.ENV])
    try:
        st.enable(segment_size=16 << 20, large_threshold=1 << 20)
        refused = None
    except ValueError as e:
        refused = str(e)
    out.put((applied, refused, os.environ[st.ENV]))


def send_back(from_a, to_a, done):
    """Receives a tensor and sends it back to its sender (a new share that
    A, its producer, makes for this process), holding it until A has it."""
    t = from_a.get()
    to_a.put(t)
    done.wait(60)
