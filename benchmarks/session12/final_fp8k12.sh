#!/usr/bin/env bash
# Record of the final call B (session 12) on e539313; the "fp8 split" variant it timed was removed after it (c0c707b).
# fp8k12 final (session 12, round 3), on merged main: the fp8 Gluon kernel's GPU tests (the paths file: bit-move
# decode, split refill bit for bit against the whole refill, rows split table with self tiles last; the graph
# replays over bits / cvt / bits+split refill), then ONE process timing attention alone (BS=1, D=256, H=4,
# 64 appended + 256 candidates, L2 rotated, split sum included) of bf16 Gluon, the fp8 default ("fp8 main": bits
# decode, rows splits, self tiles last, whole refill) and the fp8 split refill ("fp8 split",
# LAYERFLOW_FP8_SPLIT_REFILL=1), 5 alternated blocks, 16K/256 first and 2K/256 if started in time.
# Phase A (parallel, <= 30 s): tests; one compile process per variant. Phase B (<= 22 s): the timed process.
set -u
OUT=${OUT:-/tmp/out}; W=$OUT/fp8k12; mkdir -p $W
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
START=$SECONDS
t() { echo $((SECONDS - START)); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | head -1
git log -1 --format=%h 2>/dev/null
slug() { echo "${1// /_}"; }
ATT="bf16,fp8 main,fp8 split"

echo "=== phase A t=$(t): GPU tests and compiles (parallel)"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")
( timeout 30 python3 -m pytest -v -m gpu -p no:cacheprovider $XDIST tests/kernels/test_gluon_fp8_paths_gpu.py \
    tests/kernels/test_gluon_fp8_gpu.py -k "graph_replays or bit_move or rows_split or split_refill" \
    > $W/gpu-tests.log 2>&1; echo "rc=$?" >> $W/gpu-tests.log ) &
TESTS=$!
WARM=()
IFS=, read -ra ATT_LIST <<< "$ATT"
for v in "${ATT_LIST[@]}"; do
  ( timeout 28 python3 benchmarks/fp8_ab.py attention --warm "$v" > "$W/warm-att-$(slug "$v").log" 2>&1;
    echo "rc=$?" >> "$W/warm-att-$(slug "$v").log" ) &
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
LEFT=$((56 - (SECONDS - START))); LEFT=$((LEFT < 5 ? 5 : LEFT)); LEFT=$((LEFT > 22 ? 22 : LEFT))
echo "=== phase B t=$(t): attention alone: $BUILT (<= $LEFT s)"
timeout $LEFT python3 benchmarks/fp8_ab.py attention --variants "$BUILT" --blocks 5 --iters 10 \
  --seconds $((LEFT / 2)) --out $W/attention.json 2> $W/attention.err \
  || { echo "attention rc=$?"; tail -n 2 $W/attention.err | cut -c1-200; }
echo "=== end t=$(t)"
tar -czf $OUT/fp8k12.tgz -C $OUT fp8k12 2>/dev/null
