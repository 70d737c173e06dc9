#!/usr/bin/env bash
# Runs the Python package against each PyTorch release given (default: the
# latest patch of every minor release from 2.0 to 2.15, oldest and newest
# first): for each, a virtual environment of its own with that torch from
# the Python package index (cached, reused while it imports), the package
# installed from one wheel, then
#   - the package's pytest suite (python/tests), and
#   - PyTorch's own test/test_multiprocessing.py of that release, stock and
#     with storage_sharing.torch enabled (python/run_pytorch_tests.sh).
# Prints one table row per version as it finishes and the whole table at the
# end (Markdown, as docs/python.md has it). Exits 1 when a version had a
# failure in the pytest suite or a test that passes stock but not with ours.
#
#   scripts/torch_versions.sh [options] [VERSION...]
#
#   --cache DIR       one venv per version in DIR/torch-VERSION, results in
#                     DIR/results (default: ${XDG_CACHE_HOME:-~/.cache}/storage-sharing)
#   --delete-after    remove each version's venv once its run is over (disk:
#                     one venv, 2-5 GB, at a time)
#   --wheel FILE      the package to install (default: built once, with
#                     scripts/build_wheel.sh where there is one, else
#                     `pip wheel ./python`)
#   --pytorch-tests DIR
#                     where PyTorch's test files are: DIR/VERSION/test_multiprocessing.py
#                     for that version (DIR/VERSION/SOURCE: one line saying where
#                     it is from), else DIR/test_multiprocessing.py for
#                     every version (the table names which); without them, the
#                     file of tag vVERSION is downloaded from GitHub into the
#                     version's cache folder (never into this repository)
#   --no-pytorch-tests  only the pytest suite
#   --deselect-from FILE
#                     leave out of the pytest suite the tests FILE names, a
#                     pytest node id (or its start) a line, # for comments
#                     (scripts/oldest_torch_deselect.txt says why for the
#                     oldest release)
#   --allow-untested  run with STORAGE_SHARING_TORCH_ALLOW_UNTESTED=1, so
#                     enable() tries a release outside TESTED_RANGE (how a
#                     release is tried before the range takes it in); its
#                     row says "allowed untested"
#   --python PY       the interpreter the venvs are made from (default python3)
#
# A VERSION is what pip takes after `torch==`: 2.4.1, 2.15.0.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
me="scripts/torch_versions.sh"

