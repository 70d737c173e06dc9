# A PyTorch producer: shares a CUDA tensor the way torch.multiprocessing
# does (reduce_tensor) and prints the 8-field tuple in storage-sharing's
# one-line text form. After the consumer says "released", checks that the
# consumer's writes are visible and that its counter slot is back to 0.
import sys

import torch
from torch.multiprocessing.reductions import reduce_tensor

n = int(sys.argv[1])
t = torch.arange(n, dtype=torch.int32, device="cuda")
_, args = reduce_tensor(t)
device, handle, size, offset = args[6], args[7], args[8], args[9]
rc, rc_offset, event, sync = args[11], args[12], args[13], args[14]
print(f"@@ torch {torch.__version__} handle version {handle[0]} type {chr(handle[1])!r} "
      f"len {len(handle)} offset {offset} event_sync {sync} tensor_offset {args[3]}", flush=True)
print("@@", device, handle.hex(), size, offset, rc.decode(), rc_offset, event.hex(), int(sync), flush=True)

sys.stdin.readline()
torch.cuda.synchronize()
values_ok = bool((t == 7).all())
with open("/dev/shm" + rc.decode(), "rb") as f:
    f.seek(64 + 8 * rc_offset)
    counter = int.from_bytes(f.read(8), sys.byteorder, signed=True)
print("@@", "ok" if values_ok and counter == 0 else f"bad: values_ok={values_ok} counter={counter}", flush=True)
# Let go of the tensor: its counter is 0, so PyTorch frees it at once and
# has nothing left to warn about at exit.
del t
torch.cuda.ipc_collect()
