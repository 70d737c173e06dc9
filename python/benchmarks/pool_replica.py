"""Weights to every node after a training step, four ways, side by side in
one run on one process group (gloo over loopback here; rank 0 is the
trainer, the others stand for nodes):

  (a) per-tensor:  one dist.broadcast per tensor into the receiver's own
                   tensors (hundreds of collectives);
  (b) buckets:     tensors flattened into a bucket on the source, the
                   bucket broadcast, then copied out into the receiver's
                   tensors (checkpoint-engine's pattern; --bucket-mib);
  (c) pool:        pool.broadcast into each node's replica pool, whose
                   tensors the node's consumers read in place (no copy);
  (d) floor:       one dist.broadcast of a flat buffer of the same bytes;
  (e) floor in pool memory: the same, of a buffer that is one segment of a
                   pool (host: shared memory, which the kernel maps in 4 KiB
                   pages where a large private buffer may get huge pages).

    python python/benchmarks/pool_replica.py                   # 3 ranks, host memory
    python python/benchmarks/pool_replica.py --ranks 4 --runs 5
    python python/benchmarks/pool_replica.py --ranks 2 --device cuda:0   # gloo with CUDA tensors

The state dict is LLM-shaped, bf16: --layers decoder layers of 12 tensors
(q, k, v, o with q/k/v biases, gate, up, down, two norms) plus embedding,
final norm and head: 339 tensors at the default 28 layers, 811 MiB.
Each row is timed from a barrier to the moment every rank is done (the
slowest rank), median of --runs. "Extra memory" is what a receiver holds
beyond its weights while it receives: the bucket in (b); the manifest and
header in (c); the floor's flat buffer is the weights themselves.
"""

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from storage_sharing import cuda
from storage_sharing import _pool_replica


