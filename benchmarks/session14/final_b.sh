#!/usr/bin/env bash
# Session 14, final call B on merged main: session 12's final B (breakdown, inference bf16/fp8 + profile, attention
# alone, the helpers' final scripts named on the command line), then CPU hit + layerwise and the GPU hit with the
# copy thread off (LAYERFLOW_COPY_THREAD=0) beside the default's, for the thread's cost at BS=1.
set -u
bash benchmarks/session12/final_b.sh "$@"
out=/tmp/fb; log=${OUT:-/tmp/out}/final-b.log
source benchmarks/session12/lib.sh
for thread in 0 1; do
  LAYERFLOW_COPY_THREAD=$thread step 40 python3 -m layerflow.cli bench --seq-lens 2K,16K --timed-iters 10 \
    --warmup-iters 3 --scenarios gpu_hit,cpu_hit_layerwise --out "$out/inference-copy-thread-$thread-h200.json"
done
table "$out"/inference-copy-thread-*-h200.json | grep -v "^$" | head -24
tar czf "$final/final-b.tgz" -C "$out" .
