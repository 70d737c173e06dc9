"""Open a storage_sharing weights pool with stock PyTorch alone.

A producer with a Legacy-kind CUDA pool gives `pool.stock_descriptor()`: a
dict of builtins (no storage_sharing types), so a process that has only
PyTorch can unpickle it and call `open_stock_weights` below. Each pool
segment is one cudaMalloc'd allocation with a legacy IPC handle; PyTorch's
`_new_shared_cuda` maps it (its 8 values are those `storage._share_cuda_()`
returns), and every tensor is a view into one of those storages.

    python open_with_stock_pytorch.py DESCRIPTOR.pkl   # prints name, shape, sum

The views stay valid while the storages live; dropping the last view gives the
producer its reference back through PyTorch's ref-counter file, as for any
tensor received through torch.multiprocessing. Each consumer process needs a
descriptor of its own (each stock_descriptor() call hands out new slots).
"""

import pickle
import sys

import torch

STOCK_FORMAT = "storage_sharing.cuda_weights.stock/1"


def open_stock_weights(descriptor):
    """name -> CUDA tensor view, from a stock descriptor (plain PyTorch only)."""
    if descriptor.get("format") != STOCK_FORMAT:
        raise ValueError(f"not a stock weights descriptor: format {descriptor.get('format')!r}")
    device = torch.device("cuda", int(descriptor["device"]))
    torch.cuda.init()  # _new_shared_cuda needs CUDA up, as PyTorch's own rebuild makes sure
    # One IPC open per segment, however many tensors it holds.
    segments = [torch.UntypedStorage._new_shared_cuda(*segment) for segment in descriptor["segments"]]
    weights = {}
    for name, (segment, byte_offset, dtype_name, shape, stride, storage_offset) in descriptor["tensors"].items():
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype_name!r}")
        if byte_offset % dtype.itemsize:
            raise ValueError(f"{name}: byte offset {byte_offset} is not a multiple of {dtype} ({dtype.itemsize} bytes)")
        # set_ refuses a view past the end: these storages cannot be resized.
        view = torch.empty(0, dtype=dtype, device=device)
        view.set_(segments[segment], byte_offset // dtype.itemsize + storage_offset, shape, stride)
        weights[name] = view
    return weights


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        opened = open_stock_weights(pickle.load(f))
    for name, tensor in opened.items():
        print(name, tuple(tensor.shape), float(tensor.double().sum()))
