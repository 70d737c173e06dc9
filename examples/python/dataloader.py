"""A DataLoader whose workers hand batches over through storage_sharing's
arena: with ``enable()``, each worker collates a batch straight into shared
memory and the main process maps it, with no copy and nothing in /dev/shm.

    python examples/python/dataloader.py

Prints one line per batch and "ok" at the end; exits 1 if a batch is wrong.
"""

import sys

import torch
from torch.utils.data import DataLoader, Dataset

import storage_sharing.torch


class Squares(Dataset):
    """Item i: an image-sized tensor filled with i * i, and its label i."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(i * i)), i


def main():
    storage_sharing.torch.enable()
    loader = DataLoader(Squares(), batch_size=4, num_workers=2)
    seen = 0
    for images, labels in loader:
        # Collated by a worker into its arena; this process maps the block.
        want = (labels.to(torch.float32) ** 2).view(-1, 1, 1, 1).expand_as(images)
        if not torch.equal(images, want) or not images.untyped_storage().is_shared():
            print(f"batch {labels.tolist()}: wrong or not shared", file=sys.stderr)
            return 1
        print(f"batch {labels.tolist()}: {tuple(images.shape)} in shared memory")
        seen += len(labels)
    if seen != len(Squares()):
        print(f"saw {seen} items, wanted {len(Squares())}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
