"""GPU tests of storage_sharing.cuda (weights pools shared whole), run by
run_gpu_tests.sh on a machine with a CUDA device:

    python3 cuda_weights_gpu.py [--device cuda:0] [--stock-opener PATH]
    python3 cuda_weights_gpu.py --device cpu   # the same script on the host backend

With --device cpu (no GPU needed) the tests that need CUDA (born in the
pool, the stock opener, device memory) are left out: that run checks the
script itself, and the pool through the host backend.

This process only directs: every party (producer, consumers, the stock
PyTorch consumer, the memory probe) is a child process of this script in a
role, talking one JSON object per line on its stdin/stdout, so any of them
can be killed with -9. Each test prints "ok - NAME" or "FAIL - NAME: why";
the last line is "cuda_weights_gpu: N passed, M failed" (exit 1 on a
failure). Afterwards the device's free memory must be back where it was
and /dev/shm must hold nothing new of ours.
"""

import argparse
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("vmm", "legacy")
READ_TIMEOUT = 120  # seconds a child may take to answer (a hang guard only)


# ---- roles (child processes) ----


def say(**words):
    print(json.dumps(words), flush=True)


def hear():
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the director is gone
    return json.loads(line)


def build_model(device):
    """A small transformer-like stack, the same in every process (seeded)."""
    import torch
    from torch import nn

    torch.manual_seed(1234)
    layers = []
    for _ in range(4):
        layers += [nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)]
    model = nn.Sequential(nn.Embedding(1000, 256), *layers, nn.Linear(256, 1000))
    return model.to(device=device, dtype=torch.bfloat16) if device is not None else model.to(torch.bfloat16)


def model_input(device):
    import torch

    return torch.arange(64, device=device).remainder(1000).reshape(4, 16)


def role_producer(device, kind, born, workdir):
    """Builds the model into a pool (born in it, or copied in), exports it,
    writes the handle (and the stock descriptor for legacy) and the
    expected forward output, then serves commands."""
    import torch
    from storage_sharing.cuda import Pool

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if born:
        pool = Pool(device=device, kind=kind)
        with pool.allocating():
            model = build_model(device)
        pool.add_state_dict(model.state_dict())
    else:
        model = build_model(device)
        pool = Pool.from_state_dict(model.state_dict(), kind=kind)
        # From here the model reads the pool's copy: the updates below must
        # reach what the consumers read.
        model.load_state_dict(pool.state_dict(), assign=True)
    handle = pool.export()
    with torch.no_grad():
        expected = model(model_input(device)).float().cpu()
    paths = {"handle": os.path.join(workdir, f"handle-{os.getpid()}.pkl"),
             "expected": os.path.join(workdir, f"expected-{os.getpid()}.pt")}
    with open(paths["handle"], "wb") as f:
        pickle.dump(handle, f)
    torch.save(expected, paths["expected"])
    if kind == "legacy" and device.type == "cuda":
        paths["stock"] = os.path.join(workdir, f"stock-{os.getpid()}.pkl")
        with open(paths["stock"], "wb") as f:
            pickle.dump(pool.stock_descriptor(), f)
        paths["sums"] = {n: float(t.double().sum()) for n, t in pool.state_dict().items()}
    say(ready=True, pid=os.getpid(), tensors=len(pool.state_dict()), segments=len(pool.segments()), **paths)
    while True:
        cmd = hear()
        if cmd["op"] == "update":
            # Every tensor holds the new version's number: a reader that saw
            # two versions at once would see two values.
            try:
                with pool.update(timeout=cmd.get("timeout")) as tensors:
                    value = pool.version + 1
                    for t in tensors.values():
                        t.fill_(value)
                say(version=pool.version, value=value)
            except Exception as e:  # reported, not fatal: the test decides
                say(error=type(e).__name__, message=str(e))
        elif cmd["op"] == "updates":
            for _ in range(cmd["count"]):
                with pool.update(timeout=60) as tensors:
                    value = pool.version + 1
                    for t in tensors.values():
                        t.fill_(value)
            say(version=pool.version)
        elif cmd["op"] == "consumers":
            say(consumers=pool.consumers)
        elif cmd["op"] == "quit":
            del model
            say(bye=True)
            return


