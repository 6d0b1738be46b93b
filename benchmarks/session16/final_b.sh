#!/usr/bin/env bash
# Session 16, final call B on merged main: the helpers' final scripts named on the command line (.session/<name>.sh
# of this tree), then the inference benchmark (bf16 and fp8) under the defaults at every length.
set -u
out=/tmp/fb; log=${OUT:-/tmp/out}/final-b.log
source benchmarks/session12/lib.sh
nvidia-smi -L | tee -a "$log"; git log --oneline -1 2>/dev/null | tee -a "$log"
bench() { step "$1" python3 -m layerflow.cli bench "${@:2}"; }
lengths="--timed-iters 10 --warmup-iters 3"
helpers . "$@"
bench 50 --seq-lens 2K,4K,8K,16K $lengths --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --out "$out/inference-h200.json"
bench 50 --seq-lens 2K,4K,8K,16K $lengths --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --kv-cache-dtype fp8_e4m3 \
  --out "$out/inference-fp8_e4m3-h200.json"
table "$out"/inference-h200.json "$out"/inference-fp8_e4m3-h200.json | grep -v "^$" | grep -v "^|---" | cut -c1-150 | head -40
tar czf "$final/final-b.tgz" -C "$out" .
