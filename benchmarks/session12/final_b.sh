#!/usr/bin/env bash
# Session 12, final call B on merged main: the per-kernel breakdown, the inference benchmark (bf16 and fp8, the
# host-phase profile), attention alone, then the helpers' final scripts named on the command line.
set -u
out=/tmp/fb; log=${OUT:-/tmp/out}/final-b.log
source benchmarks/session12/lib.sh
nvidia-smi -L | tee -a "$log"; git log --oneline -1 2>/dev/null | tee -a "$log"
step 40 python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K --out "$out/kernel-breakdown-h200.json"
grep -E "^\| (attention|GEMM|copy|other|LayerNorm|KV|SiLU|\*\*all)|device span" "$log" | tail -16
bench() { step "$1" python3 -m layerflow.cli bench "${@:2}"; }
lengths="--seq-lens 2K,4K,8K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise"
bench 45 $lengths --out "$out/inference-h200.json"
bench 40 $lengths --kv-cache-dtype fp8_e4m3 --out "$out/inference-fp8_e4m3-h200.json"
bench 25 --seq-lens 2K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit --profile \
  --out "$out/inference-profile-h200.json"
table "$out"/inference-h200.json "$out"/inference-fp8_e4m3-h200.json | grep -v "^$" | head -40
step 30 python3 benchmarks/kernels.py --batch 1 --history 2048 16384 --candidates 0 256 --head-dim 256 --no-sweep \
  --no-gate --no-reference --iters 20 --kernel triton auto --out "$out/kernels-bs1-h200.json"
grep -E "^\| (triton|gluon|auto)|copy|GEMM" "$log" | tail -10
tar czf "$final/final-b.tgz" -C "$out" .
helpers . "$@"
tar czf "$final/final-b.tgz" -C "$out" .
