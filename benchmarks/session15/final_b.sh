#!/usr/bin/env bash
# Session 15, final call B on merged main: the inference benchmark (bf16 and fp8) under the defaults (copy thread on)
# at every length, the same with the copy thread off at 2K / 16K, the per-kernel breakdown, and the attention kernels
# at 16K / 2K with 256 and 0 candidates beside the copy and GEMM ceilings (issue 18's figures); first the helpers'
# final scripts named on the command line (.session/<name>.sh of this tree).
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
step 40 python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K --out "$out/kernel-breakdown-h200.json"
grep -E "^\| (attention|GEMM|copy|other|LayerNorm|KV|SiLU|\*\*all)|device span" "$log" | tail -16
step 60 python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 256 0 --head-dim 256 --no-sweep \
  --no-gate --no-reference --iters 20 --out "$out/kernels-bs1-h200.json"
table "$out/kernels-bs1-h200.json" | head -20
tar czf "$final/final-b.tgz" -C "$out" .
