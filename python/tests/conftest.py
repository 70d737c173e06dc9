import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # _workers, for spawn children too

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "torch: needs torch")


@pytest.fixture
def shm_names():
    """Names in /dev/shm that this test's processes made (arena, torch)."""

    def listing(pids):
        prefixes = [f"ss_arena_{p}_" for p in pids] + [f"torch_{p}_" for p in pids]
        return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes))

    return listing


@pytest.fixture
def torch_enabled():
    st = pytest.importorskip("storage_sharing.torch")
    st.enable()
    yield st
    st.disable()