def role_consumer(handle_path, expected_path):
    """Opens the weights and serves checks on them."""
    import torch
    from storage_sharing import PeerGoneError
    from storage_sharing.cuda import open_weights

    with open(handle_path, "rb") as f:
        handle = pickle.load(f)
    weights = open_weights(handle, timeout=60)
    say(opened=True, pid=os.getpid(), tensors=len(weights))
    while True:
        cmd = hear()
        op = cmd["op"]
        if op == "forward":
            # The consumer's own module, on meta (no memory), takes the views.
            with torch.device("meta"):
                model = build_model(None)
            model.load_state_dict(dict(weights), assign=True)
            with weights.reading() as version, torch.no_grad():
                got = model(model_input(handle.device)).float().cpu()
                ptrs_shared = all(p.data_ptr() == weights[n].data_ptr() for n, p in model.state_dict().items())
            expected = torch.load(expected_path)
            say(version=version, equal=bool(torch.equal(got, expected)),
                max_diff=float((got - expected).abs().max()), no_copy=ptrs_shared)
        elif op == "read-until":
            # Reads every tensor under a guard until the wanted version;
            # each read must see one value everywhere (the version's).
            reads, torn, seen, last = 0, 0, set(), 0
            deadline = time.monotonic() + cmd.get("seconds", 90)
            while last < cmd["version"] and time.monotonic() < deadline:
                with weights.reading(timeout=60) as version:
                    lo = torch.stack([t.min().float() for t in weights.values()]).min().item()
                    hi = torch.stack([t.max().float() for t in weights.values()]).max().item()
                reads += 1
                last = version
                if version > 1:  # version 1 is the model itself
                    seen.add(version)
                    if lo != hi or lo != float(version):
                        torn += 1
            say(reads=reads, torn=torn, versions=len(seen), last=last)
        elif op == "hold":
            weights.acquire(timeout=60)
            say(holding=True)
        elif op == "release":
            weights.release()
            say(released=True)
        elif op == "acquire":
            try:
                with weights.reading(timeout=cmd.get("timeout", 30)) as version:
                    say(version=version)
            except PeerGoneError as e:
                say(peer_gone=True, message=str(e))
            except Exception as e:
                say(error=type(e).__name__, message=str(e))
        elif op == "sum":
            with weights.reading(timeout=30):
                say(sums={n: float(t.double().sum()) for n, t in weights.items()})
        elif op == "quit":
            weights.close()
            say(bye=True)
            return


def role_meminfo(device):
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    say(free=free, total=total)


# ---- the director ----


