#!/usr/bin/env bash
# onb15 final (<= 60 s) on merged main, issues 18 and 20.
#  0. GPU tests: the lead/rest split (test_layer_issue.py), the one-run path (test_onboard_run.py), host hit == GPU hit
#     bitwise under every signal with the defaults (inline issue under the copy thread, the lead) and with a one-layer
#     lead on and off the copy thread (test_host_paths_gpu.py).
#  1. ONE process A/B at 2K (benchmarks/onboard_ab.py -> onboard-issue-final-h200.json), 3 alternated blocks:
#     thread (main's default: every copy handed to the copy thread), all (caller's thread, every layer before the
#     launch), lead (the default now: inline, a 16 MiB lead before the launch, the rest after it), fp8 then bf16.
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset LAYERFLOW_COPY_THREAD LAYERFLOW_COPY_PATH
START=$(date +%s)
timeout 26 python3 -m pytest -m gpu -q -p no:cacheprovider tests/transfer/test_layer_issue.py \
    tests/transfer/test_onboard_run.py tests/runtime/test_host_paths_gpu.py > "$D/gpu-tests.log" 2>&1
rc=$?
echo "GPU tests rc=$rc: $(tail -1 "$D/gpu-tests.log" | cut -c1-90) $(grep -E "^(FAILED|ERROR)" "$D/gpu-tests.log" | head -3 | cut -c1-150)"
T=$(( 58 - ($(date +%s) - START) )); [ $T -gt 31 ] && T=31
timeout $T python3 benchmarks/onboard_ab.py --seq-lens 2K --kv-cache-dtypes fp8_e4m3,auto \
    --variant thread=word:thread --variant all=word:all --variant lead=word:lead --blocks 3 --iters 2 \
    --out "$D/onboard-issue-final-h200.json" > "$D/onboard_ab.stdout" 2> "$D/onboard_ab.stderr"
echo "A/B rc=$?: dtype hist variant: layerwise median (p90) LB eff | GPU hit | max diff vs GPU hit"
python3 - "$D/onboard-issue-final-h200.json" <<'PY' 2>&1 | tail -6
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    for n, v in r["variants"].items():
        lw, hit = v["layerwise_ms"], v["gpu_hit_ms"]
        print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']} {n:6s}: {lw['median']:.3f} ({lw['p90']:.3f}) "
              f"{r['lower_bound_ms']:.3f} {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e}")
PY
echo "total $(( $(date +%s) - START )) s"
