#!/usr/bin/env bash
# The fp8 KV cache on one H200 (docs/fp8.md), in one bounded device call: its GPU tests, the quality gate on hstu-bench
# and DLRMv3 at 2K-16K, and the inference benchmark on fp8 pages beside bf16 ones. Results go to $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
log=$out/fp8-session.log
mkdir -p "$out"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; start=$(date +%s)
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $(( $(date +%s) - start ))s" | tee -a "$log"; }
nvidia-smi -L | tee -a "$log"
step 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/kernels/test_fp8_gpu.py \
     tests/runtime/test_engine_fp8_gpu.py --junitxml="$out/fp8-gpu-tests.xml"
step 120 python3 benchmarks/fp8_quality.py --out "$out/fp8-quality-hstu-bench-h200.json"
step 120 python3 benchmarks/fp8_quality.py --preset dlrmv3 --out "$out/fp8-quality-dlrmv3-h200.json"
for dtype in fp8_e4m3 auto; do
  step 110 python3 -m layerflow.cli bench --seq-lens 2K,4K,8K,16K --timed-iters 10 --warmup-iters 3 \
       --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --kv-cache-dtype "$dtype" --out "$out/inference-$dtype-h200.json"
done
tail -5 "$log"
