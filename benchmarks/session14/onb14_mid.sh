#!/usr/bin/env bash
# onb14 round 2, mid (<= 90 s): GPU tests of what changed (one-run onboarding now the only path for a one-run
# placement: its copy paths, fault report, timing marks, the serving issue recorder; the sync and flag fetch waits;
# host hit == GPU hit bitwise under flag), then
#   1. benchmarks/wake_probe.py: a small captured tail graph (sleep, results D2H, done word) waited for by sync / flag /
#      event; "dev_wake" = the timeline's wake in isolation, "+lookup" = with the marks' torch.cuda.current_stream(),
#      "+offload" = with a 2 MiB D2H copy queued behind the graph's end on a side stream (the engine's offload of the
#      batch's new pages): does the offload's PCIe traffic delay the host's view of the end?
#   2. ONE process A/B sync vs flag vs gate (= sync + LAYERFLOW_OFFLOAD_GATE: each batch's offload copies held on the
#      device until its commit, so they do not run while the host waits for the scores), 5 alternated blocks,
#      2K+16K, bf16+fp8: layerwise median, LB, eff, GPU hit, host phases of collect (gate only if its tests pass)
#   3. timeline 2K bf16 of the default (sync) with the new host stamps: fetch_waited, host_at_fetch, host_wake
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/onb14"
mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1
unset LAYERFLOW_ONBOARD_PATH LAYERFLOW_FETCH_WAIT LAYERFLOW_COPY_PATH LAYERFLOW_FILL_COPY
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests (one process; the A/B takes the gate variant only if the gate's tests passed)"
timeout 36 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/transfer/test_offload_gate.py \
    "tests/runtime/test_host_paths_gpu.py::test_held_offloads_give_the_gpu_hits_scores_bitwise" \
    "tests/runtime/test_host_paths_gpu.py::test_the_flag_fetch_wait_gives_the_gpu_hits_scores_bitwise" \
    tests/runtime/test_buffers.py tests/transfer/test_onboard_run.py tests/bench/test_serving_issue.py \
    > "$D/gpu-tests.log" 2>&1
rc=$?
tail -1 "$D/gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR|E  )" "$D/gpu-tests.log" | head -8; fi
GATEVAR=""
if [ "$(grep -cE '^PASSED .*(offload_gate|held_offloads)' "$D/gpu-tests.log")" -ge 3 ] && \
   ! grep -qE '^(FAILED|ERROR) .*(offload_gate|held_offloads)' "$D/gpu-tests.log"; then GATEVAR="--variant gate=sync:gate"
else echo "gate tests not all passed: no gate variant"; fi
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== wake probe (us, medians)"
timeout 10 python3 benchmarks/wake_probe.py --reps 150 --out "$D/wake_probe.json" 2>&1 | tail -9
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== A/B sync vs flag $GATEVAR, 5 alternated blocks (benchmarks/onboard_ab.py)"
T=$(left 76); [ $T -gt 34 ] && T=34
GATEENV=off; [ -n "$GATEVAR" ] && GATEENV=on
LAYERFLOW_FETCH_WAIT=flag LAYERFLOW_OFFLOAD_GATE=$GATEENV timeout $T python3 benchmarks/onboard_ab.py --seq-lens 2K,16K \
    --kv-cache-dtypes auto,fp8_e4m3 --variant sync=sync --variant flag=flag $GATEVAR --blocks 5 --iters 3 --profile \
    --out "$D/onboard_ab.json" > "$D/onboard_ab.stdout" 2> "$D/onboard_ab.stderr"
echo "rc=$? elapsed $(( $(date +%s) - START )) s"
python3 - "$D/onboard_ab.json" <<'PY' 2>&1 | tail -16
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

T=$(left 88); [ $T -gt 12 ] && T=12
if [ $T -ge 8 ]; then
  echo "=== timeline 2K bf16, default (sync)"
  timeout $T python3 -m layerflow.cli bench --seq-lens 2K --scenarios gpu_hit,cpu_hit_layerwise --timeline \
      --timed-iters 6 --warmup-iters 2 --out "$D/timeline-sync.json" > "$D/timeline-sync.stdout" 2>&1
  echo "rc=$?"
  python3 - "$D/timeline-sync.json" <<'PY' 2>&1 | tail -4
import json, sys
keys = ("issue_ms", "tail_ms", "last_compute", "host_late", "wake", "post", "host_at_fetch", "host_wake")
host = ("onboard_call", "host_pinned", "signal_acquired", "job_checked", "copier_built", "copy0_issued", "replay_call",
        "launch_end", "fetch_call", "fetch_waited", "fetch_end", "collect_end")
for r in json.load(open(sys.argv[1]))["results"]:
    t = r.get("timeline_ms")
    if t:
        print("wall %.3f" % r["wall_ms"]["median"], " ".join(f"{k}={t[k]:.3f}" for k in keys if k in t))
        print("  host:", " ".join(f"{k[:9]}={t['host.' + k]:.3f}" for k in host if "host." + k in t))
PY
else echo "no time for the timeline"; fi
echo "total $(( $(date +%s) - START )) s"
