#!/usr/bin/env bash
# onb14 round 1 (<= 90 s): GPU tests of what changed first (the onboarding run path on every copy path, its fault
# report and timing marks, the query and flag fetch waits incl. a captured graph's flag, the bitwise host-hit ==
# GPU-hit test under run + query and run + flag, the copy engine's tests over the refactored issue), then ONE process
# A/B'ing in alternated blocks (LAYERFLOW_FETCH_WAIT=flag for it, so every bucket has the done word; every variant's
# graphs then end with its ~1 us write):
#   old = onboard job + fetch sync (main's paths), run = run + sync (the one-run onboarding alone),
#   query = run + cudaStreamQuery spin, flag = run + poll of the done word the graph sets
# CPU hit + layerwise and GPU hit at 16K and 2K, bf16 then fp8_e4m3: median ms, LB, efficiency, host phases; then the
# instrumented timeline at 2K bf16 of flag, old and (time left) query: first copy's start, tail split (wake).
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb14"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset LAYERFLOW_ONBOARD_PATH LAYERFLOW_FETCH_WAIT LAYERFLOW_COPY_PATH LAYERFLOW_FILL_COPY
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests (buffers' fetch waits first: the A/B takes the flag variant only if they pass)"
timeout 15 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/runtime/test_buffers.py \
    > "$D/gpu-tests-buffers.log" 2>&1
rcb=$?
tail -1 "$D/gpu-tests-buffers.log"
if [ $rcb -eq 0 ]; then echo "buffers GPU tests: PASS"; FLAGENV=flag; FLAGVAR="--variant flag=run:flag"
else echo "buffers GPU tests: FAIL (rc=$rcb): no flag variant"; grep -E "^(FAILED|ERROR|E  )" "$D/gpu-tests-buffers.log" | head -6
     FLAGENV=sync; FLAGVAR=""; fi
T=$(left 40); [ $T -lt 5 ] && T=5
timeout $T python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/transfer/test_onboard_run.py \
    tests/transfer/test_copy_engine.py \
    "tests/runtime/test_host_paths_gpu.py::test_the_run_path_and_the_new_fetch_waits_give_the_gpu_hits_scores_bitwise" \
    --junitxml="$D/gpu-tests.xml" > "$D/gpu-tests.log" 2>&1
rc=$?
tail -1 "$D/gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR|E  )" "$D/gpu-tests.log" | head -8; fi
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== A/B old=job:sync run=run:sync query=run:query $FLAGVAR, alternated blocks (benchmarks/onboard_ab.py)"
T=$(left 64); [ $T -gt 32 ] && T=32
LAYERFLOW_FETCH_WAIT=$FLAGENV timeout $T python3 benchmarks/onboard_ab.py --seq-lens 16K,2K \
    --kv-cache-dtypes auto,fp8_e4m3 --variant old=job:sync --variant run=run:sync --variant query=run:query $FLAGVAR \
    --blocks 4 --iters 3 --profile \
    --out "$D/onboard_ab.json" > "$D/onboard_ab.stdout" 2> "$D/onboard_ab.stderr"
echo "rc=$? elapsed $(( $(date +%s) - START )) s"
python3 - "$D/onboard_ab.json" <<'PY' 2>&1 | tail -30
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("dtype hist variant: layerwise median (p90) LB eff | GPU hit median (p90) | max diff vs GPU hit")
for r in rows:
    for n, v in r["variants"].items():
        lw, hit = v["layerwise_ms"], v["gpu_hit_ms"]
        print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} {n:5s}: {lw['median']:.3f} ({lw['p90']:.3f}) "
              f"{r['lower_bound_ms']:.3f} {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} ({hit['p90']:.3f}) | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e}")
cols = ("prepare.onboard", "collect.fetch")
print("phases ms (lw " + "/".join(cols) + " | hit " + "/".join(cols) + "):")
for r in rows:
    print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} " + "  ".join(
        f"{n} " + "/".join(f"{v.get('layerwise_phases_ms', {}).get(c, float('nan')):.3f}" for c in cols) + "|"
        + "/".join(f"{v.get('gpu_hit_phases_ms', {}).get(c, float('nan')):.3f}" for c in cols)
        for n, v in r["variants"].items()))
PY
grep -vE "onboard_ab (auto|fp8)" "$D/onboard_ab.stderr" | tail -3

timeline() {   # $1: name; $2: onboard path; $3: fetch wait; $4: the most seconds it may take
  local name=$1 T
  T=$(left 88); [ $T -gt $4 ] && T=$4
  [ $T -lt 8 ] && { echo "no time for the $name timeline"; return; }
  echo "=== timeline 2K bf16, $name (onboard $2, fetch $3; bench --timeline)"
  LAYERFLOW_ONBOARD_PATH=$2 LAYERFLOW_FETCH_WAIT=$3 timeout $T python3 -m layerflow.cli bench --seq-lens 2K \
      --scenarios gpu_hit,cpu_hit_layerwise --timeline --timed-iters 6 --warmup-iters 2 \
      --out "$D/timeline-$name.json" > "$D/timeline-$name.stdout" 2>&1
  echo "rc=$?"
  python3 - "$D/timeline-$name.json" <<'PY' 2>&1 | tail -3
import json, sys
keys = ("issue_ms", "tail_ms", "last_compute", "host_late", "wake", "post")
host = ("onboard_call", "host_pinned", "signal_acquired", "job_checked", "copier_built", "copy0_issued", "fetch_call",
        "fetch_end")
for r in json.load(open(sys.argv[1]))["results"]:
    t = r.get("timeline_ms")
    if t:
        print(r["scenario"][:6] if "scenario" in r else "", "wall %.3f" % r["wall_ms"]["median"],
              " ".join(f"{k}={t[k]:.3f}" for k in keys if k in t))
        print("  host:", " ".join(f"{k[:8]}={t['host.' + k]:.3f}" for k in host if "host." + k in t))
PY
}
[ $rcb -eq 0 ] && timeline flag run flag 12
timeline old job sync 12
timeline query run query 12
echo "total $(( $(date +%s) - START )) s"
