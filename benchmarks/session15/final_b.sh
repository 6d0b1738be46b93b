#!/usr/bin/env bash
# Session 15, final call B on merged main: the helpers' final scripts named on the command line (.session/<name>.sh of
# this tree), then the inference benchmark (bf16 and fp8) under the defaults (copy thread on) at every length and the
# same with the copy thread off at 2K / 16K. The GPU-hit kernels did not change this session: the per-kernel breakdown
# and the attention figures of session 14 stand (device time).
set -u
out=/tmp/fb; log=${OUT:-/tmp/out}/final-b.log
source benchmarks/session12/lib.sh
nvidia-smi -L | tee -a "$log"; git log --oneline -1 2>/dev/null | tee -a "$log"
bench() { step "$1" python3 -m layerflow.cli bench "${@:2}"; }
lengths="--timed-iters 10 --warmup-iters 3"
helpers . "$@"
unset LAYERFLOW_COPY_THREAD
bench 50 --seq-lens 2K,4K,8K,16K $lengths --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --out "$out/inference-h200.json"
bench 45 --seq-lens 2K,4K,8K,16K $lengths --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --kv-cache-dtype fp8_e4m3 \
  --out "$out/inference-fp8_e4m3-h200.json"
export LAYERFLOW_COPY_THREAD=0
bench 30 --seq-lens 2K,16K $lengths --scenarios gpu_hit,cpu_hit_layerwise --out "$out/inference-no-copy-thread-h200.json"
bench 30 --seq-lens 2K,16K $lengths --scenarios gpu_hit,cpu_hit_layerwise --kv-cache-dtype fp8_e4m3 \
  --out "$out/inference-fp8-no-copy-thread-h200.json"
unset LAYERFLOW_COPY_THREAD
table "$out"/inference-h200.json "$out"/inference-fp8_e4m3-h200.json "$out"/inference-no-copy-thread-h200.json \
  "$out"/inference-fp8-no-copy-thread-h200.json | grep -v "^$" | grep -v "^|---" | cut -c1-150 | head -60
tar czf "$final/final-b.tgz" -C "$out" .
