"""The stock-PyTorch opener (examples/python/open_with_stock_pytorch.py) is
run on a GPU by scripts/gpu/cuda_weights_gpu.py; here, without one, it is
kept in step with the producer and with the page that shows it."""

import os
import re
import runpy
import sys
from pathlib import Path

import pytest

# The repository: SS_SOURCE_TREE when the suite runs from a copy (the installed-wheel run).
ROOT = Path(os.environ.get("SS_SOURCE_TREE") or Path(__file__).resolve().parents[2])
EXAMPLE = ROOT / "examples" / "python" / "open_with_stock_pytorch.py"


def test_the_opener_reads_the_format_the_producer_writes():
    from storage_sharing.cuda import STOCK_FORMAT

    opener = runpy.run_path(str(EXAMPLE))
    assert opener["STOCK_FORMAT"] == STOCK_FORMAT


def test_the_opener_imports_no_storage_sharing():
    source = EXAMPLE.read_text()
    assert not re.search(r"^\s*(import|from)\s+storage_sharing", source, re.M)


def test_the_opener_refuses_another_format():
    opener = runpy.run_path(str(EXAMPLE))
    with pytest.raises(ValueError, match="not a stock weights descriptor"):
        opener["open_stock_weights"]({"format": "something/else", "device": 0, "segments": [], "tensors": {}})


def test_the_docs_show_the_opener_as_the_example_has_it():
    page = (ROOT / "docs" / "cuda-weights-gpu.md").read_text()
    shown = re.search(r"```python\n(def open_stock_weights\(.*?)```", page, re.S)
    assert shown, "docs/cuda-weights-gpu.md shows no open_stock_weights"
    assert shown.group(1) in EXAMPLE.read_text(), "docs/cuda-weights-gpu.md's opener differs from the example's"


def test_a_stock_process_opens_no_storage_sharing(tmp_path):
    """Run as a script where storage_sharing cannot be imported, the opener
    still loads (it fails only at the CUDA call without a GPU)."""
    import subprocess

    code = (
        "import sys, runpy; sys.modules['storage_sharing'] = None; "
        f"m = runpy.run_path({str(EXAMPLE)!r}); print(m['STOCK_FORMAT'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "storage_sharing.cuda_weights.stock/1"
