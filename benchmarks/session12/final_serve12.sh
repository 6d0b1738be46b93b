#!/usr/bin/env bash
# serve12 final (<= 60 s, merged main): 1) GPU tests of what changed: the serving GPU test under the new default
# policy "guarded" (chained prefetch, host hits onboarded under CUDA graphs, scores vs a full recompute) and the
# bitwise chained-vs-after-collect test; -v, a faulthandler dump at 22 s. 2) ONE process, one engine, the
# benchmark's workload (hstu-bench, 4K history, Zipf 1.0, 64 users for a GPU pool of 16, batches up to 8, 400 Poisson
# requests a run): 30 requests one at a time (the unloaded latency), then the default policy (guarded, chained) at
# 800 req/s under copy path auto (the default) vs run_batch (one cudaMemcpy3DBatchAsync per layer), alternated in 2
# blocks: req/s, of bound, p50/p99, p99 over the unloaded p50, mean batch, copy busy, scheduler busy, batches/s,
# the hot user's limit, the scheduler's ms per batch per phase and the engine's prepare.onboard ms per batch.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve12; mkdir -p "$work"
t0=$SECONDS
git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null | head -1
echo "=== GPU tests (limit 27s)"
timeout 27 python3 -m pytest -m gpu -v -p no:cacheprovider -o faulthandler_timeout=22 --durations=0 \
  tests/serving/test_serving_gpu.py -k "guarded or bitwise" >"$work/gpu-tests.log" 2>&1
rc=$?; grep -E "PASSED|FAILED|ERROR|passed|failed|s call" "$work/gpu-tests.log" | head -8
if [ $rc -eq 0 ]; then echo "GPU TESTS PASS"; else echo "GPU TESTS FAIL rc=$rc"; grep -E "^(FAILED|ERROR)|Error|Timeout|File \"/" "$work/gpu-tests.log" | head -12; fi
left=$((57 - (SECONDS - t0)))
echo "=== serving 800/s, policy guarded (default): copy path auto vs run_batch, 2 blocks (at $((SECONDS - t0))s, limit ${left}s)"
timeout $left python3 - "$work" <<'PY' 2>"$work/serving.stderr"
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

from layerflow.bench import serving, serving_report
from layerflow.bench.environment import device_name
from layerflow.bench.throughput import ThroughputSettings, stream

work = Path(sys.argv[1])
device = torch.device("cuda")
d = serving.GPU_DEFAULTS
workload = ThroughputSettings(preset=d["preset"], history_len=d["history_len"], append_len=d["append_len"],
                              num_candidates=d["num_candidates"], num_users=64, gpu_users=d["gpu_users"],
                              num_requests=400, rate=800.0, zipf=1.0, batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, (800.0,), ("inprocess",), 2.0, policies=("guarded",), profile=True,
                                   copy_paths=("auto", "run_batch"), blocks=2, unloaded=30)
found = serving.run_serving(settings, device)
serving_report.write_json(settings, found, device, work / "serving-final-h200.json")
(work / "serving-final.md").write_text(serving_report.markdown(settings, found, device_name(device)) + "\n")
b, u = found["bound"], found["unloaded"]
print(f"bound {b['rate']:.1f} req/s ({b['limited_by']}; copy {b['copy_engine_rate'] or 0:.1f}, GPU {b['gpu_rate']:.1f}); "
      f"unloaded p50 {u['p50_ms']:.2f} ms, p99 {u['p99_ms']:.2f} ms")
users = [u for _, u in stream(workload)]
hot = max(Counter(users).values()) / len(users)
print(f"hottest user's share {hot:.3f}: one request per batch, so req/s <= batches/s / {hot:.3f}")
PH = ("prepare ahead", "prepare", "launch", "collect", "poll")
rows = {}
for r in found["runs"]:
    t = r["scheduler"]
    batches = max(1, t["phases"].get("launch", {"calls": 1})["calls"])
    ms = [t["phases"].get(p, {"s": 0.0})["s"] * 1e3 / batches for p in PH]
    busy = sum(v["s"] for k, v in t["phases"].items() if k not in ("idle", "poll")) / t["wall_s"]
    onboard = r["engine_phases_ms"].get("prepare.onboard", 0.0) / batches
    rows.setdefault(r["copy_path"], []).append(
        (r["throughput"], r["p50_ms"] or 0.0, r["p99_ms"] or 0.0, r["mean_batch"], r["copy_busy"], busy,
         batches / t["wall_s"], batches / t["wall_s"] / hot, onboard, *ms))
print("| copy path | req/s per block | median | of bound | p50 ms | p99 ms | p99/unl p50 | mean batch | copy busy "
      "| sched busy | batches/s | hot-user limit | prepare.onboard ms/batch | sched ms/batch: prep ahead / prep / launch / collect / poll |")
print("|---" * 14 + "|")
for path, got in rows.items():
    m = [statistics.median(g[k] for g in got) for k in range(len(got[0]))]
    print(f"| {path} | {' / '.join(f'{g[0]:.1f}' for g in got)} | {m[0]:.1f} | {m[0] / b['rate']:.2f} | {m[1]:.2f} | "
          f"{m[2]:.2f} | {m[2] / u['p50_ms']:.1f} | {m[3]:.2f} | {m[4]:.2f} | {m[5]:.2f} | {m[6]:.0f} | {m[7]:.0f} | "
          f"{m[8]:.2f} | " + " / ".join(f"{x:.2f}" for x in m[9:]) + " |")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then grep "^policy" "$work/serving.stderr" | tail -6; grep -v "^\s*$" "$work/serving.stderr" | grep -v "^policy" | tail -6; fi
tar -C "$OUT" -czf "$OUT/serve12.tgz" serve12 && echo "wrote $OUT/serve12.tgz"
