#!/usr/bin/env bash
# Session 10, lead's call B: the ping-pong Gluon variant and the loader's register count, correctness then timing.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
final=${OUT:-/tmp/out}; mkdir -p "$final"; log=$final/s10b.log
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; local t0=$SECONDS
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0))s" | tee -a "$log"; }
nvidia-smi -L | tee -a "$log"; git log --oneline -1 | tee -a "$log"
step 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_attention_gpu.py -k "wt" -x
grep -E "passed|failed|Error|error" "$log" | tail -8
step 200 python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 256 0 --head-dim 256 --no-sweep \
  --no-gate --no-reference --iters 20 --kernel gluon --gluon-tiling 64x2:ws:tma:tanh 64x2:ws:tma:tanh:r96 64x2:ws:tma:tanh:r96:wt 64x2:ws:tma:tanh:wt \
  64x2:ws:tma:tanh:r88:wt 64x2:pp:m128:tma:tanh:wt --out "$final/k-wt.json"
grep -E "^\| (gluon|triton|auto)|copy|GEMM" "$log" | tail -30
