#!/usr/bin/env bash
# Builds the Python package's wheel as users get it: abi3 (CPython 3.9 and
# later), x86-64 Linux, manylinux2014 (glibc 2.17 and later), linked through
# zig against glibc 2.17 so the tag holds whatever glibc builds it. The wheel
# carries `ssctl` and `ss_shm_manager` (built for the same glibc) as scripts,
# the type stubs, py.typed and both licenses. `auditwheel show` must agree
# with the tag. Prints the wheel's path, size and tag; the last line of
# stdout is the path alone.
#
#   bash scripts/build_wheel.sh [OUT_DIR]     (default: $CARGO_TARGET_DIR/wheels)
#
# The tools (maturin, zig, cargo-zigbuild, auditwheel, pinned) go into a
# virtual environment of this script's own, $CARGO_TARGET_DIR/wheel-venv;
# Rust builds into $CARGO_TARGET_DIR/wheel-build (bins/ and python/: the two
# builds set different compiler flags, so one folder would rebuild each time).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
me="scripts/build_wheel.sh"
target="${CARGO_TARGET_DIR:-$root/target}"
out="${1:-$target/wheels}"
venv="$target/wheel-venv"
build="$target/wheel-build"
triple=x86_64-unknown-linux-gnu
glibc=2.17
tag=manylinux_2_17_x86_64
tools=("maturin==1.16.0" "ziglang==0.17.1" "cargo-zigbuild==0.24.1" "auditwheel==6.8.2")

if [ "$(uname -m)" != x86_64 ]; then
    echo "$me: builds the x86-64 Linux wheel only (this machine is $(uname -m))" >&2
    exit 2
fi
installed="$("$venv/bin/python" -m pip freeze 2>/dev/null || true)"
missing=0
for tool in "${tools[@]}"; do
    grep -qx "$tool" <<<"$installed" || missing=1
done
if [ "$missing" -eq 1 ]; then
    echo "== $me: installing ${tools[*]} into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${tools[@]}"
fi
# maturin and cargo-zigbuild run zig as `python -m ziglang` from PATH.
export PATH="$venv/bin:$PATH"
# What users install carries no debug info (the crates' release profile
# keeps line tables for backtraces here).
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols

echo "== $me: ssctl and ss_shm_manager for glibc $glibc (cargo zigbuild)"
CARGO_TARGET_DIR="$build/bins" cargo zigbuild --release --locked --target "$triple.$glibc" --bin ssctl --bin ss_shm_manager

# maturin puts python/<module-name>.data/scripts/* into the wheel's .data/scripts,
# which pip installs beside the environment's python. The folder exists only
# while this script runs (python/run_tests.sh installs without it).
data="$root/python/storage_sharing._native.data"
rm -rf "$data"
trap 'rm -rf "$data"' EXIT
mkdir -p "$data/scripts"
cp "$build/bins/$triple/release/ssctl" "$build/bins/$triple/release/ss_shm_manager" "$data/scripts/"

echo "== $me: the wheel (maturin --zig --compatibility manylinux2014)"
mkdir -p "$out"
rm -f "$out"/storage_sharing-*.whl
CARGO_TARGET_DIR="$build/python" maturin build --release --locked --zig --compatibility manylinux2014 --target "$triple" \
    --manifest-path python/Cargo.toml --out "$out"
wheels=("$out"/storage_sharing-*.whl)
if [ ${#wheels[@]} -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
    echo "$me: expected one wheel in $out, found: ${wheels[*]}" >&2
    exit 1
fi
wheel="${wheels[0]}"

echo "== $me: auditwheel show"
report="$(auditwheel show "$wheel")"
echo "$report"
if ! tr -s ' \n' ' ' <<<"$report" | grep -q "consistent with the following platform tag: \"$tag\""; then
    echo "$me: auditwheel does not find $wheel consistent with $tag" >&2
    exit 1
fi
python3 - "$wheel" <<'EOF'
# What the wheel must carry besides the package's modules.
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
want = {
    "the native module": lambda n: n.startswith("storage_sharing/_native.") and n.endswith(".so"),
    "ssctl": lambda n: n.endswith(".data/scripts/ssctl"),
    "ss_shm_manager": lambda n: n.endswith(".data/scripts/ss_shm_manager"),
    "the type stubs": lambda n: n == "storage_sharing/_native.pyi",
    "py.typed": lambda n: n == "storage_sharing/py.typed",
    "LICENSE-MIT": lambda n: n.endswith(".dist-info/licenses/LICENSE-MIT"),
    "LICENSE-APACHE": lambda n: n.endswith(".dist-info/licenses/LICENSE-APACHE"),
}
missing = [what for what, found in want.items() if not any(map(found, names))]
if missing:
    sys.exit(f"scripts/build_wheel.sh: the wheel lacks {', '.join(missing)}")
EOF

size=$(stat -c %s "$wheel")
echo "== $me: wheel $wheel"
echo "   size $((size / 1024)) KiB ($size bytes), tag $(basename "$wheel" .whl | cut -d- -f3-)"
echo "$wheel"
