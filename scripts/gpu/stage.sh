#!/usr/bin/env bash
# Builds everything the GPU checks run and copies it, stripped, into one
# folder (default .gpu/, git-ignored) that can be carried to a machine with a
# CUDA device and no Rust or Go toolchain; there: bash .gpu/run_gpu_tests.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${1:-.gpu}"
target="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

exe() { # the executable cargo reports for a target, e.g. "tests/cuda/ipc_on_a_device.rs"
    # (cargo prints the path relative to the workspace, or absolute)
    local path
    path=$(grep -F "Executable $1 (" | sed -E 's/.*\((.*)\)$/\1/' | head -1)
    case "$path" in /*) echo "$path" ;; "") echo "no executable for $1" >&2; return 1 ;; *) echo "$PWD/$path" ;; esac
}
tests=$(cargo test --release --no-run 2>&1)
bench=$(cargo bench --bench cuda_ipc --no-run 2>&1)
symm_bench=$(cargo bench --bench symm_cuda --no-run 2>&1)
cp "$(echo "$tests" | exe "tests/cuda/ipc_on_a_device.rs")" "$dest/cuda_gpu"
cp "$(echo "$tests" | exe "tests/symm/cuda_backend_across_processes.rs")" "$dest/symm_cuda"
cp "$(echo "$symm_bench" | exe "benches/symm_cuda.rs")" "$dest/symm_cuda_bench"
cp "$(echo "$tests" | exe "unittests src/lib.rs")" "$dest/lib_tests"
cp "$(echo "$bench" | exe "benches/cuda_ipc.rs")" "$dest/cuda_ipc"
cargo build --release --lib --bins
cp "$target/release/libstorage_sharing.so" "$dest/libstorage_sharing.so.0"
cp "$target/release/ss_shm_manager" "$dest/"

for variant in plain asan; do
    build="$target/ctests-$variant"
    cmake -S ctests -B "$build" -DSS_LIB_DIR="$target/release" \
        -DSS_SANITIZE=$([ $variant = asan ] && echo ON || echo OFF) >/dev/null
    cmake --build "$build" -j2 >/dev/null
done
cp "$target/ctests-plain/test_cuda" "$target/ctests-plain/test_storage_raii" "$target/ctests-plain/test_raii" "$dest/"
cp "$target/ctests-asan/test_cuda" "$dest/test_cuda_asan"

if command -v go >/dev/null; then
    # A fixed prefix and a build cache of our own: go's cache keeps the cgo
    # package with the -L folder it was built against, and a removed
    # temporary prefix failed the next link ("cannot find -lstorage_sharing").
    prefix="$target/gpu-stage-prefix"
    export GOCACHE="$target/gpu-stage-go-cache"
    rm -rf "$prefix"
    cmake -S . -B "$prefix/build" -DSS_PREBUILT_DIR="$target/release" >/dev/null
    cmake --install "$prefix/build" --prefix "$prefix/p" >/dev/null
    pc=$(dirname "$(find "$prefix/p" -name storage_sharing.pc)")
    (cd bindings/go && PKG_CONFIG_PATH="$pc" CGO_LDFLAGS='-Wl,-rpath,$ORIGIN' go test -c -o "$dest/go_bindings.test" .)
fi
# Stripped, the folder fits one device call's carry (56 MB -> 18 MB).
strip --strip-debug "$dest"/cuda_gpu "$dest"/symm_cuda "$dest"/symm_cuda_bench "$dest"/lib_tests "$dest"/cuda_ipc \
    "$dest"/libstorage_sharing.so.0 "$dest"/ss_shm_manager
cp scripts/gpu/run_gpu_tests.sh benches/symm_cuda_torch.py "$dest/"

# The Python package (abi3, any CPython >= 3.9) for the weights-pool tests
# and benchmark, unpacked into py/ (run_gpu_tests.sh puts it on PYTHONPATH:
# nothing is installed there). Built as python/run_tests.sh builds it.
py="${SS_TEST_PYTHON:-python3}"
rm -rf "$dest/py" "$target/gpu-stage-wheel"
CARGO_TARGET_DIR="$target/python" "$py" -m pip wheel --quiet --no-deps -w "$target/gpu-stage-wheel" python/ >/dev/null
"$py" -m zipfile -e "$(ls "$target"/gpu-stage-wheel/storage_sharing-*.whl | head -1)" "$dest/py"
strip --strip-debug "$dest"/py/storage_sharing/_native*.so
cp scripts/gpu/cuda_weights_gpu.py python/benchmarks/cuda_weights.py examples/python/open_with_stock_pytorch.py "$dest/"
du -sh "$dest"
