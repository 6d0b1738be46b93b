#!/usr/bin/env bash
# Session 12, verify call: the fp8 GPU files after the split refill's removal and the fixed rows-split test, plus the
# runtime GPU tests of the merged host paths and serving, verbose.
set -u
out=/tmp/v; log=${OUT:-/tmp/out}/verify-b.log
source benchmarks/session12/lib.sh
nvidia-smi -L | tee -a "$log"
step 200 python3 -m pytest -m gpu -v -rfE --tb=short -p no:cacheprovider --timeout 90 -n 8 --dist load -W ignore \
  tests/kernels/test_gluon_fp8_gpu.py tests/kernels/test_gluon_fp8_paths_gpu.py tests/runtime/test_engine_fp8_gpu.py \
  tests/runtime/test_kernel_choices_gpu.py tests/runtime/test_host_paths_gpu.py tests/serving/test_serving_gpu.py
grep -E "(PASSED|FAILED|ERROR|SKIPPED) tests" "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | awk '{print $1}' | sort | uniq -c
grep -E "(FAILED|ERROR) tests" "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | cut -c1-200 | sort -u | head
grep -E "^E  " "$log" | cut -c1-200 | sort | uniq -c | sort -rn | head -8
grep -E "^=+ .*(passed|failed)" "$log" | tail -2
