"""A pytest plugin (-p ss_swap_content_store, run_pytorch_tests.sh --with
content-store) that puts
storage_sharing.content_store's public names in the place of
torch.utils._content_store's, before the test file is imported: in that
module, and in every module already imported that took one of them by
name (``import torch`` imports torch._prims.debug_prims, which does)."""

import sys

import torch.utils._content_store as theirs

import storage_sharing.content_store as ours

NAMES = ("ContentStoreReader", "ContentStoreWriter", "hash_storage")

originals = {name: getattr(theirs, name) for name in NAMES}
for module in list(sys.modules.values()):
    if module is None or module is ours:
        continue
    for name, original in originals.items():
        if getattr(module, name, None) is original:
            setattr(module, name, getattr(ours, name))


def check():
    """Raises unless every name now comes from storage_sharing."""
    for name in NAMES:
        assert getattr(theirs, name) is getattr(ours, name), f"{name} is still PyTorch's"


def pytest_report_header(config):
    where = {name: getattr(theirs, name).__module__ for name in NAMES}
    return f"torch.utils._content_store names now from: {where}"