def llm_state_dict(layers: int, hidden: int, inter: int, vocab: int, device: str) -> dict:
    sd = {"model.embed_tokens.weight": torch.empty(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q", "k", "v", "o"):
            sd[p + f"self_attn.{name}_proj.weight"] = torch.empty(hidden, hidden)
        for name in ("q", "k", "v"):
            sd[p + f"self_attn.{name}_proj.bias"] = torch.empty(hidden)
        sd[p + "mlp.gate_proj.weight"] = torch.empty(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = torch.empty(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = torch.empty(hidden, inter)
        sd[p + "input_layernorm.weight"] = torch.empty(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.empty(hidden)
    sd["model.norm.weight"] = torch.empty(hidden)
    sd["lm_head.weight"] = torch.empty(vocab, hidden)
    return {k: torch.zeros_like(v, dtype=torch.bfloat16, device=device) for k, v in sd.items()}


def fill(sd: dict, step: int) -> None:
    for i, t in enumerate(sd.values()):
        t.fill_((step * 7 + i) % 61)


def buckets_of(sd: dict, bucket_bytes: int) -> list:
    """Lists of tensor names whose bytes fill one bucket each."""
    out, current, size = [], [], 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        out.append(current)
    return out


def timed(fn) -> float:
    """Seconds from a barrier until every rank has run ``fn`` (the max)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def rank_main(rank: int, world: int, init: str, args, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    device = args.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    sd = llm_state_dict(args.layers, args.hidden, args.inter, args.vocab, device)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    bucket_bytes = args.bucket_mib << 20
    names = buckets_of(sd, bucket_bytes)
    if rank == 0:
        fill(sd, 1)
        pool = cuda.Pool.from_state_dict(sd, device=device)
        pool.export()
        pool.broadcast(src=0)  # the replicas are made (not timed)
        manifest_bytes = len(_pool_replica.json.dumps(_pool_replica.manifest_of(pool)[0], separators=(",", ":")))
    else:
        pool = cuda.Pool.replica(src=0, device=device)
        manifest_bytes = 0
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    flat_pool = cuda.Pool.from_state_dict({"flat": torch.zeros(total, dtype=torch.uint8, device=device)}, segment_size=total)
    flat_in_pool = flat_pool.state_dict()["flat"]
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)

    def per_tensor():
        for t in sd.values():
            dist.broadcast(t, src=0)
        sync()

    def buckets():
        for group in names:
            at = 0
            views = []
            for name in group:
                t = sd[name]
                n = t.numel() * t.element_size()
                views.append((t, bucket[at : at + n]))
                at += n
            if rank == 0:
                for t, b in views:
                    b.copy_(t.view(-1).view(torch.uint8))
            dist.broadcast(bucket[:at], src=0)
            if rank != 0:
                for t, b in views:
                    t.view(-1).view(torch.uint8).copy_(b)
        sync()

    def ours():
        pool.broadcast(src=0, chunk_bytes=args.chunk_mib << 20)
        sync()

    def floor():
        dist.broadcast(flat, src=0)
        sync()

    def floor_in_pool():
        dist.broadcast(flat_in_pool, src=0)
        sync()

    # Fixed costs: one collective of one element, and a round of a pool
    # of one small tensor (header, manifest, vote, one chunk, commit).
    one = torch.zeros(1, device=device)
    tiny = statistics.median(timed(lambda: dist.broadcast(one, src=0)) for _ in range(30))
    if rank == 0:
        small = cuda.Pool.from_state_dict({"w": torch.zeros(1024, device=device)})
        small.broadcast(src=0)
    else:
        small = cuda.Pool.replica(src=0, device=device)
    round_cost = statistics.median(timed(lambda: small.broadcast(src=0)) for _ in range(15))

    rows = {k: fn for k, fn in {"a": per_tensor, "b": buckets, "c": ours, "d": floor, "e": floor_in_pool}.items() if k in args.rows}
    times = {k: [] for k in rows}
    for key in "abde":
        if key in rows:
            timed(rows[key])  # a first pass touches every page of the buffers (the pool's: at Pool.replica)
    for step in range(args.runs):
        for key, fn in rows.items():  # interleaved, so drift in the machine's load hits every row alike
            if rank == 0 and key == "c":
                with pool.update() as tensors:
                    fill(tensors, step + 2)
            times[key].append(timed(fn))
    ok = True
    if rank != 0:
        want = llm_state_dict(args.layers, args.hidden, args.inter, args.vocab, device)
        fill(want, args.runs + 1)
        got = pool.state_dict()
        ok = all(torch.equal(got[k], want[k]) for k in want) and pool.version == args.runs + 1
    if rank == 0:
        out.put((total, len(sd), manifest_bytes, bucket_bytes, {k: statistics.median(v) for k, v in times.items()}, times, (tiny, round_cost)))
    out.put(("check", rank, ok))
    dist.destroy_process_group()


def rows_run(args) -> str:
    return "".join(k for k in "abcde" if k in args.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", default="abcde", help="which rows to run (tuning: --rows cd)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "group")
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, init, args, out)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        result, checks = None, []
        for _ in range(args.ranks + 1):
            item = out.get(timeout=3600)
            if item[0] == "check":
                checks.append(item)
            else:
                result = item
        for p in procs:
            p.join()
    total, count, manifest_bytes, bucket_bytes, med, times, (tiny, round_cost) = result
    assert all(ok for _, _, ok in checks), f"a replica did not end on the source's last version: {checks}"
    labels = {
        "a": "(a) one dist.broadcast per tensor",
        "b": f"(b) {bucket_bytes >> 20} MiB buckets + copy-out",
        "c": f"(c) pool.broadcast ({args.chunk_mib} MiB chunks)",
        "d": "(d) floor: one flat dist.broadcast",
        "e": "(e) the floor, of a buffer in a pool segment",
    }
    extra = {"a": "0", "b": f"{bucket_bytes >> 20} MiB", "c": f"{manifest_bytes / 1024:.0f} KiB (manifest)", "d": "(the weights)", "e": "(the weights)"}
    print(f"{count} bf16 tensors, {total / 2**20:.0f} MiB, {args.ranks} gloo ranks, device {args.device}, median of {args.runs}")
    print("| way | time | GB/s | floor / time | extra memory per receiver |")
    print("|---|---|---|---|---|")
    for key in rows_run(args):
        t = med[key]
        floor = f"{med['d'] / t:.2f}" if "d" in med else "-"
        print(f"| {labels[key]} | {t * 1000:.0f} ms | {total / t / 1e9:.2f} | {floor} | {extra[key]} |")
    print("runs (s):", {k: [round(x, 3) for x in v] for k, v in times.items()})
    print(f"one broadcast of one element: {tiny * 1e6:.0f} us; a round of a 4 KiB pool: {round_cost * 1e6:.0f} us (medians)")


if __name__ == "__main__":
    main()
