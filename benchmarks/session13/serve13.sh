#!/usr/bin/env bash
# serve13 FINAL (<= 60 s, merged main). 1) GPU test: guarded serving (chained prefetch) vs a full recompute.
# 2) one engine, the serving benchmark's workload (hstu-bench, Zipf 1.0, 64 users, batches up to 8, 300 Poisson
# requests a run), default scheduler (guarded), copy timeline on, at 880 and 800 req/s offered, 2 alternated blocks:
# req/s, p50/p99, batches/s, hot-user cap, then the copy engine's device-measured busy share and its idle split
# (host late / device late, and by scheduler phase).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve13; mkdir -p "$work"
t0=$SECONDS
git log --oneline -1 2>/dev/null
echo "=== GPU test (limit 40s)"
timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider tests/serving/test_serving_gpu.py \
  -k "test_prefetched_batches_on_the_gpu_score_like_a_full_recompute and guarded" >"$work/gpu-tests.log" 2>&1
rc=$?; grep -E "[0-9]+ (passed|failed)" "$work/gpu-tests.log" | tail -1
if [ $rc -eq 0 ]; then echo "GPU TEST PASS"; else echo "GPU TEST FAIL rc=$rc"; grep -E "^(FAILED|ERROR)|Error" "$work/gpu-tests.log" | head -4; fi
left=$((59 - (SECONDS - t0))); [ $left -lt 18 ] && left=18
echo "=== serving: guarded, copy timeline, 880/800 req/s, 2 blocks (at $((SECONDS - t0))s, limit ${left}s)"
timeout $left python3 - "$work" <<'PY' 2>"$work/serving.stderr"
import statistics
import sys
from pathlib import Path

import torch

from layerflow.bench import serving, serving_report
from layerflow.bench.environment import device_name
from layerflow.bench.throughput import ThroughputSettings

work = Path(sys.argv[1])
device = torch.device("cuda")
d = serving.GPU_DEFAULTS
workload = ThroughputSettings(preset=d["preset"], history_len=d["history_len"], append_len=d["append_len"],
                              num_candidates=d["num_candidates"], num_users=64, gpu_users=d["gpu_users"],
                              num_requests=300, rate=800.0, zipf=1.0, batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, (880.0, 800.0), ("inprocess",), 2.0, policies=("guarded",),
                                   copy_timeline=True, blocks=2)
found = serving.run_serving(settings, device)
serving_report.write_json(settings, found, device, work / "serving-copies-h200.json")
(work / "serving-copies.md").write_text(serving_report.markdown(settings, found, device_name(device)) + "\n")
b = found["bound"]
print(f"bound {b['rate']:.1f} req/s ({b['limited_by']}); hot share "
      f"{max(r['hot_user_share'] for r in found['runs']):.3f}")
rows = {}
for r in found["runs"]:
    ci = r["copy_idle"]
    span = ci["busy_s"] + ci["idle_s"] or 1.0
    rows.setdefault(r["offered_rate"], []).append(
        (r["throughput"], r["p50_ms"] or 0.0, r["p99_ms"] or 0.0, r["batches_per_s"], r["hot_user_cap"],
         r["mean_batch"], ci["busy_s"] / span, ci["host_late_s"] / span, ci["device_late_s"] / span,
         {k: v / span for k, v in ci["idle_by_phase_s"].items()}))
print("| offered | req/s blocks | median | of bound | p50 | p99 | batch/s | hot cap | batch | copy busy (dev) "
      "| idle host/dev late | idle by phase |")
for rate, got in sorted(rows.items(), reverse=True):
    m = [statistics.median(g[k] for g in got) for k in range(9)]
    phases = {}
    for g in got:
        for k, v in g[9].items():
            phases[k] = phases.get(k, 0.0) + v / len(got)
    top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])[:4])
    print(f"| {rate:g} | {' / '.join(f'{g[0]:.0f}' for g in got)} | {m[0]:.1f} | {m[0] / b['rate']:.3f} | "
          f"{m[1]:.1f} | {m[2]:.0f} | {m[3]:.0f} | {m[4]:.0f} | {m[5]:.2f} | {m[6]:.2f} | {m[7]:.2f} / {m[8]:.2f} "
          f"| {top} |")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then grep -v "^\s*$" "$work/serving.stderr" | tail -4; fi
