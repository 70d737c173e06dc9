"""The package as a user installs it. Versions agree everywhere; and, when
python/run_wheel_tests.sh runs the suite against an installed wheel
(SS_INSTALLED_SITE set): the package imported is that install, not
python/'s sources; no cargo or rustc is on PATH; the wheel's ssctl and
ss_shm_manager run, and the package starts its own manager without PATH
or SS_SHM_MANAGER; `enable()` and the DataLoader example run in a fresh
interpreter.

SS_SOURCE_TREE names the repository (for Cargo.toml and examples/); the
tests that need it skip without it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import storage_sharing as ss
from storage_sharing._installed_tools import installed_script


def source_tree() -> Path:
    root = os.environ.get("SS_SOURCE_TREE")
    if not root:
        pytest.skip("SS_SOURCE_TREE not set: no repository to compare with")
    return Path(root)


def installed_site() -> Path:
    site = os.environ.get("SS_INSTALLED_SITE")
    if not site:
        pytest.skip("not run against an installed wheel (python/run_wheel_tests.sh sets SS_INSTALLED_SITE)")
    return Path(site).resolve()


def package_version(cargo_toml: Path) -> str:
    """The [package] version of a Cargo.toml (no toml parser before 3.11)."""
    text = cargo_toml.read_text()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M)
    assert found, f"no version in the [package] table of {cargo_toml}"
    return found.group(1)


def test_package_and_native_module_versions_agree():
    assert ss.__version__ == ss._native.ss_version()


def test_versions_agree_with_the_crates():
    root = source_tree()
    assert package_version(root / "Cargo.toml") == ss._native.ss_version()
    assert package_version(root / "python" / "Cargo.toml") == ss.__version__
    pyproject = (root / "python" / "pyproject.toml").read_text()
    assert f'\nversion = "{ss.__version__}"\n' in pyproject


def test_the_installed_package_is_imported_without_rust_on_path():
    site = installed_site()
    assert Path(ss.__file__).resolve().parent == site / "storage_sharing"
    assert shutil.which("cargo") is None and shutil.which("rustc") is None, os.environ["PATH"]


def test_the_wheel_scripts_run():
    installed_site()
    ssctl = installed_script("ssctl")
    manager = installed_script("ss_shm_manager")
    assert ssctl is not None and manager is not None, "the wheel installed no ssctl or ss_shm_manager"
    out = subprocess.run([str(ssctl), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: ssctl" in out.stdout, out
    out = subprocess.run([str(ssctl), "ls"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    out = subprocess.run([str(manager), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: ss_shm_manager" in out.stdout, out


def bare_env() -> dict:
    """This environment without SS_SHM_MANAGER, and with a PATH that does
    not hold the wheel's scripts (a virtual environment not activated)."""
    env = {k: v for k, v in os.environ.items() if k != "SS_SHM_MANAGER"}
    env["PATH"] = "/usr/bin:/bin"
    return env


def test_the_package_starts_the_manager_it_installed():
    installed_site()
    manager = installed_script("ss_shm_manager")
    assert manager is not None, "the wheel installed no ss_shm_manager"
    # The daemon is a child of the process that starts it: print the
    # program each child runs.
    code = (
        "import os, storage_sharing as ss\n"
        "client = ss.ManagerClient(ss.spawn_manager())\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        stat = open(f'/proc/{pid}/stat').read()\n"
        "        if int(stat.rsplit(')', 1)[1].split()[1]) == os.getpid():\n"
        "            print('child runs', os.readlink(f'/proc/{pid}/exe'))\n"
        "    except OSError:\n"
        "        pass\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=bare_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"child runs {manager}" in out.stdout.splitlines(), out.stdout


def test_enable_and_the_dataloader_example_run_in_a_fresh_interpreter():
    root = source_tree()
    installed_site()
    pytest.importorskip("torch")
    env = bare_env()
    enable = "import storage_sharing.torch as t; t.enable()"
    out = subprocess.run([sys.executable, "-c", enable], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    example = root / "examples" / "python" / "dataloader.py"
    out = subprocess.run([sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "ok", out.stdout
