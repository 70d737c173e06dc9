#!/usr/bin/env bash
# For developers: builds and installs the Python package from python/ into
# $SS_TEST_PYTHON's environment (a Python with torch; needs cargo), then runs
# its pytest suite. The test command tests the wheel instead
# (scripts/build_wheel.sh, python/run_wheel_tests.sh). Fails when pytest
# collects no test (its exit code 5).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${SS_TEST_PYTHON:?set SS_TEST_PYTHON to a Python with torch installed}"
"$py" -c "import maturin, pytest" 2>/dev/null || "$py" -m pip install --quiet "maturin>=1.9,<2" pytest numpy
"$py" -m pip install --quiet --no-deps --force-reinstall "$here"
cd "$here/tests"
set +e
SS_SOURCE_TREE="$(dirname "$here")" "$py" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "python/run_tests.sh: pytest collected no test" >&2
    exit 1
fi
exit "$rc"