cache="${XDG_CACHE_HOME:-$HOME/.cache}/storage-sharing"
delete_after=0
wheel=""
tests_dir=""
deselect=()
pytorch_tests=1
allow_untested=0
base_python=python3
versions=()
while [ "$#" -gt 0 ]; do
    case "$1" in
    --cache) cache="${2:?$me: --cache needs a folder}"; shift 2 ;;
    --delete-after) delete_after=1; shift ;;
    --wheel) wheel="${2:?$me: --wheel needs a file}"; shift 2 ;;
    --pytorch-tests) tests_dir="${2:?$me: --pytorch-tests needs a folder}"; shift 2 ;;
    --no-pytorch-tests) pytorch_tests=0; shift ;;
    --deselect-from)
        [ -f "${2:-}" ] || { echo "$me: --deselect-from needs a file" >&2; exit 2; }
        while read -r line; do
            [ -z "$line" ] || [ "${line:0:1}" = "#" ] || deselect+=(--deselect "$line")
        done <"$2"
        shift 2
        ;;
    --allow-untested) allow_untested=1; shift ;;
    --python) base_python="${2:?$me: --python needs an interpreter}"; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "$me: unknown option $1 (see --help)" >&2; exit 2 ;;
    *)
        [[ "$1" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || { echo "$me: $1 is not a PyTorch version such as 2.4.1" >&2; exit 2; }
        versions+=("$1")
        shift
        ;;
    esac
done
if [ ${#versions[@]} -eq 0 ]; then
    # Oldest and newest first: the ends of the range say the most.
    versions=(2.0.1 2.15.0 2.1.2 2.14.1 2.2.2 2.13.0 2.3.1 2.12.1 2.4.1 2.11.0 2.5.1 2.10.0 2.6.0 2.9.1 2.7.1 2.8.0)
fi
if [ "$allow_untested" -eq 1 ]; then
    export STORAGE_SHARING_TORCH_ALLOW_UNTESTED=1
else
    unset STORAGE_SHARING_TORCH_ALLOW_UNTESTED
fi
[ -z "$tests_dir" ] || [ -d "$tests_dir" ] || { echo "$me: --pytorch-tests $tests_dir: no such folder" >&2; exit 2; }
mkdir -p "$cache/results"
cache="$(cd "$cache" && pwd)"

# The package, built once for every version (abi3: one wheel fits them all).
if [ -z "$wheel" ]; then
    out="$cache/wheel"
    rm -rf "$out"
    mkdir -p "$out"
    if [ -f "$repo/scripts/build_wheel.sh" ]; then
        echo "== building the wheel (scripts/build_wheel.sh)"
        bash "$repo/scripts/build_wheel.sh" "$out"
    else
        echo "== building the wheel (pip wheel ./python)"
        "$base_python" -m pip wheel --quiet --no-deps --wheel-dir "$out" "$repo/python"
    fi
    wheel="$(ls "$out"/storage_sharing-*.whl 2>/dev/null | head -n 1)"
    [ -n "$wheel" ] || { echo "$me: the wheel build left no storage_sharing-*.whl in $out" >&2; exit 1; }
fi
[ -f "$wheel" ] || { echo "$me: --wheel $wheel: no such file" >&2; exit 2; }
wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
echo "== package: $wheel"

# numpy 2 needs a torch built against it (2.4 and later); pytest, expecttest
# for the test suites.
numpy_for() {
    local minor="${1#*.}"
    minor="${minor%%.*}"
    if [ "${1%%.*}" -eq 2 ] && [ "$minor" -lt 4 ]; then echo "numpy<2"; else echo "numpy"; fi
}

# Installs torch VERSION into its venv unless it is there and imports.
make_venv() {
    local version="$1" venv="$2"
    if "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
        return 0
    fi
    echo "== installing torch $version into $venv"
    rm -rf "$venv"
    "$base_python" -m venv "$venv"
    # No pip cache: it would keep a second copy of every version's wheels.
    PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "torch==$version" "$(numpy_for "$version")" "pytest>=7" expecttest
}

# The test_multiprocessing.py of VERSION, or nothing: prints "PATH<TAB>SOURCE".
pytorch_test_file() {
    local version="$1" venv="$2"
    if [ -n "$tests_dir" ] && [ -f "$tests_dir/$version/test_multiprocessing.py" ]; then
        # DIR/VERSION/SOURCE, where there is one, says where the file is from.
        printf '%s\t%s\n' "$tests_dir/$version/test_multiprocessing.py" \
            "$(head -n 1 "$tests_dir/$version/SOURCE" 2>/dev/null || echo "v$version")"
    elif [ -n "$tests_dir" ] && [ -f "$tests_dir/test_multiprocessing.py" ]; then
        # DIR/SOURCE, where there is one, says where the file is from.
        printf '%s\t%s\n' "$tests_dir/test_multiprocessing.py" \
            "$(head -n 1 "$tests_dir/SOURCE" 2>/dev/null || echo "$tests_dir (one file for all)")"
    else
        local dest="$venv/pytorch-test/test_multiprocessing.py"
        mkdir -p "$(dirname "$dest")"
        [ -s "$dest" ] || curl -fsSL --max-time 60 -o "$dest" \
            "https://raw.githubusercontent.com/pytorch/pytorch/v$version/test/test_multiprocessing.py" 2>/dev/null ||
            { rm -f "$dest"; return 0; }
        printf '%s\tv%s\n' "$dest" "$version"
    fi
}

# "P passed, F failed, S skipped" of a JUnit report ("-" without one).
counts() {
    [ -s "$1" ] || { echo "-"; return; }
    "$base_python" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET
n = {"passed": 0, "failed": 0, "skipped": 0}
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    tags = {child.tag for child in case}
    n["failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"] += 1
print(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped")
EOF
}

# One version's run: writes its table row to $row.
run_version() {
    local version="$1" venv="$2" row="$3" reports="$4" started=$SECONDS
    if ! make_venv "$version" "$venv"; then
        echo "| $version | torch did not install | - | - | - | - |" >"$row"
        return
    fi
    local py="$venv/bin/python"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"
    echo "== torch $version: pytest suite"
    (cd "$repo/python/tests" && timeout "${SS_TORCH_VERSIONS_TIMEOUT:-3600}" \
        "$py" -m pytest -q -p no:cacheprovider -rfE --junitxml="$reports/pytest.xml" "${deselect[@]}") || true
    local suite stock="-" ours="-" lost="-" source="not run" file_and_source
    suite="$(counts "$reports/pytest.xml")"
    if [ "$pytorch_tests" -eq 1 ]; then
        file_and_source="$(pytorch_test_file "$version" "$venv")"
        if [ -n "$file_and_source" ]; then
            source="${file_and_source#*$'\t'}"
            echo "== torch $version: PyTorch's test_multiprocessing.py ($source)"
            SS_TEST_PYTHON="$py" SS_PYTORCH_TESTS_KEEP="$reports" \
                bash "$repo/python/run_pytorch_tests.sh" "${file_and_source%%$'\t'*}" | tee "$reports/compare.txt" || true
            stock="$(counts "$reports/stock.xml")"
            ours="$(counts "$reports/enabled.xml")"
            lost="$(sed -n 's/^PASS STOCK BUT NOT WITH OURS: //p' "$reports/compare.txt")"
            lost="${lost:--}"
        else
            source="none at hand (no --pytorch-tests; GitHub not reachable)"
        fi
    fi
    local shown="$version"
    [ "$allow_untested" -eq 0 ] || shown="$version (allowed untested)"
    echo "| $shown | $suite | $stock | $ours | $lost | $source |" >"$row"
    local took=$((SECONDS - started))
    echo "== torch $version took $((took / 60)) min $((took % 60)) s"
}

header="| torch | pytest suite | test_multiprocessing.py stock | with enable() | pass stock, fail with enable() | test file |"
rule="|---|---|---|---|---|---|"
status=0
for version in "${versions[@]}"; do
    venv="$cache/torch-$version"
    row="$cache/results/torch-$version.md"
    reports="$cache/results/torch-$version"
    rm -rf "$reports" "$row"
    mkdir -p "$reports"
    run_version "$version" "$venv" "$row" "$reports" 2>&1 | tee "$cache/results/torch-$version.log" || true
    [ -f "$row" ] || echo "| $version | no result (see $cache/results/torch-$version.log) | - | - | - | - |" >"$row"
    echo "$header"
    echo "$rule"
    cat "$row"
    # A failure in the suite, or a test PyTorch passes that ours fails.
    grep -q " 0 failed, " <<<"$(cut -d'|' -f3 "$row")" || status=1
    case "$(cut -d'|' -f6 "$row" | tr -d ' ')" in "-" | 0) ;; *) status=1 ;; esac
    if [ "$delete_after" -eq 1 ]; then
        rm -rf "$venv"
    fi
done

echo
echo "== PyTorch versions ($(date -u +%F), $(uname -m), $("$base_python" --version 2>&1))"
echo "$header"
echo "$rule"
for version in "${versions[@]}"; do
    cat "$cache/results/torch-$version.md"
done
exit "$status"
