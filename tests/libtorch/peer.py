"""The Python side of tests/libtorch: stock PyTorch only (no package of
ours), talking to the C++ test program over stdin/stdout lines and, for
descriptors, an inherited Unix socket.

    python peer.py MODE [SOCKET_FD]

Every message is one line of space-separated key=value words; lists are
comma-separated. The shared tensor is always the same recipe on both
sides: a 6x10 `arange` of the given dtype, and its view [1:5, 2:8:2]
(storage offset 12, sizes 4,3, strides 10,2); the receiver rebuilds the
view from the sent offset/sizes/strides and compares it with its own
copy of the recipe, then writes 1000 at [0, 0] for the sender to see.
"""
import os
import socket
import sys

import torch
import torch.multiprocessing as mp
from torch.multiprocessing import reductions


def recipe(dtype):
    full = torch.arange(60).to(dtype).reshape(6, 10)
    return full, full[1:5, 2:8:2]


def say(**words):
    print(" ".join(f"{k}={v}" for k, v in words.items()), flush=True)


def hear():
    line = sys.stdin.readline()
    if not line:
        sys.exit("peer: the C++ side closed its pipe")
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def ints(text):
    return [int(x) for x in text.split(",")] if text else []


def view_words(t):
    return dict(
        dtype=str(t.dtype).removeprefix("torch."),
        offset=t.storage_offset(),
        sizes=",".join(map(str, t.size())),
        strides=",".join(map(str, t.stride())),
    )


def check_and_touch(storage, msg):
    """Rebuilds the view over `storage` (an UntypedStorage), checks it and writes 1000 at [0, 0]."""
    dtype = getattr(torch, msg["dtype"])
    t = torch.empty(0, dtype=dtype).set_(storage, int(msg["offset"]), ints(msg["sizes"]), ints(msg["strides"]))
    _, expected = recipe(dtype)
    if not torch.equal(t, expected):
        say(status="mismatch", got=t.flatten().tolist())
        sys.exit(1)
    t[0, 0] = 1000
    return t


def from_cpp_filename():
    msg = hear()
    s = torch.UntypedStorage._new_shared_filename_cpu(msg["manager"].encode(), msg["name"].encode(), int(msg["nbytes"]))
    s._shared_decref()  # cancels the sender's reference in flight
    check_and_touch(s, msg)
    say(status="ok", nbytes=s.nbytes(), is_shared=int(s.is_shared()))
    hear()  # until told to go; then the storage is released as Python exits


def to_cpp_filename(dtype):
    torch.multiprocessing.set_sharing_strategy("file_system")
    full, view = recipe(getattr(torch, dtype))
    s = full.untyped_storage()
    manager, name, nbytes = s._share_filename_cpu_()
    s._shared_incref()  # the reference in flight, as reductions.reduce_storage takes it
    say(manager=manager.decode(), name=name.decode(), nbytes=nbytes, **view_words(view))
    hear()  # the C++ side has opened it and written 1000 at the view's [0, 0]
    say(status="ok" if full[1, 2].item() == 1000 else f"not-seen:{full[1, 2].item()}")
    hear()


def from_cpp_fd(sock):
    msg_bytes, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    msg = dict(w.split("=", 1) for w in msg_bytes.decode().split())
    s = torch.UntypedStorage._new_shared_fd_cpu(fds[0], int(msg["nbytes"]))
    os.close(fds[0])  # _new_shared_fd_cpu mapped a duplicate
    check_and_touch(s, msg)
    say(status="ok", nbytes=s.nbytes())
    hear()


def to_cpp_fd(sock, dtype):
    full, view = recipe(getattr(torch, dtype))
    s = full.untyped_storage()
    fd, nbytes = s._share_fd_cpu_()
    words = dict(nbytes=nbytes, **view_words(view))
    socket.send_fds(sock, [" ".join(f"{k}={v}" for k, v in words.items()).encode()], [fd])
    hear()
    say(status="ok" if full[1, 2].item() == 1000 else f"not-seen:{full[1, 2].item()}")
    hear()


