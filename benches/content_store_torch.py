"""PyTorch's ContentStoreWriter/Reader on the data benches/content_store.rs
uses: 64 tensors of 16 MiB, tensor i holding pattern i // 2 (half of them
duplicates), byte j of pattern k = (31 * j + k) mod 256.

usage: python content_store_torch.py FOLDER   (prints one JSON line)
"""
import json
import shutil
import sys
import time

import torch
from torch.utils._content_store import ContentStoreReader, ContentStoreWriter

N = 16 << 20


def pattern(k):
    return ((torch.arange(N, dtype=torch.int64) * 31 + k) & 255).to(torch.uint8)


def main():
    root = sys.argv[1]
    tensors = [pattern(i // 2) for i in range(64)]
    out = {"torch": torch.__version__}
    for label, stable in (("writer_default_hash", False), ("writer_stable_hash", True)):
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        w = ContentStoreWriter(root, stable_hash=stable)
        for i, x in enumerate(tensors):
            w.write_tensor(f"t{i}", x)
        out[label] = time.perf_counter() - t
    t = time.perf_counter()
    r = ContentStoreReader(root)
    loaded = [r.read_tensor(f"t{i}") for i in range(64)]
    out["reader_load"] = time.perf_counter() - t
    assert all(torch.equal(a, b) for a, b in zip(loaded[:4], tensors[:4]))
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
