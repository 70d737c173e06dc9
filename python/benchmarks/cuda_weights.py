"""A model's weights shared between processes, four ways side by side.

    python python/benchmarks/cuda_weights.py                    # GPU: 1.5B, and 8B if memory allows
    python python/benchmarks/cuda_weights.py --models 1.5b --iters 3
    python python/benchmarks/cuda_weights.py --device cpu       # host backend smoke run (tiny model)

The state dict is shaped like a decoder-only transformer in bf16: "1.5b"
(28 layers, hidden 1536, ~340 tensors, ~3.1 GB), "8b" (32 layers, hidden
4096, ~290 tensors, ~16 GB), "tiny" (the CPU smoke size). The ways:

  (a) per tensor   torch.multiprocessing.reductions.reduce_tensor per
                   tensor, pickled; the consumer unpickles (one
                   rebuild_cuda_tensor, one IPC open, per tensor)
  (b) bucket       torch.cat of every tensor into one buffer, one handle;
                   the consumer copies each tensor out of it
  (c) ours, born   the model is created inside pool.allocating(), so its
                   parameters are the pool; export; open_weights
  (d) ours, copied Pool.from_state_dict copies the model in once; export;
                   open_weights (vmm and legacy kinds)

Columns:
  export ms     the producer's work to make the model shareable and the
                message (for (b) and (d) the copy into the bucket/pool)
  open ms       in a fresh consumer process (torch and CUDA already up):
                message to usable tensors, copy-out included for (b)
  update ms     writing a new version of every tensor where the consumer
                reads it: copy_ per tensor ((a), and ours inside
                pool.update()), or cat into the bucket plus the copy-out ((b))
  GB/s, % floor the update's model bytes per second, and that against one
                device-to-device copy of the same bytes (the memcpy floor)
  publish ms    ours: an update that writes nothing (begin_update +
                publish), what a trainer whose optimizer writes the pool in
                place pays per version
  extra MiB     device memory beyond the model itself, producer and consumer
                together (from torch.cuda.mem_get_info; CPU: not measured)
  handles       handles in the message; fds: descriptors the consumer holds
                after opening (/proc/self/fd)

Every consumer checks a checksum of three tensors against the producer's.
"""

import argparse
import gc
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing  # registers PyTorch's reductions with ForkingPickler
from multiprocessing.reduction import ForkingPickler

MODELS = {
    # hidden, layers, intermediate, vocab, kv dim, q/k/v biases, tied embeddings
    "tiny": dict(hidden=256, layers=4, inter=688, vocab=8192, kv=64, bias=True, tied=True),
    "1.5b": dict(hidden=1536, layers=28, inter=8960, vocab=151936, kv=256, bias=True, tied=True),
    "8b": dict(hidden=4096, layers=32, inter=14336, vocab=128256, kv=1024, bias=False, tied=False),
}
DTYPE = torch.bfloat16


def model_shapes(cfg):
    h, kv, ff = cfg["hidden"], cfg["kv"], cfg["inter"]
    yield "model.embed_tokens.weight", (cfg["vocab"], h)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        for proj, out in (("q", h), ("k", kv), ("v", kv)):
            yield f"{p}self_attn.{proj}_proj.weight", (out, h)
            if cfg["bias"]:
                yield f"{p}self_attn.{proj}_proj.bias", (out,)
        yield f"{p}self_attn.o_proj.weight", (h, h)
        yield f"{p}mlp.gate_proj.weight", (ff, h)
        yield f"{p}mlp.up_proj.weight", (ff, h)
        yield f"{p}mlp.down_proj.weight", (h, ff)
        yield f"{p}input_layernorm.weight", (h,)
        yield f"{p}post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not cfg["tied"]:
        yield "lm_head.weight", (cfg["vocab"], h)


def model_bytes(cfg):
    total = 0
    for _, shape in model_shapes(cfg):
        n = 1
        for s in shape:
            n *= s
        total += n * DTYPE.itemsize
    return total


def make_state_dict(cfg, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(DTYPE)
            if device.type == "cpu" else torch.randn(shape, generator=g, device=device, dtype=DTYPE)
            for name, shape in model_shapes(cfg)}


