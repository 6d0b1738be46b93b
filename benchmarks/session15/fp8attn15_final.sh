#!/usr/bin/env bash
# fp8attn final (issue 20), on merged main. Nothing of fp8attn's kernels was kept (the pv / pvs schedules lost);
# what is left to decide is the tanh SiLU over the fp8 default tiling (78.7 against 83.9 us at 16K/256 in call 2),
# still `exact` by default. This measures it at 16K/256 and 2K/256 and checks it on the GPU: the fp8x2 attention
# under LAYERFLOW_FP8_SILU=tanh against its reference, and the quality gate (top-10, tau) on a cut workload.
# Budget: tests <= 16 s, A/B <= 22 s, quality <= 20 s (total <= 60 s). Output in $OUT/fp8attn/.
export PYTHONPATH=. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}/fp8attn
mkdir -p "$O"
t0=$SECONDS
LAYERFLOW_FP8_SILU=tanh timeout 16 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
    tests/kernels/test_gluon_fp8_qk_gpu.py -k "bs1_16k" > "$O/gpu_tests_tanh.log" 2>&1
rc=$?
echo "fp8attn gpu tests (fp8x2, tanh SiLU): $([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc") | $(grep -E 'passed|failed|error' "$O/gpu_tests_tanh.log" | tail -1)"
timeout 22 python3 benchmarks/fp8_ab.py attention --variants "bf16,fp8 main,fp8 tanh" --shapes 16K/256,2K/256 \
    --blocks 3 --out "$O/kernels-fp8-tanh-h200.json" > "$O/ab.log" 2>&1
echo "fp8attn A/B rc=$? (us; vs fp8 main)"
grep -E "^\| (bf16|fp8)" "$O/ab.log" | cut -d'|' -f1-4
LAYERFLOW_FP8_SILU=tanh timeout 20 python3 benchmarks/fp8_quality.py --history-lens 2K,16K --users-per-length 8 \
    --out "$O/fp8-quality-tanh-h200.json" > "$O/quality.log" 2>&1
echo "fp8attn quality (tanh, 8 users x 2K,16K) rc=$? (0: gate passes)"
grep -E "^\| all|^Gate" "$O/quality.log" | cut -c1-200
echo "fp8attn total $((SECONDS - t0)) s"