def consume(queue, results):
    t = queue.get()  # rebuilt by torch.multiprocessing's own reductions
    results.put((str(t.dtype), t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.float().sum().item()))
    t[0, 0] = 1000
    results.put("written")


def queue_consumer():
    """Rebuilds the C++ tensor with reductions.rebuild_storage_filename /
    rebuild_tensor (what unpickling does), then puts it on a
    torch.multiprocessing.Queue: a forked consumer gets it through
    ForkingPickler (reduce_tensor -> _share_filename_cpu_ of our managed
    segment) and rebuilds it again."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    msg = hear()
    dtype = getattr(torch, msg["dtype"])
    numel = int(msg["nbytes"]) // torch.empty(0, dtype=dtype).element_size()
    storage = reductions.rebuild_storage_filename(torch.TypedStorage, msg["manager"].encode(), msg["name"].encode(), numel, dtype)
    t = reductions.rebuild_tensor(torch.Tensor, storage, (int(msg["offset"]), tuple(ints(msg["sizes"])), tuple(ints(msg["strides"])), False))
    _, expected = recipe(dtype)
    if not torch.equal(t, expected):
        say(status="mismatch-in-parent")
        sys.exit(1)
    ctx = mp.get_context("fork")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=consume, args=(queue, results))
    child.start()
    queue.put(t)
    got = results.get(timeout=60)
    want = (str(dtype), t.storage_offset(), tuple(t.size()), tuple(t.stride()), expected.float().sum().item())
    written = results.get(timeout=60)
    child.join(60)
    ok = got == want and written == "written" and child.exitcode == 0 and t[0, 0].item() == 1000
    say(status="ok" if ok else "mismatch", got=repr(got).replace(" ", ""), want=repr(want).replace(" ", ""))
    hear()


def hold_filename():
    """Opens a tensor shared by name and holds it until killed."""
    msg = hear()
    s = torch.UntypedStorage._new_shared_filename_cpu(msg["manager"].encode(), msg["name"].encode(), int(msg["nbytes"]))
    s._shared_decref()
    check_and_touch(s, msg)
    say(status="held")
    hear()


def share_and_hold(dtype):
    """Shares a tensor by name (PyTorch's own manager) and holds it until killed."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    full, view = recipe(getattr(torch, dtype))
    s = full.untyped_storage()
    manager, name, nbytes = s._share_filename_cpu_()
    s._shared_incref()
    say(manager=manager.decode(), name=name.decode(), nbytes=nbytes, **view_words(view))
    hear()


def empty_storages():
    """What PyTorch gives for empty storages, then opens the C++ side's
    empty storage shared by name."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    fd, fd_nbytes = torch.UntypedStorage(0)._share_fd_cpu_()
    kept = torch.UntypedStorage(0)
    manager, name, nbytes = kept._share_filename_cpu_()
    say(fd=fd, fd_nbytes=fd_nbytes, manager=manager.decode(), name=name.decode(), nbytes=nbytes)
    msg = hear()
    s = torch.UntypedStorage._new_shared_filename_cpu(msg["manager"].encode(), msg["name"].encode(), int(msg["nbytes"]))
    say(status="ok", nbytes=s.nbytes())
    hear()


def main():
    mode = sys.argv[1]
    sock = socket.socket(fileno=int(sys.argv[2])) if len(sys.argv) > 2 and sys.argv[2].isdigit() else None
    if mode == "from-cpp-filename":
        from_cpp_filename()
    elif mode == "to-cpp-filename":
        to_cpp_filename(sys.argv[2])
    elif mode == "from-cpp-fd":
        from_cpp_fd(sock)
    elif mode == "to-cpp-fd":
        to_cpp_fd(sock, sys.argv[3])
    elif mode == "queue-consumer":
        queue_consumer()
    elif mode == "hold-filename":
        hold_filename()
    elif mode == "share-and-hold":
        share_and_hold(sys.argv[2])
    elif mode == "empty-storages":
        empty_storages()
    else:
        sys.exit(f"peer: unknown mode {mode}")


if __name__ == "__main__":
    main()
