#!/usr/bin/env bash
# (As run in device call 2, session 16, from .session/onb.sh, on commit ea40b99: the C issue loop and the layer-0 row
# ramp it A/Bs were reverted after it (both lost); onboard_ab's LOOP and ROWS fields went with them. Round 1 ran
# commit 2e702df: python3 benchmarks/onboard_ab.py --seq-lens 2K,4K,16K --kv-cache-dtypes fp8_e4m3,auto --variant
# py=word:lead:python --variant nat=word:lead:native --variant natall=word:all:native --blocks 3 --iters 2 --profile.)
# onb round 2 (<= 100 s), issues 18 and 20. Round 1: the C issue loop alone gained ~0.035 ms of prepare.onboard at
# fp8 2K and no wall time (noisy host); the host cost left is the driver's: a pitched copy's call grows with its rows
# and the copy starts when it returns. This round: layer 0 of a one-run onboarding in row chunks 8, 16, 32, ...
#  0. GPU tests: C loop vs Python (byte-exact, signals, ramped layer 0), lead split, one-run path, host hit == GPU hit.
#  1. benchmarks/copy_call_cost.py: host us of one pitched copy by rows (128 KiB and 64 KiB pages), posts' calls.
#  2. ONE process A/B, 3 alternated blocks, fp8 then bf16, 2K/16K: py = session 15 (Python loop, layer 0 one call),
#     pyr = Python loop, layer 0 ramped from 8 rows;
#     nat = C loop, layer 0 one call; natr = C loop, layer 0 ramped from 8 rows (the new default). The bound's
#     transfer probe (Python, alone) ramps layer 0 too.
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset LAYERFLOW_COPY_THREAD LAYERFLOW_COPY_PATH LAYERFLOW_RUN_ISSUE
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 36 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/transfer/test_native_issue.py \
    tests/transfer/test_layer_issue.py tests/transfer/test_onboard_run.py tests/runtime/test_host_paths_gpu.py \
    > "$D/gpu-tests.log" 2>&1
rc=$?
TESTS="GPU tests rc=$rc: $(tail -1 "$D/gpu-tests.log" | cut -c1-90) $(grep -E "^(FAILED|ERROR)" "$D/gpu-tests.log" | head -3 | cut -c1-150) $(grep -E "^E  " "$D/gpu-tests.log" | head -4 | cut -c1-160)"
timeout 12 python3 benchmarks/copy_call_cost.py --rows 1,8,64,256,512 --page-kib 128 --iters 20 \
    --out "$D/call-cost-128k.json" > "$D/call-cost-128k.txt" 2>&1
timeout 8 python3 benchmarks/copy_call_cost.py --rows 8,64,512 --page-kib 64 --iters 20 \
    --out "$D/call-cost-64k.json" > "$D/call-cost-64k.txt" 2>&1
if [ $rc -eq 0 ]; then VARS="--variant py=word:lead:python:0 --variant pyr=word:lead:python:8 --variant nat=word:lead:native:0 --variant natr=word:lead:native:8"
else VARS="--variant py=word:lead:python:0"; export LAYERFLOW_RUN_ISSUE=python; fi
T=$(left 95); [ $T -gt 60 ] && T=60
timeout $T python3 benchmarks/onboard_ab.py --seq-lens 2K,16K --kv-cache-dtypes fp8_e4m3,auto $VARS \
    --blocks 3 --iters 2 --profile --out "$D/onboard_ab.json" > "$D/onboard_ab.stdout" 2> "$D/onboard_ab.stderr"
ABRC=$?
ABT=$(( $(date +%s) - START ))
echo "--- $TESTS"
echo "--- call costs (128 KiB pages, then 64 KiB):"; cat "$D/call-cost-128k.txt" "$D/call-cost-64k.txt" | tail -14 | cut -c1-120
grep -iE "native run issue unavailable|Traceback|Error" "$D/onboard_ab.stderr" | head -3 | cut -c1-200
echo "--- A/B rc=$ABRC at ${ABT}s: dtype hist variant: lw median (p90) LB eff | GPU hit | diff | lw prepare/prepare.onboard/launch.offload/collect.fetch"
python3 - "$D/onboard_ab.json" <<'PY' 2>&1 | tail -16
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    for n, v in r["variants"].items():
        lw, hit, ph = v["layerwise_ms"], v["gpu_hit_ms"], v.get("layerwise_phases_ms", {})
        print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} {n:5s}: {lw['median']:.3f} ({lw['p90']:.3f}) "
              f"{r['lower_bound_ms']:.3f} {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e} | " + "/".join(f"{ph.get(c, float('nan')):.3f}" for c in
              ("prepare", "prepare.onboard", "launch.offload", "collect.fetch")))
PY
echo "total $(( $(date +%s) - START )) s"
