#!/usr/bin/env bash
# onb13 round 1 (<= 90 s): GPU tests of what changed first (the host paths' bitwise host-hit == GPU-hit tests, now
# also under the deferred release on waitvalue and eventfd signals; the copy engine's, whose bounds check now reads
# the page count from the layout's addresses), then ONE process A/B'ing in alternated blocks the
# release of a committed in-process onboarding: early (the default: collect gives it back before the fetch) against
# deferred (LAYERFLOW_ONBOARD_RELEASE=deferred: given back after the next batch's launch): CPU hit + layerwise and GPU
# hit at 16K and 2K, bf16 then fp8_e4m3: median ms, LB, efficiency, host phases; then the instrumented timeline at 2K
# of deferred, a host-phase cProfile of a 2K CPU hit on the default path (where the first copy's start goes), then
# the timeline of early: tails side by side.
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb13"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset LAYERFLOW_ONBOARD_RELEASE LAYERFLOW_COPY_PATH LAYERFLOW_FILL_COPY
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests (host paths: early + deferred release)"
timeout 30 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_host_paths_gpu.py \
    tests/transfer/test_copy_engine.py \
    --junitxml="$D/gpu-tests.xml" > "$D/gpu-tests.log" 2>&1
rc=$?
tail -1 "$D/gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR|E  )" "$D/gpu-tests.log" | head -8; fi
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== A/B release early / deferred, alternated blocks (bench.paths)"
T=$(left 64); [ $T -gt 34 ] && T=34
timeout $T python3 -m layerflow.bench.paths --seq-lens 16K,2K --kv-cache-dtypes auto,fp8_e4m3 \
    --variants early,deferred --blocks 6 --iters 4 --profile --out "$D/paths.json" \
    > "$D/paths.stdout" 2> "$D/paths.stderr"
echo "rc=$? elapsed $(( $(date +%s) - START )) s"
python3 - "$D/paths.json" <<'PY' 2>&1 | tail -24
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
cols = ("prepare", "prepare.onboard", "launch.offload", "collect.fetch", "collect.commit", "collect.other")
print("| dtype | hist | release | layerwise (p90) | LB | eff | GPU hit (p90) | diff |")
for r in rows:
    for n, v in r["variants"].items():
        lw, hit = v["layerwise_ms"], v["gpu_hit_ms"]
        print(f"| {r['kv_cache_dtype'][:4]} | {r['seq_len']} | {n} | {lw['median']:.3f} ({lw['p90']:.3f}) | "
              f"{r['lower_bound_ms']:.3f} | {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} ({hit['p90']:.3f}) | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e} |")
print("lw phases ms: " + " ".join(cols))
for r in rows:
    for n, v in r["variants"].items():
        ph = v.get("layerwise_phases_ms", {})
        print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} {n:8s} " + " ".join(f"{ph.get(c, float('nan')):.3f}" for c in cols))
PY
grep -vE "paths (auto|fp8)" "$D/paths.stderr" | tail -3

timeline() {   # $1: release; $2: the most seconds it may take
  local release=$1 T
  T=$(left 88); [ $T -gt $2 ] && T=$2
  [ $T -lt 8 ] && { echo "no time for the $release timeline"; return; }
  echo "=== timeline 2K bf16, release=$release (bench --timeline)"
  LAYERFLOW_ONBOARD_RELEASE=$release timeout $T python3 -m layerflow.cli bench --seq-lens 2K \
      --scenarios gpu_hit,cpu_hit_layerwise --timeline --timed-iters 6 --warmup-iters 2 \
      --out "$D/timeline-$release.json" > "$D/timeline-$release.stdout" 2>&1
  echo "rc=$?"
  python3 - "$D/timeline-$release.json" <<'PY' 2>&1 | tail -3
import json, sys
keys = ("issue_ms", "transfer_ms", "tail_ms", "last_compute", "host_late", "wake", "post")
host = ("onboard_call", "host_pinned", "signal_acquired", "job_checked", "copier_built", "copy0_issued", "all_issued",
        "prepare_end", "replay_call", "fetch_call", "fetch_end", "collect_end")
for r in json.load(open(sys.argv[1]))["results"]:
    t = r.get("timeline_ms")
    if t:
        print(r["seq_len"], "wall %.3f" % r["wall_ms"]["median"], " ".join(f"{k}={t[k]:.3f}" for k in keys if k in t))
        print("  host:", " ".join(f"{k}={t['host.' + k]:.3f}" for k in host if "host." + k in t))
PY
}
timeline deferred 12

T=$(left 78); [ $T -gt 9 ] && T=9
if [ $T -ge 6 ]; then
  echo "=== host phases + cProfile, CPU hit + layerwise 2K bf16, default release (benchmarks/host_phases.py)"
  timeout $T python3 benchmarks/host_phases.py --scenario cpu_hit_layerwise --seq-len 2048 --iters 100 \
      --cprofile "$D/host-phases-2k.prof" --only layerflow --top 30 \
      --callees '\((onboard|_onboard|_issue|_layer_copier|run|copy|prepare|acquire|pin_for_onboard|make_job)\)' \
      > "$D/host-phases-2k.txt" 2>&1
  echo "rc=$?"; grep -E "^ +(prepare|prepare\.onboard|collect\.other|wall) " "$D/host-phases-2k.txt"
fi
timeline early 12
echo "total $(( $(date +%s) - START )) s"
