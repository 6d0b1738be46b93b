#!/usr/bin/env bash
# host13 final (<= 60 s, runs on merged main): 1. the GPU test (defaults: slab + native packer + reap-after score
# bitwise like batch staging). 2. gpu_hit_ab, the default variant, 2K then 16K, 3 alternated blocks x 15, walls +
# host phases (the figure docs/performance.md quotes for the native packer).
set -u
OUT=${OUT:-/tmp/out}; D=$OUT/host13; mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
START=$(date +%s); left() { echo $(( $1 - ($(date +%s) - START) )); }
echo "=== host13 tests"
timeout 22 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_staging_gpu.py > "$D/gpu-tests.log" 2>&1
rc=$?; echo "GPU tests: $([ $rc -eq 0 ] && echo PASS || echo "FAIL rc=$rc") ($(tail -1 "$D/gpu-tests.log"))"
[ $rc -eq 0 ] || grep -E "^(FAILED|ERROR|E  )" "$D/gpu-tests.log" | head -5
T=$(left 57)
if [ "$T" -ge 15 ]; then
  echo "=== gpu_hit_ab default (native) (limit ${T}s)"
  timeout "$T" python3 benchmarks/gpu_hit_ab.py --seq-lens 2K,16K --variant native=320 --blocks 3 --requests 15 \
      --profiled 3 --phases --phase-blocks 2 --out "$D/default.json" > "$D/default.stdout" 2>&1
  echo "rc=$?"
  grep -E "^(### GPU|\| (variant|host ms|native) |  native:|# .*FAILED|Traceback|[A-Za-z]*Error)" "$D/default.stdout" | cut -c1-150 | head -14
fi
echo "total $(( $(date +%s) - START )) s"
