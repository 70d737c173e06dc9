#!/usr/bin/env bash
# Runs one of PyTorch's own test files (e.g. test/test_multiprocessing.py from
# the PyTorch source matching the installed torch; not part of this
# repository) twice with $SS_TEST_PYTHON's torch: stock, then with
# storage_sharing.torch enabled in the test process and in every process it
# starts. Prints the totals of both runs and the tests that pass stock but not
# with enable(); exits 1 when there is any.
#
#   SS_TEST_PYTHON=/path/to/venv/bin/python bash python/run_pytorch_tests.sh FILE [pytest args]
#
# The package must already be installed there (python/run_tests.sh does it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ "$#" -eq 0 ]; then
    echo "python/run_pytorch_tests.sh: skipped: no PyTorch test file given (usage: $0 FILE [pytest args])"
    exit 0
fi
file="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
shift
[ -f "$file" ] || { echo "python/run_pytorch_tests.sh: no such file: $file" >&2; exit 2; }
py="${SS_TEST_PYTHON:?set SS_TEST_PYTHON to a Python with torch and storage_sharing installed}"
"$py" -c "import storage_sharing.torch" || {
    echo "python/run_pytorch_tests.sh: storage_sharing is not installed for $py (run python/run_tests.sh)" >&2
    exit 2
}
# PyTorch's test helpers need expecttest.
"$py" -c "import pytest, expecttest" 2>/dev/null || "$py" -m pip install --quiet pytest expecttest

out="$(mktemp -d "${TMPDIR:-/tmp}/pytorch-tests.XXXXXX")"
trap 'rm -rf "$out"' EXIT
run() { # name, extra environment...
    local name="$1"
    shift
    echo "== $(basename "$file"): $name run"
    (cd "$(dirname "$file")" && env -u STORAGE_SHARING_TORCH "$@" timeout "${SS_PYTORCH_TESTS_TIMEOUT:-3600}" \
        "$py" -m pytest -p no:cacheprovider -q -rfE --junitxml="$out/$name.xml" "$file" "${pytest_args[@]}") || true
    [ -s "$out/$name.xml" ] || { echo "python/run_pytorch_tests.sh: the $name run wrote no report" >&2; exit 2; }
}
pytest_args=("$@")
run stock
# The variable's value is enable()'s arguments (segment size:large threshold).
hook=(PYTHONPATH="$here/pytorch_suite/enable_hook${PYTHONPATH:+:$PYTHONPATH}" STORAGE_SHARING_TORCH="$((256 << 20)):$((64 << 20))")
env "${hook[@]}" "$py" -c "import sys; m = sys.modules.get('storage_sharing.torch'); assert m and m.is_enabled()" || {
    echo "python/run_pytorch_tests.sh: the start-up hook did not enable storage_sharing.torch" >&2
    exit 2
}
run enabled "${hook[@]}"
"$py" "$here/pytorch_suite/compare_junit.py" "$out/stock.xml" "$out/enabled.xml"
