"""Put on PYTHONPATH by run_pytorch_tests.sh for its second run: every Python
process started there (the test process and each child, fork, spawn or
forkserver alike) enables storage_sharing.torch at start-up while
STORAGE_SHARING_TORCH is set in its environment."""

import os

if os.environ.get("STORAGE_SHARING_TORCH"):
    import storage_sharing.torch  # noqa: F401  (enables itself from the variable)
