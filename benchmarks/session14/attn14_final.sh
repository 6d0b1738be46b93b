#!/usr/bin/env bash
# attn14 round 2, final (issue 18): the bf16 Gluon attention's D=256 default after round 2 ("pv": the previous tile's
# P V on the tensor cores during this tile's SiLU, the query block stored by its consumer while the loader's first
# copies fly; the "ws" schedule it replaced is removed), H200, BS=1, D=256, H=4,
# L2 rotated, 3 blocks in ONE process. Rows: 16K and 2K history with 256 and 0 candidates, and 64 keys of history
# (the fixed cost of a launch: one tile per program, the store of the partials and the split sum).
# Everything lands in $OUT/attn14/, the key figures on stdout.
export PYTHONPATH=. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}/attn14
mkdir -p "$O"
t0=$SECONDS
DEF=64x2:pv:tma:tanh:wt:sl

# 1. GPU correctness of the default: small ragged batch vs tl + fp32 reference, 16K BS=1 with 0 / 256 candidates vs
#    tl, the fp16 tolerance of the tanh SiLU, one graph replayed across lengths bitwise equal to eager, hstu-bench's
#    320 rows in the engine's 512-token bucket (rows rule, self tiles last) vs the fp32 reference at 2K and 16K.
timeout 40 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_gluon_attention_gpu.py \
    tests/kernels/test_attention_splits_gpu.py \
    -k "(64x2:pv:tma:tanh:wt:sl and (small or bs1)) or replays or fp16_tolerance or rows-last" \
    > "$O/gpu_tests.log" 2>&1
rc=$?
echo "attn14 final gpu tests: $([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc") | $(grep -E 'passed|failed|error' "$O/gpu_tests.log" | tail -1) | $((SECONDS - t0)) s"
[ $rc = 0 ] || grep -E "^(FAILED|ERROR)|Error|assert" "$O/gpu_tests.log" | head -5 | cut -c1-200

# 2. The default's figures (D2D copy and dense GEMM ceilings as kernels.py prints them).
t1=$SECONDS
left=$((88 - t1))
timeout $left python3 benchmarks/kernels.py --batch 1 --history 16384 2048 64 --candidates 256 0 --head-dim 256 \
    --no-sweep --no-gate --no-reference --iters 20 --kernel gluon --gluon-tiling $DEF --blocks 3 \
    --out "$O/kernels-attn14-final.json" > "$O/kernels.log" 2>&1
rc=$?
echo "attn14 final benchmark rc=$rc in $((SECONDS - t1)) s (limit $left)"
grep -m2 -E "device-to-device|GEMM" "$O/kernels.log" | cut -c1-160
if grep -q "| blocks |" "$O/kernels.log"; then
    sed -n '/| blocks |/,$p' "$O/kernels.log"
else    # cut short: the rows that finished (block by block), and the first error
    grep -E "^\| gluon" "$O/kernels.log" | cut -d'|' -f2,4,5,8,11 | head -24
    grep -m3 -E "Error|error" "$O/kernels.log" | cut -c1-200
fi
echo "attn14 final total $((SECONDS - t0)) s"
