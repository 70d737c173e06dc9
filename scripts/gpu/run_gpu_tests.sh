#!/bin/bash
# Runs the GPU checks on a machine with a CUDA device, from the folder that
# scripts/gpu/stage.sh filled (binaries built elsewhere); log in $OUT/gpu.log
# (or ./gpu.log when OUT is unset).
cd "$(dirname "$0")"
export SS_TEST_PYTHON=python3 RUST_BACKTRACE=1
{
echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== cuda_gpu (Rust GPU tests)"
timeout 240 ./cuda_gpu --nocapture --test-threads=1; echo "rc=$?"
echo "== symm_cuda (CUDA symmetric memory: 2 and 4 ranks on one device)"
timeout 300 ./symm_cuda --nocapture --test-threads=1; echo "rc=$?"
echo "== bench symm_cuda (barrier, put/wait, rendezvous beside the bare driver calls)"
timeout 300 ./symm_cuda_bench; echo "rc=$?"
echo "== test_cuda (C API)"
LD_LIBRARY_PATH=$PWD timeout 60 ./test_cuda; echo "rc=$?"
echo "== test_cuda under ASan+UBSan (CUDA needs protect_shadow_gap=0)"
LD_LIBRARY_PATH=$PWD ASAN_OPTIONS=protect_shadow_gap=0 timeout 60 ./test_cuda_asan; echo "rc=$?"
echo "== C++ RAII tests (storage + CUDA round trip)"
LD_LIBRARY_PATH=$PWD SS_SHM_MANAGER=$PWD/ss_shm_manager timeout 60 ./test_storage_raii; echo "rc=$?"
LD_LIBRARY_PATH=$PWD timeout 60 ./test_raii; echo "rc=$?"
echo "== Go bindings (all tests, CUDA round trip included)"
SS_SHM_MANAGER=$PWD/ss_shm_manager GODEBUG=cgocheck=1 timeout 120 ./go_bindings.test -test.v -test.count=1 2>&1 | grep -E "^(=== RUN|--- |ok|PASS|FAIL)|skip" ; echo "rc=${PIPESTATUS[0]}"
echo "== lib tests (host backend etc.)"
timeout 120 ./lib_tests cuda:: ; echo "rc=$?"
echo "== bench cuda_ipc (run 1)"
timeout 200 ./cuda_ipc; echo "rc=$?"
echo "== bench cuda_ipc (run 2)"
timeout 200 ./cuda_ipc; echo "rc=$?"
echo "== /dev/shm after (cuda.shm.* are the driver's own)"
ls /dev/shm; echo "ours left: $(ls /dev/shm | grep -cE "^(torch_|ss_host_|ss_ctest)")"
} 2>&1 | tee "${OUT:-.}/gpu.log"