class Child:
    def __init__(self, args, env=None):
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)

    def send(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout=READ_TIMEOUT):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill9()
            raise AssertionError(f"child {self.proc.args[1:3]} gave no answer; stderr:\n{self.stderr()}")
        return json.loads(line)

    def ask(self, **cmd):
        self.send(**cmd)
        return self.recv()

    def stderr(self):
        try:
            return self.proc.stderr.read()[-4000:]
        except Exception:
            return ""

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def quit(self):
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (AssertionError, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill9()


class Director:
    def __init__(self, device, workdir, stock_opener):
        self.device, self.workdir, self.stock_opener = device, workdir, stock_opener
        self.children = []

    def spawn(self, *role_args, env=None):
        c = Child([__file__, "--role", *role_args], env=env)
        self.children.append(c)
        return c

    def producer(self, kind, born=False):
        p = self.spawn("producer", self.device, kind, "born" if born else "copied", self.workdir)
        info = p.recv()
        assert info.get("ready"), info
        return p, info

    def consumer(self, info):
        c = self.spawn("consumer", info["handle"], info["expected"])
        opened = c.recv()
        assert opened.get("opened") and opened["tensors"] == info["tensors"], opened
        return c

    def free_memory(self):
        if not self.device.startswith("cuda"):
            return 0  # the host backend: only /dev/shm is checked
        return self.spawn("meminfo", self.device).recv()["free"]

    def end_all(self):
        for c in reversed(self.children):
            c.quit()
        self.children.clear()


def shm_ours():
    return {n for n in os.listdir("/dev/shm") if n.startswith(("ss_", "torch_"))}


# ---- the tests ----


def wait_consumers(producer, n, seconds=30):
    """The producer counts n live consumer connections (it sees a hang-up
    on its server thread, so give it a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        got = producer.ask(op="consumers")["consumers"]
        if got == n or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == n, f"the producer counts {got} consumers, expected {n}"


def test_processes_forward(d, kind, n_consumers, born):
    """n_consumers processes open the pool; load_state_dict(assign=True) and
    a forward pass equal to the producer's, reading the pool in place."""
    p, info = d.producer(kind, born=born)
    consumers = [d.consumer(info) for _ in range(n_consumers)]
    wait_consumers(p, n_consumers)
    for c in consumers:
        r = c.ask(op="forward")
        assert r["version"] == 1, r
        assert r["no_copy"], f"load_state_dict(assign=True) copied: {r}"
        # The same kernels on the same bytes: bitwise equal is expected; a
        # differing cuBLAS choice could give bf16 rounding, never more.
        assert r["equal"] or r["max_diff"] <= 1e-2, f"the consumer's forward differs by {r['max_diff']}"
        if not r["equal"]:
            print(f"   note: forward equal within {r['max_diff']}, not bitwise")
    d.end_all()


def test_stock_opener(d):
    """A process with stock PyTorch only (storage_sharing not importable)
    opens a legacy pool with examples/python/open_with_stock_pytorch.py."""
    p, info = d.producer("legacy")
    env = dict(os.environ)
    env["PYTHONPATH"] = ""  # storage_sharing is staged on PYTHONPATH: hide it
    out = subprocess.run([sys.executable, "-c",
                          "import sys, runpy; sys.modules['storage_sharing'] = None;"
                          f"sys.argv = ['opener', {info['stock']!r}];"
                          f"runpy.run_path({d.stock_opener!r}, run_name='__main__')"],
                         capture_output=True, text=True, env=env, timeout=READ_TIMEOUT)
    assert out.returncode == 0, f"the stock opener failed:\n{out.stderr[-3000:]}"
    got = {}
    for line in out.stdout.splitlines():
        name, *_, total = line.split()
        got[name] = float(total)
    assert got.keys() == info["sums"].keys(), f"names differ: {sorted(set(got) ^ set(info['sums']))}"
    bad = [n for n, v in info["sums"].items() if abs(got[n] - v) > 1e-3 * max(1.0, abs(v))]
    assert not bad, f"the stock opener read other values for {bad}"
    d.end_all()


def test_updates_while_reading(d, kind, n_consumers=4, updates=40):
    """Consumers read every tensor under guards while the producer
    publishes `updates` versions: no read sees two versions."""
    p, info = d.producer(kind)
    consumers = [d.consumer(info) for _ in range(n_consumers)]
    target = 1 + updates
    for c in consumers:
        c.send(op="read-until", version=target)
    done = p.ask(op="updates", count=updates)
    assert done["version"] == target, done
    for c in consumers:
        r = c.recv()
        assert r["torn"] == 0, f"{r['torn']} torn reads of {r['reads']}"
        assert r["last"] == target, r
    d.end_all()


def test_update_waits_for_reader(d, kind):
    p, info = d.producer(kind)
    c = d.consumer(info)
    assert c.ask(op="hold").get("holding")
    r = p.ask(op="update", timeout=0.5)
    assert r.get("error") == "WaitTimeoutError", f"an update under a held version: {r}"
    assert c.ask(op="release").get("released")
    r = p.ask(op="update", timeout=30)
    assert r.get("version") == 2, r
    d.end_all()


def test_kill_consumer(d, kind):
    """A consumer killed with -9 while holding a version gives it up: the
    producer's next update goes through."""
    p, info = d.producer(kind)
    c = d.consumer(info)
    other = d.consumer(info)
    assert c.ask(op="hold").get("holding")
    c.kill9()
    r = p.ask(op="update", timeout=30)
    assert r.get("version") == 2, f"the update after the holder died: {r}"
    wait_consumers(p, 1)
    assert other.ask(op="acquire")["version"] == 2
    d.end_all()


def test_kill_producer(d, kind):
    """A producer killed with -9 is reported at the consumer's next call
    (PeerGoneError), never garbage; its memory goes once the consumer closes."""
    p, info = d.producer(kind)
    c = d.consumer(info)
    assert c.ask(op="acquire")["version"] == 1
    p.kill9()
    r = c.ask(op="acquire", timeout=10)
    assert r.get("peer_gone"), f"after the producer died: {r}"
    assert str(info["pid"]) in r["message"], f"the error does not name the producer: {r['message']}"
    d.end_all()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--stock-opener", default=os.path.join(HERE, "open_with_stock_pytorch.py"))
    ap.add_argument("-k", dest="only", default="", help="run only the tests whose name contains this")
    ap.add_argument("--role", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.role:
        role, *rest = args.role
        {"producer": lambda dev, kind, born, wd: role_producer(dev, kind, born == "born", wd),
         "consumer": role_consumer, "meminfo": role_meminfo}[role](*rest)
        return

    signal.alarm(540)  # a hang guard only
    with tempfile.TemporaryDirectory(prefix="ss-cuda-weights-gpu-") as workdir:
        d = Director(args.device, workdir, args.stock_opener)
        shm_before = shm_ours()
        free_before = d.free_memory()
        cuda = args.device.startswith("cuda")
        tests = []
        for kind in KINDS:
            tests += [
                (f"two processes, load_state_dict(assign=True), forward equal ({kind}, copied in)",
                 lambda kind=kind: test_processes_forward(d, kind, 1, born=False)),
                (f"four processes, forward equal ({kind}, {'born in the pool' if cuda else 'copied in'})",
                 lambda kind=kind: test_processes_forward(d, kind, 3, born=cuda)),
                (f"updates while four consumers read: no torn read ({kind})",
                 lambda kind=kind: test_updates_while_reading(d, kind)),
                (f"an update waits for a held version ({kind})", lambda kind=kind: test_update_waits_for_reader(d, kind)),
                (f"kill -9 of a consumer holding a version ({kind})", lambda kind=kind: test_kill_consumer(d, kind)),
                (f"kill -9 of the producer: PeerGoneError ({kind})", lambda kind=kind: test_kill_producer(d, kind)),
            ]
        if cuda:
            tests.append(("the stock-PyTorch opener (legacy)", lambda: test_stock_opener(d)))
        tests = [(name, fn) for name, fn in tests if args.only in name]
        passed = failed = 0
        for name, fn in tests:
            t0 = time.monotonic()
            try:
                fn()
                print(f"ok - {name} ({time.monotonic() - t0:.1f} s)", flush=True)
                passed += 1
            except Exception as e:
                print(f"FAIL - {name}: {e}", flush=True)
                traceback.print_exc()
                failed += 1
            finally:
                for c in d.children:
                    c.kill9()
                d.children.clear()

        # Nothing left: device memory back (within 64 MiB: the driver's own
        # bookkeeping), no new /dev/shm names of ours (given a moment for
        # the last exits).
        deadline = time.monotonic() + 15
        while True:
            free_after = d.free_memory()
            lost = free_before - free_after
            leftover = shm_ours() - shm_before
            if (lost <= 64 << 20 and not leftover) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        d.end_all()
        name = "afterwards: device memory returned and /dev/shm clean"
        if lost <= 64 << 20 and not leftover:
            print(f"ok - {name} (free before {free_before >> 20} MiB, after {free_after >> 20} MiB)")
            passed += 1
        else:
            print(f"FAIL - {name}: {lost >> 20} MiB not returned; left in /dev/shm: {sorted(leftover)}")
            failed += 1
    print(f"cuda_weights_gpu: {passed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
