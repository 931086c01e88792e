#!/usr/bin/env bash
# Every GPU check of fastdecode in one go (a machine with an NVIDIA GPU, torch with CUDA, transformers):
# the CUDA tests and the float32 parity suite on the GPU side by side, then benchmarks/cuda_speed.py alone.
# Logs go to $OUT (default ./cuda-logs).   bash benchmarks/cuda_checks.sh [cuda_speed.py arguments]
set -u
OUT=${OUT:-cuda-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=16
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -m fastdecode.layers.kernels > "$OUT/kernels.log" 2>&1 &   # the CPU kernels, built once for the CPU-side tests
start=$(date +%s)
timeout "${CUDA_TESTS_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts= --timeout 60 -rfEP \
    tests/cuda > "$OUT/cuda_tests.log" 2>&1 &
tests=$!
workers=$($PY -c "import xdist" 2>/dev/null && echo "-n ${PARITY_WORKERS:-6}")  # pytest-xdist where installed
timeout "${PARITY_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts= --timeout 60 -rfE $workers \
    tests/parity --device cuda > "$OUT/parity_cuda.log" 2>&1 &
parity=$!
wait $tests; echo "tests/cuda exit $? ($(( $(date +%s) - start )) s)"; tail -25 "$OUT/cuda_tests.log"
wait $parity; echo "parity --device cuda exit $? ($(( $(date +%s) - start )) s)"; tail -15 "$OUT/parity_cuda.log"
timeout "${BENCH_TIMEOUT:-240}" $PY benchmarks/cuda_speed.py "$@" 2>&1 | tee "$OUT/cuda_speed.log"
echo "total $(( $(date +%s) - start )) s"
