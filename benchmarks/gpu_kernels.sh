#!/usr/bin/env bash
# Kernel GPU tests and microbenchmark on one CUDA GPU; results go to ${OUT:-benchmarks/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
PYTHONPATH=. python3 -m pytest tests/test_kernels.py tests/test_kernels_gpu.py -q 2>&1 | tee "$out/gpu_tests.log"
PYTHONPATH=. python3 benchmarks/kernels.py --out "$out/kernels-h200.json"
