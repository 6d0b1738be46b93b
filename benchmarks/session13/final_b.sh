#!/usr/bin/env bash
# Session 13, final call B on merged main: session 12's final B (breakdown, inference bf16/fp8 + profile, attention
# alone, the helpers' final scripts named on the command line), then the fp8 engine with LAYERFLOW_FP8_QK=fp8x2.
set -u
bash benchmarks/session12/final_b.sh "$@"
out=/tmp/fb; log=${OUT:-/tmp/out}/final-b.log
source benchmarks/session12/lib.sh
LAYERFLOW_FP8_QK=fp8x2 step 45 python3 -m layerflow.cli bench --seq-lens 2K,4K,8K,16K --timed-iters 10 \
  --warmup-iters 3 --scenarios gpu_hit,cpu_hit_layerwise --kv-cache-dtype fp8_e4m3 \
  --out "$out/inference-fp8x2-h200.json"
table "$out"/inference-fp8x2-h200.json | grep -v "^$" | head -14
tar czf "$final/final-b.tgz" -C "$out" .
