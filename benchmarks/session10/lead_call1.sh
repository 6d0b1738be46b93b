#!/usr/bin/env bash
# Session 10, lead's part of call 1: unmasked whole tiles (new D=256 default) and 16-bit split partials.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
final=${OUT:-/tmp/out}; mkdir -p "$final"; log=$final/lead1.log
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; local t0=$SECONDS
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0))s" | tee -a "$log"; }
step 110 env LAYERFLOW_ATTENTION_PARTIALS=fp16 python3 -m pytest -q -p no:cacheprovider -m gpu -x \
  tests/kernels/test_kernels_gpu.py tests/runtime/test_engine_gpu.py tests/kernels/test_gluon_attention_gpu.py -k "not variants"
grep -E "passed|failed|FAILED|Error" "$log" | tail -6
for p in fp32 fp16; do
  step 40 env LAYERFLOW_ATTENTION_PARTIALS=$p python3 benchmarks/kernels.py --batch 1 --history 16384 2048 \
    --candidates 256 0 --head-dim 256 --no-sweep --no-gate --no-reference --iters 20 --kernel gluon \
    --gluon-tiling 64x2:ws:tma:tanh 64x2:ws:tma:tanh:wt --out "$final/k-$p.json"
  grep -E "^\| gluon" "$log" | tail -8
done
for p in fp32 fp16; do
  step 45 env LAYERFLOW_ATTENTION_PARTIALS=$p python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K \
    --out "$final/kb-$p.json"
  grep -E "^\| (attention|GEMM|LayerNorm|SiLU|\*\*all)|device span" "$log" | tail -12
done
step 90 python3 benchmarks/session10/partials_error.py --history-lens 2048 16384 --users 8 --partials fp16 bf16 \
  --out "$final/partials-error.json"
grep -E "^(fp16|bf16) " "$log" | tail -2
