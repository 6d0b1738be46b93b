#!/usr/bin/env bash
# onb14 final (<= 90 s): GPU tests of what changed (one-run onboarding: copy paths, timing marks, the serving issue
# recorder; the fetch's done word: its wait, a captured send, a stream idle without it, host hit == GPU hit bitwise
# under every signal), then
#   1. ONE process A/B of the fetch's wait: word (the new default: the batch's done word, spun on in C without the
#      GIL) against sync (main's Stream.synchronize, patched onto the word in the benchmark), 5 alternated blocks,
#      2K+16K, bf16+fp8: layerwise median, LB, eff, GPU hit, host phases
#   2. wake probe (a captured tail graph: the wake by synchronize / done word, with and without an offload behind it)
#   3. timeline 2K bf16 of the defaults: first copy's start, tail split (wake, fetch_waited/fetch_end host stamps)
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb14"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset LAYERFLOW_ONBOARD_PATH LAYERFLOW_FETCH_WAIT LAYERFLOW_OFFLOAD_GATE LAYERFLOW_COPY_PATH LAYERFLOW_FILL_COPY
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests"
timeout 36 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/runtime/test_done_word.py \
    tests/runtime/test_buffers.py tests/runtime/test_host_paths_gpu.py tests/transfer/test_onboard_run.py \
    tests/bench/test_serving_issue.py > "$D/gpu-tests.log" 2>&1
rc=$?
tail -1 "$D/gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR|E  )" "$D/gpu-tests.log" | head -8; fi
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== A/B word (new default) vs sync (main), 5 alternated blocks (benchmarks/onboard_ab.py)"
T=$(left 70); [ $T -gt 32 ] && T=32
timeout $T python3 benchmarks/onboard_ab.py --seq-lens 2K,16K --kv-cache-dtypes auto,fp8_e4m3 \
    --variant sync=sync --variant word=word --blocks 5 --iters 3 --profile \
    --out "$D/onboard_ab.json" > "$D/onboard_ab.stdout" 2> "$D/onboard_ab.stderr"
echo "rc=$? elapsed $(( $(date +%s) - START )) s"
python3 - "$D/onboard_ab.json" <<'PY' 2>&1 | tail -10
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("dtype hist variant: layerwise median (p90) LB eff | GPU hit median | diff | lw prepare.onboard/collect.fetch/commit/other")
for r in rows:
    for n, v in r["variants"].items():
        lw, hit, ph = v["layerwise_ms"], v["gpu_hit_ms"], v.get("layerwise_phases_ms", {})
        print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} {n:4s}: {lw['median']:.3f} ({lw['p90']:.3f}) "
              f"{r['lower_bound_ms']:.3f} {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e} | " + "/".join(f"{ph.get(c, float('nan')):.3f}" for c in
              ("prepare.onboard", "collect.fetch", "collect.commit", "collect.other")))
PY
grep -vE "onboard_ab (auto|fp8)" "$D/onboard_ab.stderr" | tail -3

echo "=== wake probe (us, medians)"
T=$(left 76); [ $T -gt 8 ] && T=8
[ $T -ge 4 ] && timeout $T python3 benchmarks/wake_probe.py --reps 100 --out "$D/wake_probe.json" 2>&1 | grep -E "^(sync\+raw|sync\+offload|flag\+raw|flag\+offload|idle)"

T=$(left 88); [ $T -gt 12 ] && T=12
if [ $T -ge 8 ]; then
  echo "=== timeline 2K bf16, defaults"
  timeout $T python3 -m layerflow.cli bench --seq-lens 2K --scenarios gpu_hit,cpu_hit_layerwise --timeline \
      --timed-iters 6 --warmup-iters 2 --out "$D/timeline.json" > "$D/timeline.stdout" 2>&1
  echo "rc=$?"
  python3 - "$D/timeline.json" <<'PY' 2>&1 | tail -4
import json, sys
keys = ("issue_ms", "tail_ms", "last_compute", "host_late", "wake", "post", "host_wake")
host = ("onboard_call", "host_pinned", "signal_acquired", "job_checked", "copier_built", "copy0_issued", "replay_call",
        "fetch_call", "fetch_waited", "fetch_end", "collect_end")
for r in json.load(open(sys.argv[1]))["results"]:
    t = r.get("timeline_ms")
    if t:
        print("wall %.3f" % r["wall_ms"]["median"], " ".join(f"{k}={t[k]:.3f}" for k in keys if k in t))
        print("  host:", " ".join(f"{k[:9]}={t['host.' + k]:.3f}" for k in host if "host." + k in t))
PY
else echo "no time for the timeline"; fi
echo "total $(( $(date +%s) - START )) s"
