#!/usr/bin/env bash
# fp8v14 round 2, mid-round: (1) GPU test of the new V dot on e4m3 MMAs (tests/kernels/test_gluon_fp8_pv_gpu.py:
# Fp8Tiling.pv "fp8" over transposed V pages against the torch reference of its numerics, ragged batch with NaN codes
# in unwritten page slots, BS=1 16K at 256 / 0 candidates), (2) attention alone at 16K/256 then 2K/256, bf16 /
# fp8 main (now fp8x2 Q K^T over e4m3 pages) / fp8 pv8 (fp8x2 + the V dot on e4m3 MMAs), 3 alternated blocks, L2
# rotated (and fp8 pv8 c2: two code slots), with each fp8 output's relative difference from fp8 main and bf16. <= 90 s.
set -u
OUT=${OUT:-/tmp/out}; W=$OUT/fp8v14; mkdir -p $W
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
START=$SECONDS
t() { echo $((SECONDS - START)); }
echo "## fp8v14 mid $(git log -1 --format=%h 2>/dev/null) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
VARIANTS="bf16,fp8 main,fp8 pv8,fp8 pv8 c2"
( timeout 50 python3 -m pytest -x -m gpu -q -p no:cacheprovider tests/kernels/test_gluon_fp8_pv_gpu.py \
    > $W/gpu-tests-pv.log 2>&1; echo "rc=$?" >> $W/gpu-tests-pv.log ) &
TESTS=$!
WARM=()
IFS=, read -ra LIST <<< "$VARIANTS"
for v in "${LIST[@]}"; do
  ( timeout 45 python3 benchmarks/fp8_ab.py attention --warm "$v" > "$W/warm-${v// /_}.log" 2>&1;
    echo "rc=$?" >> "$W/warm-${v// /_}.log" ) &
  WARM+=($!)
done
wait ${WARM[@]}
BUILT=""
for v in "${LIST[@]}"; do
  f="$W/warm-${v// /_}.log"
  if grep -q "^rc=0" "$f"; then BUILT="${BUILT:+$BUILT,}$v"
  else echo "# warm $v: $(tail -n 1 $f) $(grep -E "Error|error:" $f | tail -n 2 | cut -c1-220)"; fi
done
echo "=== warm done t=$(t): $BUILT"
wait $TESTS
f=$W/gpu-tests-pv.log
sum=$(grep -E "[0-9]+ (passed|failed|error|skipped)" $f | tail -n 1 | tr -d '=' | cut -c1-90)
if grep -q "^rc=0" $f; then echo "GPU TESTS pv: PASS ($sum)"
else echo "GPU TESTS pv: FAIL/TIMEOUT ($(tail -n 1 $f); $sum)"
  grep -oE "(FAILED|ERROR) tests/[^ ]+" $f | sort -u | head -4; grep -E "^E  " $f | head -4 | cut -c1-200; fi
LEFT=$((86 - (SECONDS - START))); LEFT=$((LEFT < 5 ? 5 : LEFT))
echo "=== attention t=$(t) (<= $LEFT s)"
timeout $LEFT python3 benchmarks/fp8_ab.py attention --variants "$BUILT" --shapes 16K/256,2K/256 --blocks 3 \
  --iters 10 --seconds $((LEFT / 2)) --out $W/attention.json > $W/attention.log 2> $W/attention.err \
  || { echo "attention rc=$?"; tail -n 2 $W/attention.err | cut -c1-200; }
grep -E "^\| |^# " $W/attention.log | grep -v "^|---"
echo "=== end t=$(t)"
