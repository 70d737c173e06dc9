"""storage_sharing.torch checks the private parts of PyTorch it replaces or
calls before it patches anything: on a PyTorch release outside the tested
range, or where one of those parts is missing or has another signature,
importing it patches nothing and enable() raises UnsupportedTorchError
naming the problem. Each case runs in a fresh interpreter, where the change
to PyTorch is made before (or after) the module is imported."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ALLOW = "STORAGE_SHARING_TORCH_ALLOW_UNTESTED"

pytest.importorskip("torch")

# Prints, as JSON: enable()'s outcome, whether it is enabled, and which of
# PyTorch's parts differ from before the import (before enable() with
# AFTER_IMPORT) to after enable().
SCRIPT = """
import json, os, sys
import torch, torch.multiprocessing
import torch.utils.data.dataloader as dl
from multiprocessing.reduction import ForkingPickler

def parts():
    it = dl._MultiProcessingDataLoaderIter.__dict__
    st = torch.UntypedStorage.__dict__
    return {
        "reducer": ForkingPickler._extra_reducers.get(torch.UntypedStorage),
        "is_shared": st.get("is_shared"),
        "share_memory_": st.get("share_memory_"),
        "_new_shared": st.get("_new_shared"),
        "__init__": it.get("__init__"),
        "_shutdown_workers": it.get("_shutdown_workers"),
        "env": os.environ.get("STORAGE_SHARING_TORCH"),
    }

def change():
CHANGE

if not AFTER_IMPORT:
    change()
before = parts()
import storage_sharing.torch as st
if AFTER_IMPORT:
    change()
    before = parts()
try:
    st.enable()
    outcome = "enabled"
except st.UnsupportedTorchError as e:
    outcome = str(e)
after = parts()
print(json.dumps({
    "outcome": outcome,
    "enabled": st.is_enabled(),
    "patched": sorted(k for k in before if before[k] is not after[k]),
}))
"""


def child_env(allow_untested=None):
    """This environment without storage_sharing.torch's variables, but for
    ALLOW_UNTESTED: kept as the run has it (None; scripts/torch_versions.sh
    --allow-untested tries a release outside the range), set (True) or
    dropped (False)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STORAGE_SHARING_TORCH")}
    allow = os.environ.get(ALLOW) if allow_untested is None else "1" if allow_untested else None
    if allow is not None:
        env[ALLOW] = allow
    return env


def run_case(change, after_import=False, allow_untested=None):
    env = child_env(allow_untested)
    script = SCRIPT.replace("CHANGE", textwrap.indent(change.strip() or "pass", "    ")).replace("AFTER_IMPORT", str(after_import))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_refused(result, *fragments):
    assert result["outcome"] != "enabled", "enable() patched a PyTorch it should have refused"
    assert "nothing was patched" in result["outcome"]
    for fragment in fragments:
        assert fragment in result["outcome"], result["outcome"]
    assert not result["enabled"]
    assert result["patched"] == [], f"patched although refused: {result['patched']}"


def test_supported_torch_enables_and_patches():
    result = run_case("")
    assert result["outcome"] == "enabled"
    assert result["enabled"]
    assert set(result["patched"]) == {"reducer", "is_shared", "share_memory_", "_new_shared", "__init__", "_shutdown_workers", "env"}


@pytest.mark.parametrize("version", ["2.99.0", "3.0.0+cpu", "1.13.1", "2.3.1"])
def test_version_outside_tested_range_is_refused(version):
    import storage_sharing.torch as st

    result = run_case(f"torch.__version__ = {version!r}", allow_untested=False)
    (lo_major, lo_minor), (hi_major, hi_minor) = st.TESTED_RANGE
    assert_refused(result, f"torch {version} is outside the tested range {lo_major}.{lo_minor} to {hi_major}.{hi_minor}", "STORAGE_SHARING_TORCH_ALLOW_UNTESTED=1")


def test_untested_version_enables_when_allowed():
    result = run_case("torch.__version__ = '2.99.0'", allow_untested=True)
    assert result["outcome"] == "enabled"
    assert result["enabled"]


@pytest.mark.parametrize("after_import", [False, True])
def test_missing_dataloader_method_is_refused(after_import):
    result = run_case("del dl._MultiProcessingDataLoaderIter._shutdown_workers", after_import=after_import)
    assert_refused(result, "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers is missing")


def test_changed_dataloader_signature_is_refused():
    result = run_case("dl._MultiProcessingDataLoaderIter.__init__ = lambda self, loader, sampler: None")
    assert_refused(result, "_MultiProcessingDataLoaderIter.__init__(self, loader, sampler): expected (self, loader)")


def test_missing_storage_reduction_is_refused():
    result = run_case("del ForkingPickler._extra_reducers[torch.UntypedStorage]")
    assert_refused(result, "no reduction for torch.UntypedStorage")


def test_missing_storage_method_is_refused():
    # A class attribute that is not callable hides PyTorch's method.
    result = run_case("torch.UntypedStorage.share_memory_ = None")
    assert_refused(result, "torch.UntypedStorage.share_memory_ is missing")


def test_without_swap_data_ptr_fresh_storages_take_pytorchs_way():
    # Releases before UntypedStorage._swap_data_ptr_ cannot move a storage
    # into the arena in place: enable() works, and such a storage is shared
    # by PyTorch's own reduction (into its shared memory, not the arena).
    script = """
import torch
torch.UntypedStorage._swap_data_ptr_ = None
import storage_sharing.torch as st
from multiprocessing.reduction import ForkingPickler
st.enable()
t = torch.arange(4.0)
got = ForkingPickler.loads(ForkingPickler.dumps(t))
arena = st.empty(4).fill_(7)
sent = ForkingPickler.loads(ForkingPickler.dumps(arena))
print(t.is_shared(), st.in_arena(t), torch.equal(got, t), st.in_arena(arena), torch.equal(sent, arena))
"""
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "True", "True", "True"]


def test_changed_new_shared_is_refused():
    result = run_case("torch.UntypedStorage._new_shared = classmethod(lambda cls, nbytes, device='cpu': None)")
    assert_refused(result, "torch.UntypedStorage._new_shared(nbytes, device='cpu'): expected (size, *, device='cpu')")


def test_allowing_untested_versions_does_not_skip_the_checks():
    result = run_case("torch.__version__ = '2.99.0'\ndel dl._MultiProcessingDataLoaderIter._shutdown_workers", allow_untested=True)
    assert_refused(result, "_shutdown_workers is missing")
    assert "outside the tested range" not in result["outcome"]


def test_every_problem_is_named_at_once():
    result = run_case("torch.__version__ = '2.99.0'\ndel ForkingPickler._extra_reducers[torch.UntypedStorage]", allow_untested=False)
    assert_refused(result, "outside the tested range", "no reduction for torch.UntypedStorage")
