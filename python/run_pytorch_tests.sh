#!/usr/bin/env bash
# Runs one of PyTorch's own test files (from the PyTorch source matching the
# installed torch; not part of this repository) twice with $SS_TEST_PYTHON's
# torch: stock, then with our code in PyTorch's place. Prints the totals of
# both runs and the tests that pass stock but not with ours; exits 1 when
# there is any.
#
#   SS_TEST_PYTHON=/path/to/venv/bin/python bash python/run_pytorch_tests.sh [--with WHAT] FILE [pytest args]
#
# WHAT is
#   enable         (default) storage_sharing.torch enabled in the test process
#                  and in every process it starts (for test_multiprocessing.py,
#                  test_dataloader.py);
#   content-store  torch.utils._content_store's public names replaced by
#                  storage_sharing.content_store's (for test_content_store.py).
# The package must already be installed there (python/run_tests.sh does it).
# With SS_PYTORCH_TESTS_KEEP=DIR, both runs' JUnit reports are copied to DIR
# (scripts/torch_versions.sh counts them).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
me="python/run_pytorch_tests.sh"
with=enable
if [ "${1:-}" = "--with" ]; then
    with="${2:?$me: --with needs enable or content-store}"
    shift 2
fi
case "$with" in enable | content-store) ;; *)
    echo "$me: --with $with: expected enable or content-store" >&2
    exit 2
    ;;
esac
if [ "$#" -eq 0 ]; then
    echo "$me: skipped: no PyTorch test file given (usage: $me [--with WHAT] FILE [pytest args])"
    exit 0
fi
[ -f "$1" ] || { echo "$me: no such file: $1" >&2; exit 2; }
file="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
shift
py="${SS_TEST_PYTHON:?set SS_TEST_PYTHON to a Python with torch and storage_sharing installed}"
"$py" -c "import storage_sharing.torch" || {
    echo "$me: storage_sharing is not installed for $py (run python/run_tests.sh)" >&2
    exit 2
}
# PyTorch's test helpers need expecttest.
"$py" -c "import pytest, expecttest" 2>/dev/null || "$py" -m pip install --quiet pytest expecttest

out="$(mktemp -d "${TMPDIR:-/tmp}/pytorch-tests.XXXXXX")"
keep="${SS_PYTORCH_TESTS_KEEP:-}"
trap '[ -z "$keep" ] || cp "$out"/*.xml "$keep"/ 2>/dev/null || true; rm -rf "$out"' EXIT
run() { # name, extra environment...
    local name="$1"
    shift
    echo "== $(basename "$file"): $name run"
    # From the test file's folder, as PyTorch runs its tests; pytest's exit
    # status is read from the report, not used to stop here.
    (cd "$(dirname "$file")" && env -u STORAGE_SHARING_TORCH "$@" timeout "${SS_PYTORCH_TESTS_TIMEOUT:-3600}" \
        "$py" -m pytest -p no:cacheprovider -q -rfE --junitxml="$out/$name.xml" "$file" "${pytest_args[@]}") || true
    [ -s "$out/$name.xml" ] || { echo "$me: the $name run wrote no report" >&2; exit 2; }
}
pytest_args=("$@")
run stock
if [ "$with" = enable ]; then
    # The variable's value is enable()'s arguments (segment size:large threshold).
    hook=(PYTHONPATH="$here/pytorch_suite/enable_hook${PYTHONPATH:+:$PYTHONPATH}" STORAGE_SHARING_TORCH="$((256 << 20)):$((64 << 20))")
    env "${hook[@]}" "$py" -c "import sys; m = sys.modules.get('storage_sharing.torch'); assert m and m.is_enabled()" || {
        echo "$me: the start-up hook did not enable storage_sharing.torch" >&2
        exit 2
    }
    run enabled "${hook[@]}"
    "$py" "$here/pytorch_suite/compare_junit.py" "$out/stock.xml" "$out/enabled.xml"
else
    swap="$here/pytorch_suite/content_store_swap"
    PYTHONPATH="$swap${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "import ss_swap_content_store as s; s.check()" || {
        echo "$me: the swap plugin did not replace torch.utils._content_store's names" >&2
        exit 2
    }
    pytest_args=(-p ss_swap_content_store "${pytest_args[@]}")
    run ours PYTHONPATH="$swap${PYTHONPATH:+:$PYTHONPATH}"
    "$py" "$here/pytorch_suite/compare_junit.py" "$out/stock.xml" "$out/ours.xml"
fi
