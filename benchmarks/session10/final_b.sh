#!/usr/bin/env bash
# Session 10, final H200 call B on merged main: attention alone (bf16), then
# the helpers' A/B scripts named on the command line (.session/<branch>.sh, run on this tree, <= 60 s each).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 PYTHONPATH=.
final=${OUT:-/tmp/out}; out=/tmp/fb; mkdir -p "$out" "$final"; log=$final/final-b.log
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; local t0=$SECONDS
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0))s" | tee -a "$log"; }
nvidia-smi -L | tee -a "$log"; cat .session/HEAD 2>/dev/null | tee -a "$log"
step 30 python3 benchmarks/kernels.py --batch 1 --history 2048 16384 --candidates 0 256 --head-dim 256 --no-sweep \
  --no-gate --no-reference --iters 20 --kernel triton auto --out "$out/kernels-bs1-h200.json"
grep -E "^\| (triton|gluon|auto)|copy|GEMM" "$log" | tail -12
tar czf "$final/final-b.tgz" -C "$out" .
for b in "$@"; do
  echo "##### branch $b"
  ( mkdir -p "$out/$b" && OUT="$out/$b" timeout 65 bash ".session/$b.sh" ) 2>&1 | \
    tee "$out/$b.stdout" | tail -45
done
tar czf "$final/final-b.tgz" -C "$out" .
