#!/bin/bash
# Runs the GPU checks on a machine with a CUDA device, from the folder that
# scripts/gpu/stage.sh filled (binaries built elsewhere); log in $OUT/gpu.log
# (or ./gpu.log when OUT is unset). Most important first, each bounded.
#   run_gpu_tests.sh [all|base|weights]
# base: everything up to the weights pools (about 2 minutes on an H200);
# weights: the weights-pool tests and benchmark (storage_sharing.cuda; up to
# 9 minutes, bounded); all (default): both, which may not fit one
# 10-minute device call: then run base and weights in two calls.
cd "$(dirname "$0")"
part="${1:-all}"
case "$part" in all|base|weights) ;; *) echo "usage: $0 [all|base|weights]" >&2; exit 2 ;; esac
export SS_TEST_PYTHON=python3 RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
# ptxas, where the toolkit is installed, checks the embedded PTX too.
export PATH=$PATH:/usr/local/cuda/bin
{
echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if [ "$part" != weights ]; then
echo "== symm_cuda (CUDA symmetric memory: 2 and 4 ranks on one device)"
timeout 150 ./symm_cuda --nocapture --test-threads=1; echo "rc=$?"
echo "== cuda_gpu (Rust GPU tests, PyTorch interop included)"
timeout 120 ./cuda_gpu --nocapture --test-threads=1; echo "rc=$?"
echo "== bench symm_cuda (barrier, put/wait, alloc, rendezvous beside the bare driver calls)"
timeout 90 ./symm_cuda_bench; echo "rc=$?"
echo "== bench symm_cuda_torch (the same operations through PyTorch's symmetric memory)"
timeout 90 python3 symm_cuda_torch.py; echo "rc=$?"
echo "== test_cuda (C API)"
LD_LIBRARY_PATH=$PWD timeout 30 ./test_cuda; echo "rc=$?"
echo "== test_cuda under ASan+UBSan (CUDA needs protect_shadow_gap=0)"
LD_LIBRARY_PATH=$PWD ASAN_OPTIONS=protect_shadow_gap=0 timeout 30 ./test_cuda_asan; echo "rc=$?"
echo "== C++ RAII tests (storage + CUDA round trip)"
LD_LIBRARY_PATH=$PWD SS_SHM_MANAGER=$PWD/ss_shm_manager timeout 30 ./test_storage_raii; echo "rc=$?"
LD_LIBRARY_PATH=$PWD timeout 30 ./test_raii; echo "rc=$?"
echo "== Go bindings (all tests, CUDA round trip included)"
SS_SHM_MANAGER=$PWD/ss_shm_manager GODEBUG=cgocheck=1 timeout 45 ./go_bindings.test -test.v -test.count=1 2>&1 | grep -E "^(--- |ok|PASS|FAIL)|skip|panic" ; echo "rc=${PIPESTATUS[0]}"
echo "== lib tests (host backend etc.)"
timeout 45 ./lib_tests cuda:: 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"
echo "== bench cuda_ipc"
timeout 60 ./cuda_ipc; echo "rc=$?"
# Two ranks on one device take turns on it (the driver time-slices between
# processes' contexts), so a barrier there costs a time slice. Under MPS
# their kernels run side by side, as ranks on separate devices do.
if command -v nvidia-cuda-mps-control >/dev/null; then
    echo "== under MPS: bench symm_cuda, then the symm_cuda tests"
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    if nvidia-cuda-mps-control -d; then
        sleep 1
        timeout 60 ./symm_cuda_bench; echo "rc=$?"
        timeout 60 python3 symm_cuda_torch.py; echo "rc=$?"
        timeout 90 ./symm_cuda --test-threads=1 2>&1 | grep -E "^test |test result|panicked|per barrier"; echo "rc=${PIPESTATUS[0]}"
        echo quit | nvidia-cuda-mps-control
    else
        echo "the MPS daemon did not start: the MPS runs are skipped"
    fi
else
    echo "== no nvidia-cuda-mps-control: the MPS runs are skipped"
fi
fi
if [ "$part" != base ]; then
    # The Python package staged in py/ (nothing installed on this machine).
    echo "== cuda_weights_gpu (weights pools: 2 and 4 processes, both kinds, stock opener, updates, kill -9)"
    PYTHONPATH=$PWD/py timeout 300 python3 cuda_weights_gpu.py --stock-opener "$PWD/open_with_stock_pytorch.py"; echo "rc=$?"
    echo "== bench cuda_weights (1.5B, and 8B if memory allows: four ways)"
    PYTHONPATH=$PWD/py timeout 300 python3 cuda_weights.py --iters 3; echo "rc=$?"
fi
echo "== /dev/shm after (cuda.shm.* are the driver's own)"
ls /dev/shm; echo "ours left: $(ls /dev/shm | grep -cE "^(torch_|ss_host_|ss_ctest)")"
} 2>&1 | tee "${OUT:-.}/gpu.log"