def checksum(sd):
    """Sums of three tensors (first, middle, last) in float64."""
    names = list(sd)
    picks = [names[0], names[len(names) // 2], names[-1]]
    return {n: float(sd[n].double().sum()) for n in picks}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes(device):
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def median_time(fn, iters, device):
    fn()
    sync(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


# ---- the consumer: a fresh process per way ----


def consumer_main(way, message_path, device_name):
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the context, outside the timing
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
    if way.startswith("ours"):
        from storage_sharing.cuda import open_weights
    with open(message_path, "rb") as f:
        message = f.read()
    fds0, free0 = len(os.listdir("/proc/self/fd")), free_bytes(device)
    t0 = time.perf_counter()
    keep = None
    if way == "per-tensor":
        sd = pickle.loads(message)
    elif way == "bucket":
        layout, bucket = pickle.loads(message)
        sd = {name: bucket[off:off + n].view(shape).clone() for name, off, n, shape in layout}
    else:
        keep = open_weights(pickle.loads(message), timeout=60)
        sd = dict(keep.items())
    sync(device)
    open_s = time.perf_counter() - t0
    fds1, free1 = len(os.listdir("/proc/self/fd")), free_bytes(device)
    if keep is not None:
        with keep.reading():
            sums = checksum(sd)
    else:
        sums = checksum(sd)
    print(repr(dict(open_ms=open_s * 1e3, extra=free0 - free1, fds=fds1 - fds0, sums=sums)), flush=True)
    del sd
    if keep is not None:
        keep.close()


def run_consumer(way, message, device):
    with tempfile.NamedTemporaryFile(prefix="ss-bench-weights-", suffix=".msg") as f:
        f.write(message)
        f.flush()
        out = subprocess.run([sys.executable, __file__, "--consumer", way, f.name, str(device)],
                             capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the {way} consumer failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return eval(out.stdout.strip().splitlines()[-1], {})  # a dict literal of numbers and names


# ---- the producer: one way at a time ----


def sent_as_queue_sends(obj):
    """The bytes a torch.multiprocessing queue sends: ForkingPickler with
    PyTorch's reductions (reduce_tensor for every tensor, reduce_storage
    for every storage)."""
    return bytes(ForkingPickler.dumps(obj))


def way_per_tensor(cfg, device, iters):
    free0 = free_bytes(device)
    sd = make_state_dict(cfg, device, 1)
    sync(device)
    t0 = time.perf_counter()
    message = sent_as_queue_sends(sd)
    export_s = time.perf_counter() - t0
    extra = free0 - free_bytes(device) - model_bytes(cfg)
    new = make_state_dict(cfg, device, 2)

    def update():
        for name, t in sd.items():
            t.copy_(new[name])

    update_s = median_time(update, iters, device)
    # The consumer opens version 2 (what the producer holds after the updates).
    want = checksum(new)
    return dict(export_s=export_s, update_s=update_s, extra=extra, handles=len(sd), message=message, want=want,
                keep=sd)


def way_bucket(cfg, device, iters):
    free0 = free_bytes(device)
    sd = make_state_dict(cfg, device, 1)
    sync(device)
    t0 = time.perf_counter()
    bucket = torch.cat([t.reshape(-1) for t in sd.values()])
    layout, off = [], 0
    for name, t in sd.items():
        layout.append((name, off, t.numel(), tuple(t.shape)))
        off += t.numel()
    message = sent_as_queue_sends((layout, bucket))
    sync(device)
    export_s = time.perf_counter() - t0
    extra = free0 - free_bytes(device) - model_bytes(cfg)
    new = make_state_dict(cfg, device, 2)
    # The consumer's copy-out is part of each update: its copies, timed here
    # on the same device.
    outs = {name: torch.empty_like(t) for name, t in sd.items()}

    def update():
        torch.cat([t.reshape(-1) for t in new.values()], out=bucket)
        for name, o, n, _ in layout:
            outs[name].view(-1).copy_(bucket[o:o + n])

    update_s = median_time(update, iters, device)
    del outs
    return dict(export_s=export_s, update_s=update_s, extra=extra, handles=1, message=message,
                want=checksum(new), keep=(bucket, sd))


def way_ours(cfg, device, iters, born, kind):
    from storage_sharing.cuda import Pool

    free0 = free_bytes(device)
    if born:
        pool = Pool(device=str(device), kind=kind)
        with pool.allocating():
            sd = make_state_dict(cfg, device, 1)
        sync(device)
        t0 = time.perf_counter()
        pool.add_state_dict(sd)
        handle = pool.export()
        target = sd
    else:
        sd = make_state_dict(cfg, device, 1)
        sync(device)
        t0 = time.perf_counter()
        pool = Pool.from_state_dict(sd, device=str(device), kind=kind)
        handle = pool.export()
        target = pool.state_dict()
    message = pickle.dumps(handle)
    sync(device)
    export_s = time.perf_counter() - t0
    extra = free0 - free_bytes(device) - model_bytes(cfg)
    new = make_state_dict(cfg, device, 2)

    def update():
        with pool.update():
            for name, t in target.items():
                t.copy_(new[name])

    def publish_only():
        with pool.update():
            pass

    update_s = median_time(update, iters, device)
    publish_s = median_time(publish_only, iters, device)
    return dict(export_s=export_s, update_s=update_s, publish_s=publish_s, extra=extra,
                handles=len(pool.segments()), message=message, want=checksum(new), keep=(pool, sd))


def memcpy_floor(cfg, device, iters):
    n = model_bytes(cfg)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), iters, device)


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def run_model(model, device, iters, kinds):
    cfg = MODELS[model]
    nbytes = model_bytes(cfg)
    ntensors = sum(1 for _ in model_shapes(cfg))
    floor_s = memcpy_floor(cfg, device, iters)
    floor_gbs = nbytes / floor_s / 1e9
    ways = [("(a) per tensor", "per-tensor", lambda: way_per_tensor(cfg, device, iters)),
            ("(b) bucket", "bucket", lambda: way_bucket(cfg, device, iters))]
    if device.type == "cuda":
        ways.append(("(c) ours, born", "ours", lambda: way_ours(cfg, device, iters, True, "vmm")))
    for kind in kinds:
        ways.append((f"(d) ours, copied ({kind})", "ours", lambda kind=kind: way_ours(cfg, device, iters, False, kind)))
    rows = []
    for label, consumer_way, fn in ways:
        # Each way starts from an empty cache: free memory measured before it
        # must not include blocks the previous one left cached.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = fn()
        c = run_consumer(consumer_way, r["message"], device)
        bad = [n for n, v in r["want"].items() if abs(c["sums"][n] - v) > 1e-6 * max(1.0, abs(v))]
        if bad:
            raise RuntimeError(f"{label}: the consumer read other values for {bad}")
        extra = (r["extra"] + c["extra"]) / 2**20 if device.type == "cuda" else None
        gbs = nbytes / r["update_s"] / 1e9
        rows.append((label, r["export_s"] * 1e3, c["open_ms"], r["update_s"] * 1e3, gbs, 100 * gbs / floor_gbs,
                     r.get("publish_s", None), extra, r["handles"], c["fds"]))
        del r
    print(f"\n{model}: {ntensors} tensors, {nbytes / 1e6:.1f} MB bf16 on {device}"
          f" ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host backend'});"
          f" memcpy floor {floor_s * 1e3:.2f} ms = {floor_gbs:.1f} GB/s; median of {iters}")
    head = ("way", "export ms", "open ms", "update ms", "GB/s", "% floor", "publish ms", "extra MiB", "handles", "fds")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" + "---:|" * (len(head) - 1))
    for label, exp, opn, upd, gbs, pct, pub, extra, handles, fds in rows:
        cells = (label, fmt(exp, ".1f"), fmt(opn, ".1f"), fmt(upd, ".2f"), fmt(gbs, ".2f"), fmt(pct, ".0f"),
                 fmt(None if pub is None else pub * 1e3, ".3f"), fmt(extra, ".0f"), str(handles), str(fds))
        print("| " + " | ".join(cells) + " |")
    a_open = rows[0][2]
    for row in rows[2:]:
        print(f"{row[0]}: open time (a) / this = {a_open / row[2]:.1f}, (b) / this = {rows[1][2] / row[2]:.1f}")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default=None, help="comma-separated: tiny, 1.5b, 8b (default: 1.5b,8b on CUDA, tiny on CPU)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kinds", default="vmm,legacy", help="pool kinds for (d)")
    ap.add_argument("--consumer", nargs=3, metavar=("WAY", "MESSAGE", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        consumer_main(*args.consumer)
        return
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
    kinds = [k for k in args.kinds.split(",") if k]
    models = (args.models or ("1.5b,8b" if device.type == "cuda" else "tiny")).split(",")
    for model in models:
        need = 5 * model_bytes(MODELS[model])  # model, its new version, a copy, the consumer's copy, slack
        if device.type == "cuda" and free_bytes(device) < need:
            print(f"\n{model}: skipped: needs about {need / 2**30:.0f} GiB free on {device},"
                  f" has {free_bytes(device) / 2**30:.0f}")
            continue
        run_model(model, device, args.iters, kinds)


if __name__ == "__main__":
    main()
