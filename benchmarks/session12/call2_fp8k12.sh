#!/usr/bin/env bash
# fp8k12 round 2: the fp8 Gluon kernel's new defaults for bf16 models (the "bits" decode, the "rows" split table, the
# self tiles on the last split) checked, and ablations of those defaults (decode, dots or code copies skipped: timing
# only, wrong numbers) telling where a 16K/256 tile's time goes, beside bf16 Gluon and the fp8 kernel with the "cvt"
# decode on the same splits.
# Phase A (parallel, <= 32 s): the changed GPU tests; one process per variant compiling it (attention alone at both
#   shapes; engines at the 320-token bucket, 16K). Phase B (<= 20 s): ONE process, attention alone, 16K/256 first then
#   2K/256 if started within 9 s, 6 variants' CUDA graphs alternated in 5 blocks. Phase C (the rest, <= 73 s in all):
#   ONE process, GPU hits at 16K of a bf16 engine, an fp8 engine on the new defaults ("fp8 main") and one on the paths
#   before them ("fp8 old": bucket split count, self tiles on split 0, cvt decode), alternated.
set -u
OUT=${OUT:-/tmp/out}; W=$OUT/fp8k12; mkdir -p $W
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
START=$SECONDS
t() { echo $((SECONDS - START)); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | head -1
git log -1 --format=%h 2>/dev/null
slug() { echo "${1// /_}"; }
ATT="bf16,fp8 main,fp8 cvt,fp8 no-decode,fp8 no-dots,fp8 no-copies"
ENG="bf16,fp8 main,fp8 old"

echo "=== phase A t=$(t): GPU tests and compiles (parallel)"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")
( timeout 32 python3 -m pytest -v -m gpu -p no:cacheprovider $XDIST tests/kernels/test_gluon_fp8_paths_gpu.py \
    tests/kernels/test_gluon_fp8_gpu.py -k "graph_replays or auto_takes or bit_move or rows_split" \
    > $W/gpu-tests.log 2>&1; echo "rc=$?" >> $W/gpu-tests.log ) &
TESTS=$!
WARM=()
IFS=, read -ra ATT_LIST <<< "$ATT"
for v in "${ATT_LIST[@]}"; do
  ( timeout 30 python3 benchmarks/fp8_ab.py attention --warm "$v" > "$W/warm-att-$(slug "$v").log" 2>&1;
    echo "rc=$?" >> "$W/warm-att-$(slug "$v").log" ) &
  WARM+=($!)
done
IFS=, read -ra ENG_LIST <<< "$ENG"
for v in "${ENG_LIST[@]}"; do
  ( timeout 30 python3 benchmarks/fp8_ab.py engine --seq-lens 16K --warm "$v" > "$W/warm-eng-$(slug "$v").log" 2>&1;
    echo "rc=$?" >> "$W/warm-eng-$(slug "$v").log" ) &
  WARM+=($!)
done
wait ${WARM[@]}
echo "=== compiles done t=$(t)"
for f in $W/warm-*.log; do
  grep -q "^rc=0" $f || echo "# $(basename $f .log): $(tail -n 1 $f) $(grep -E "Error|error:" $f | tail -n 1 | cut -c1-200)"
done
wait $TESTS
echo "=== GPU tests t=$(t): $(tail -n 2 $W/gpu-tests.log | head -n 1 | cut -c1-120)"
grep -q "^rc=0" $W/gpu-tests.log && echo "GPU TESTS: PASS" || { echo "GPU TESTS: FAIL/TIMEOUT";
  grep -oE "(FAILED|ERROR) tests/[^ ]+" $W/gpu-tests.log | sed 's#tests/kernels/##' | sort -u | head -8;
  grep -E "^E  " $W/gpu-tests.log | head -6 | cut -c1-200; }

BUILT=""      # a variant whose warm-up failed or hung stays out of the timed process
for v in "${ATT_LIST[@]}"; do grep -q "^rc=0" "$W/warm-att-$(slug "$v").log" && BUILT="${BUILT:+$BUILT,}$v"; done
echo "=== phase B t=$(t): attention alone: $BUILT"
timeout 20 python3 benchmarks/fp8_ab.py attention --variants "$BUILT" --blocks 5 --iters 10 --seconds 9 \
  --out $W/attention.json 2> $W/attention.err || { echo "attention rc=$?"; tail -n 2 $W/attention.err | cut -c1-200; }

echo "=== phase C t=$(t): engine GPU hits at 16K"
ENG_BUILT=""
for v in "${ENG_LIST[@]}"; do grep -q "^rc=0" "$W/warm-eng-$(slug "$v").log" && ENG_BUILT="${ENG_BUILT:+$ENG_BUILT,}$v"; done
LEFT=$((73 - (SECONDS - START))); LEFT=$((LEFT < 1 ? 1 : LEFT))
timeout $LEFT python3 benchmarks/fp8_ab.py engine --variants "$ENG_BUILT" --seq-lens 16K --blocks 3 --requests 12 \
  --profiled 2 --out $W/engine.json 2> $W/engine.err || { echo "engine rc=$?"; tail -n 2 $W/engine.err | cut -c1-200; }
echo "=== end t=$(t)"
tar -czf $OUT/fp8k12.tgz -C $OUT fp8k12 2>/dev/null
