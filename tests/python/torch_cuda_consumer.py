# A PyTorch consumer: rebuilds a storage from storage-sharing's tuple
# (one text line on stdin) with UntypedStorage._new_shared_cuda, checks
# the pattern, writes 9s, and drops the storage so PyTorch releases the
# producer's counter slot.
import gc
import sys

import torch

pattern = int(sys.argv[1])
f = sys.stdin.readline().split()
device, size, offset, rc_offset = int(f[0]), int(f[2]), int(f[3]), int(f[5])
handle, event = bytes.fromhex(f[1]), bytes.fromhex(f[6])
rc, sync = f[4].encode(), f[7] == "1"
torch.cuda.set_device(device)
storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, rc, rc_offset, event, sync)
t = torch.empty(0, dtype=torch.int32, device=f"cuda:{device}").set_(storage, 0, (size // 4,), (1,))
ok = bool((t == pattern).all())
t.fill_(9)
torch.cuda.synchronize()
del t, storage
gc.collect()
print("@@", "ok" if ok else "bad: pattern not found", flush=True)
