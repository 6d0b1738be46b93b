#!/usr/bin/env bash
# attn14 (issue 18): the bf16 Gluon attention's "pv" schedule (the previous tile's P V on the tensor cores during this
# tile's SiLU) against the default (64x2:ws:tma:tanh:wt:sl), H200, BS=1, D=256, H=4, L2 rotated, in ONE process,
# alternated in 3 blocks. Run from the repo root; everything lands in $OUT/attn14/, the key figures on stdout.
# Budget: tests <= 38 s, benchmark <= 48 s (compiles of the tests warm the benchmark's: same BS=1 shapes).
export PYTHONPATH=. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}/attn14
mkdir -p "$O"
t0=$SECONDS

# 1. GPU correctness of the new schedule: small ragged batch vs tl + fp32 reference, 16K BS=1 with 0 / 256
#    candidates vs tl, one graph replayed across lengths bitwise equal to eager (rows split rule, self tiles last).
timeout 38 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_gluon_attention_gpu.py \
    -k "pv and ((wt and (bs1 or small)) or rows)" > "$O/gpu_tests.log" 2>&1
rc=$?
echo "attn14 gpu tests (pv): $([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc") | $(grep -E 'passed|failed|error' "$O/gpu_tests.log" | tail -1) | $((SECONDS - t0)) s"
[ $rc = 0 ] || grep -E "^(FAILED|ERROR)|Error|assert" "$O/gpu_tests.log" | head -5 | cut -c1-200

# 2. The A/B: default vs pv at 16K/256, 2K/256, 16K/0, 2K/0, rows alternated within each of 3 blocks.
t1=$SECONDS
timeout 48 python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 256 0 --head-dim 256 \
    --no-sweep --no-gate --no-reference --iters 20 --kernel gluon \
    --gluon-tiling 64x2:ws:tma:tanh:wt:sl 64x2:pv:tma:tanh:wt:sl --blocks 3 \
    --out "$O/kernels-attn14.json" > "$O/kernels.log" 2>&1
rc=$?
echo "attn14 benchmark rc=$rc in $((SECONDS - t1)) s"
grep -m1 "device-to-device" "$O/kernels.log" | cut -c1-160
if grep -q "| blocks |" "$O/kernels.log"; then
    sed -n '/| blocks |/,$p' "$O/kernels.log"
else    # cut short: the rows that finished (block by block), and the first error
    grep -E "^\| gluon" "$O/kernels.log" | cut -d'|' -f2,4,5,8,11 | head -24
    grep -m3 -E "Error|error" "$O/kernels.log" | cut -c1-200
fi
echo "attn14 total $((SECONDS - t0)) s"
