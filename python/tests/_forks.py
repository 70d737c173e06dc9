"""Waiting for a forked child in tests, with a hang guard."""

import os
import signal
import time

import pytest


def wait_child(pid, guard_s=120):
    """The child's exit code; a child still running after guard_s (a
    hang guard, far above the time it needs) is killed and fails the test."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung (killed after {guard_s} s)")
