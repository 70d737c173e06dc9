# A PyTorch consumer of storage-sharing tuples (one text line each on
# stdin). The first is rebuilt with UntypedStorage._new_shared_cuda: check
# the pattern, write 9s, drop it so PyTorch releases the producer's slot.
# The second is released without opening, as PyTorch does when its cache
# already holds the storage (_release_ipc_counter_cuda).
import gc
import sys

import torch


def fields(line):
    f = line.split()
    return (int(f[0]), bytes.fromhex(f[1]), int(f[2]), int(f[3]), f[4].encode(), int(f[5]),
            bytes.fromhex(f[6]), f[7] == "1")


pattern = int(sys.argv[1])
device, handle, size, offset, rc, rc_offset, event, sync = fields(sys.stdin.readline())
torch.cuda.set_device(device)
storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, rc, rc_offset, event, sync)
t = torch.empty(0, dtype=torch.int32, device=f"cuda:{device}").set_(storage, 0, (size // 4,), (1,))
ok = bool((t == pattern).all())
t.fill_(9)
torch.cuda.synchronize()
del t, storage
gc.collect()
print("@@", "ok" if ok else "bad: pattern not found", flush=True)

_, _, _, _, rc2, rc_offset2, _, _ = fields(sys.stdin.readline())
torch.UntypedStorage._release_ipc_counter_cuda(rc2, rc_offset2)
print("@@ released", flush=True)
