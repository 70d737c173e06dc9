#!/usr/bin/env bash
# Tests the wheel as a user gets it: installs WHEEL with pip into a fresh
# virtual environment, then runs the pytest suite there from a copy of
# python/tests outside python/, so the package imported is the installed
# one. The environment is made from $SS_TEST_PYTHON's interpreter and sees
# that environment's packages (torch, pytest, numpy) through a .pth file
# written after the install, so torch is not installed twice; PATH holds
# the new environment's bin/ and no folder with cargo or rustc in it.
#
#   SS_TEST_PYTHON=/path/to/venv/bin/python bash python/run_wheel_tests.sh WHEEL [pytest args]
#
# Works in $CARGO_TARGET_DIR/wheel-test (default target/wheel-test), made
# anew each run. Fails when pytest collects no test (its exit code 5).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
me="python/run_wheel_tests.sh"
py="${SS_TEST_PYTHON:?set SS_TEST_PYTHON to a Python with torch installed}"
wheel="${1:?usage: $me WHEEL [pytest args]}"
shift
[ -f "$wheel" ] || { echo "$me: no wheel at $wheel" >&2; exit 2; }
work="${CARGO_TARGET_DIR:-$root/target}/wheel-test"

"$py" -c "import pytest, numpy" 2>/dev/null || "$py" -m pip install --quiet pytest numpy
rm -rf "$work"
mkdir -p "$work"
"$py" -m venv "$work/venv"
venv_py="$work/venv/bin/python"
# The wheel alone, as a user installs it: nothing else in the environment yet.
"$venv_py" -m pip install --quiet --disable-pip-version-check --no-index "$wheel"
site="$("$venv_py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
# Every site-packages folder $SS_TEST_PYTHON sees (its own, and any its own
# .pth files add: a .pth line is not searched for further .pth files).
"$py" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' >"$site/ss_test_shared_packages.pth"

# PATH without cargo and rustc: a user's machine has no Rust toolchain.
clean_path="$work/venv/bin"
IFS=: read -r -a dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
    if [ -n "$dir" ] && [ ! -e "$dir/cargo" ] && [ ! -e "$dir/rustc" ]; then
        clean_path="$clean_path:$dir"
    fi
done

cp -r "$here/tests" "$work/tests"
cd "$work/tests"
echo "== $me: $(basename "$wheel") in $work/venv; pytest in $work/tests"
set +e
env PATH="$clean_path" VIRTUAL_ENV="$work/venv" SS_INSTALLED_SITE="$site" SS_SOURCE_TREE="$root" \
    "$venv_py" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "$me: pytest collected no test" >&2
    exit 1
fi
exit "$rc"
