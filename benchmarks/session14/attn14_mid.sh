#!/usr/bin/env bash
# attn14 round 2, mid-round (issue 18): the D=256 default "pv" (64x2:pv:tma:tanh:wt:sl) against three selectable
# variants, H200, BS=1, D=256, H=4, L2 rotated, in ONE process, alternated in 3 blocks:
#   cq   the consumer stores the query block itself inside the warp-specialised region (the loader's first TMA copies
#        fly meanwhile: a cut of the fixed cost per launch);
#   m64  64x3 with 64-row query blocks: 5 blocks of 64 rows for 320 queries (no half-empty block) and 3 stages;
#   32x4 four 32-key stages at 128 rows (more copies in flight per SM).
# Everything lands in $OUT/attn14/, the key figures on stdout.
export PYTHONPATH=. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}/attn14
mkdir -p "$O"
t0=$SECONDS
DEF=64x2:pv:tma:tanh:wt:sl

# 1. GPU correctness of the three variants: a small ragged batch (0/256 candidates) vs tl and the fp32 reference.
timeout 36 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_gluon_attention_gpu.py \
    -k "pv and small and ((tma and tanh and cq) or m64 or 32x4)" > "$O/gpu_tests.log" 2>&1
rc=$?
echo "attn14 mid gpu tests (cq, m64, 32x4): $([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc") | $(grep -E 'passed|failed|error' "$O/gpu_tests.log" | tail -1) | $((SECONDS - t0)) s"
[ $rc = 0 ] || grep -E "^(FAILED|ERROR)|Error|assert" "$O/gpu_tests.log" | head -5 | cut -c1-200

# 2. The A/B at 16K/256 and 2K/256, rows alternated within each of 3 blocks.
t1=$SECONDS
left=$((88 - t1))
timeout $left python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 256 --head-dim 256 \
    --no-sweep --no-gate --no-reference --iters 20 --kernel gluon \
    --gluon-tiling $DEF $DEF:cq 64x3:pv:m64:tma:tanh:wt:sl 32x4:pv:tma:tanh:wt:sl --blocks 3 \
    --out "$O/kernels-attn14-mid.json" > "$O/kernels.log" 2>&1
rc=$?
echo "attn14 mid benchmark rc=$rc in $((SECONDS - t1)) s (limit $left)"
grep -m1 "device-to-device" "$O/kernels.log" | cut -c1-160
if grep -q "| blocks |" "$O/kernels.log"; then
    sed -n '/| blocks |/,$p' "$O/kernels.log"
else    # cut short: the rows that finished (block by block), and the first error
    grep -E "^\| gluon" "$O/kernels.log" | cut -d'|' -f2,4,5,8,11 | head -24
    grep -m3 -E "Error|error" "$O/kernels.log" | cut -c1-200
fi
echo "attn14 mid total $((SECONDS - t0)) s"
