#!/usr/bin/env bash
# Session 14, final call B on merged main: the inference benchmark (bf16 and fp8) with the copy thread off, the same
# at 2K / 16K with it on (LAYERFLOW_COPY_THREAD: its cost at BS=1), then the per-kernel breakdown.
set -u
out=/tmp/fb; log=${OUT:-/tmp/out}/final-b.log
source benchmarks/session12/lib.sh
nvidia-smi -L | tee -a "$log"
bench() { step "$1" python3 -m layerflow.cli bench "${@:2}"; }
lengths="--timed-iters 10 --warmup-iters 3"
export LAYERFLOW_COPY_THREAD=0
bench 50 --seq-lens 2K,4K,8K,16K $lengths --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --out "$out/inference-h200.json"
bench 45 --seq-lens 2K,4K,8K,16K $lengths --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise --kv-cache-dtype fp8_e4m3 \
  --out "$out/inference-fp8_e4m3-h200.json"
export LAYERFLOW_COPY_THREAD=1
bench 30 --seq-lens 2K,16K $lengths --scenarios gpu_hit,cpu_hit_layerwise --out "$out/inference-copy-thread-h200.json"
bench 30 --seq-lens 2K,16K $lengths --scenarios gpu_hit,cpu_hit_layerwise --kv-cache-dtype fp8_e4m3 \
  --out "$out/inference-fp8-copy-thread-h200.json"
export LAYERFLOW_COPY_THREAD=0
table "$out"/inference-h200.json "$out"/inference-fp8_e4m3-h200.json "$out"/inference-copy-thread-h200.json \
  "$out"/inference-fp8-copy-thread-h200.json | grep -v "^$" | grep -v "^|---" | cut -c1-150 | head -60
step 40 python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K --out "$out/kernel-breakdown-h200.json"
grep -E "^\| (attention|GEMM|copy|other|LayerNorm|KV|SiLU|\*\*all)|device span" "$log" | tail -16
tar czf "$final/final-b.tgz" -C "$out" .
