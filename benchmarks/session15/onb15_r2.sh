#!/usr/bin/env bash
# (As run in device call 3 from .session/onb.sh; the timeline summary helper is benchmarks/session15/onb15_tl.py.)
# onb15 round 2 (<= 100 s), issues 18 and 20. Prints at the end only, most important LAST.
# Call 2: the GPU tests failed on a test bug (a third onboarding's acquisition waited 5 s for a counter the test still
# held; fixed), so its A/B ran 'thread' alone: 2K bf16 1.845 / fp8 1.285 ms (eff 0.72 / 0.57), 16K 10.64 / 5.95.
#  0. GPU tests: the lead/rest split (transfer/layer_issue.py), inline issue through the copy-thread engine, host hit
#     == GPU hit bitwise with both, every signal (tests/runtime/test_host_paths_gpu.py).
#  1. ONE process A/B (benchmarks/onboard_ab.py), 3 alternated blocks: thread (main's default: every copy handed to
#     the copy thread), all (inline on the caller's thread, every layer before the launch: what earlier bench figures
#     measured), lead (inline, a 16 MiB lead of layers before the launch, the rest after it: the new default).
#  2. time left: timeline of the new default (fp8 2K,16K).
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 30 python3 -m pytest -m gpu -q -p no:cacheprovider tests/transfer/test_layer_issue.py \
    tests/transfer/test_onboard_run.py \
    "tests/runtime/test_host_paths_gpu.py::test_a_lead_of_layers_then_the_rest_after_the_launch_gives_the_gpu_hits_scores" \
    > "$D/gpu-tests.log" 2>&1
rc=$?
TESTS="GPU tests rc=$rc: $(tail -1 "$D/gpu-tests.log" | cut -c1-90) $(grep -E "^(FAILED|ERROR)" "$D/gpu-tests.log" | head -3 | cut -c1-150) $(grep -E "^E  " "$D/gpu-tests.log" | head -3 | cut -c1-160)"
if [ $rc -eq 0 ]; then VARS="--variant thread=word:thread --variant all=word:all --variant lead=word:lead"
else VARS="--variant thread=word:thread"; fi
T=$(left 92); [ $T -gt 60 ] && T=60
timeout $T python3 benchmarks/onboard_ab.py --seq-lens 2K,16K --kv-cache-dtypes fp8_e4m3,auto $VARS \
    --blocks 3 --iters 2 --profile --out "$D/onboard_ab.json" > "$D/onboard_ab.stdout" 2> "$D/onboard_ab.stderr"
ABRC=$?
ABT=$(( $(date +%s) - START ))
T=$(left 97); [ $T -gt 16 ] && T=16
if [ $T -ge 10 ] && [ $rc -eq 0 ]; then
  timeout $T python3 -m layerflow.cli bench --scenarios gpu_hit,cpu_hit_layerwise --timeline --timed-iters 6 \
      --warmup-iters 2 --seq-lens 2K --kv-cache-dtype fp8_e4m3 --out "$D/tl-fp8.json" > "$D/tl-fp8.stdout" 2>&1
  echo "--- timeline, new default, fp8 (gap parts ms; +lay: per-layer copy in pipeline - alone, us)"
  python3 benchmarks/session15/onb15_tl.py "$D/tl-fp8.json"
fi
echo "--- $TESTS"
echo "--- A/B rc=$ABRC at ${ABT}s: dtype hist variant: lw median (p90) LB eff | GPU hit | diff | lw prepare/prepare.onboard/launch.fill/launch.offload/collect.fetch"
python3 - "$D/onboard_ab.json" <<'PY' 2>&1 | tail -13
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    for n, v in r["variants"].items():
        lw, hit, ph = v["layerwise_ms"], v["gpu_hit_ms"], v.get("layerwise_phases_ms", {})
        print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} {n:6s}: {lw['median']:.3f} ({lw['p90']:.3f}) "
              f"{r['lower_bound_ms']:.3f} {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e} | " + "/".join(f"{ph.get(c, float('nan')):.3f}" for c in
              ("prepare", "prepare.onboard", "launch.fill", "launch.offload", "collect.fetch")))
PY
echo "total $(( $(date +%s) - START )) s"
