#!/usr/bin/env bash
# Runs PyTorch's own test/test_content_store.py, unchanged, twice: against
# torch.utils._content_store as shipped, then with its public names
# replaced by storage_sharing.content_store's (pytorch_tests/
# ss_swap_content_store.py). Prints every test that passes the first time
# and not the second, and fails if there is one.
#
#   SS_TEST_PYTHON=/path/to/python python/run_pytorch_content_store_tests.sh /tmp/test_content_store.py
#
# The Python must have torch and this package installed (python/run_tests.sh
# installs it); expecttest and pytest are installed if missing. The test file is PyTorch's: fetch it
# from PyTorch's repository (the torch version's tag) into a temporary
# folder, not into this repository.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${SS_TEST_PYTHON:?set SS_TEST_PYTHON to a Python with torch, pytest and storage_sharing installed}"
test_file="${1:?usage: $0 path/to/pytorch/test/test_content_store.py}"
[ -f "$test_file" ] || { echo "$0: no file $test_file" >&2; exit 2; }
test_file="$(cd "$(dirname "$test_file")" && pwd)/$(basename "$test_file")"
# PyTorch's test helpers need expecttest; pytest writes the reports.
"$py" -c "import expecttest, pytest" 2>/dev/null || "$py" -m pip install --quiet expecttest pytest
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run() { # $1: label; the rest: extra pytest arguments
    local label="$1"
    shift
    # From the test file's folder, as PyTorch runs its tests; pytest's exit
    # status is read from the report, not used to stop here.
    (cd "$(dirname "$test_file")" && PYTHONPATH="$here/pytorch_tests${PYTHONPATH:+:$PYTHONPATH}" \
        "$py" -m pytest -p no:cacheprovider --junitxml="$work/$label.xml" "$@" "$test_file") \
        >"$work/$label.log" 2>&1 || true
    tail -n 1 "$work/$label.log" | sed "s/^/[$label] /"
}
run stock
run ours -p ss_swap_content_store
grep -h "names now from" "$work/ours.log" || { echo "$0: the names were not replaced" >&2; exit 1; }

"$py" - "$work/stock.xml" "$work/ours.xml" "$work/ours.log" <<'PY'
import sys
import xml.etree.ElementTree as ET

def outcomes(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        sys.exit(f"no test report at {path}: {e}")
    got = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        got[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return got

stock, ours = outcomes(sys.argv[1]), outcomes(sys.argv[2])
passed = sorted(n for n, o in stock.items() if o == "passed")
if not passed:
    sys.exit("no test passed with PyTorch's own module: the run itself is broken (see the log above)")
worse = [n for n in passed if ours.get(n) != "passed"]
print(f"{len(passed)} of {len(stock)} tests pass with torch.utils._content_store; "
      f"{len(passed) - len(worse)} of them pass with storage_sharing.content_store")
for n in worse:
    print(f"  passes stock, {ours.get(n, 'missing')} with ours: {n}")
if worse:
    print(open(sys.argv[3]).read()[-6000:])
    sys.exit(1)
PY
