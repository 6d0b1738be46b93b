#!/usr/bin/env bash
# serve12 round 2 (<= 75 s): 1) GPU tests of what changed (chaining now always on): the serving GPU test under the
# guarded policy (chained prefetch, host hits onboarded under CUDA graphs, scores vs a full recompute) and
# the bitwise chained-vs-after-collect test; -v and a faulthandler dump at 24 s, so a hang shows its stacks.
# 2) ONE process, one engine, the benchmark's workload (hstu-bench, 4K history, Zipf 1.0, 64 users for a GPU pool of
# 16, batches up to 8, 500 Poisson requests a run): first 60 requests one at a time (the unloaded latency), then
# policies off / guarded / mixed (the last two chained) at 800 req/s (~0.89 of round 1's 900.9 bound) and 720 req/s
# (0.8 of it), 2 alternated blocks: req/s, of bound, p50/p99, p99 over the unloaded p50, mean batch, copy busy, and
# the scheduler thread's ms per batch in each phase plus its busy share (is the host the limit?).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve12; mkdir -p "$work"
t0=$SECONDS
git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null | head -1
echo "=== GPU tests (limit 30s)"
timeout 30 python3 -m pytest -m gpu -v -p no:cacheprovider -o faulthandler_timeout=24 --durations=0 \
  tests/serving/test_serving_gpu.py -k "guarded or bitwise" >"$work/gpu-tests.log" 2>&1
rc=$?; grep -E "PASSED|FAILED|ERROR|passed|failed|s call|s setup" "$work/gpu-tests.log" | head -12
if [ $rc -eq 0 ]; then echo "GPU TESTS PASS"; else echo "GPU TESTS FAIL rc=$rc"; grep -E "^(FAILED|ERROR)|Error|Timeout|File \"/" "$work/gpu-tests.log" | head -16; fi
left=$((73 - (SECONDS - t0)))
echo "=== serving: off / guarded / mixed at 800 and 720/s, 2 blocks (at $((SECONDS - t0))s, limit ${left}s)"
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
                              num_requests=500, rate=800.0, zipf=1.0, batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, (800.0, 720.0), ("inprocess",), 2.0,
                                   policies=("off", "guarded", "mixed"), blocks=2, unloaded=60)
found = serving.run_serving(settings, device)
serving_report.write_json(settings, found, device, work / "serving-r2-h200.json")
(work / "serving-r2.md").write_text(serving_report.markdown(settings, found, device_name(device)) + "\n")
b, u = found["bound"], found["unloaded"]
print(f"bound {b['rate']:.1f} req/s ({b['limited_by']}; copy {b['copy_engine_rate'] or 0:.1f}, GPU {b['gpu_rate']:.1f}); "
      f"unloaded p50 {u['p50_ms']:.2f} ms, p99 {u['p99_ms']:.2f} ms, tiers {u['tiers']}")
users = [u for _, u in stream(workload)]
hot = max(Counter(users).values()) / len(users)
print(f"hottest user's share of the stream {hot:.3f}: one request per batch, so req/s <= batches/s / {hot:.3f}")
PH = ("prepare ahead", "prepare", "launch", "collect", "poll", "idle")
rows = {}
for r in found["runs"]:
    t = r["scheduler"]
    batches = max(1, t["phases"].get("launch", {"calls": 1})["calls"])
    ms = [t["phases"].get(p, {"s": 0.0})["s"] * 1e3 / batches for p in PH]
    busy = sum(v["s"] for k, v in t["phases"].items() if k not in ("idle", "poll")) / t["wall_s"]
    rows.setdefault((r["offered_rate"], r["policy"]), []).append(
        (r["throughput"], r["p50_ms"] or 0.0, r["p99_ms"] or 0.0, r["mean_batch"], r["copy_busy"], busy,
         t["collect_waits"] / batches, batches / t["wall_s"], batches / t["wall_s"] / hot, *ms))
print("| offered/s | policy | req/s per block | median | of bound | p50 ms | p99 ms | p99/unl p50 | mean batch "
      "| copy busy | sched busy | collect-wait frac | batches/s | hot-user limit req/s | ms/batch: prep ahead / prep / launch / collect / poll / idle |")
print("|---" * 15 + "|")
for (rate, policy), got in rows.items():
    m = [statistics.median(g[k] for g in got) for k in range(len(got[0]))]
    print(f"| {rate:g} | {policy} | {' / '.join(f'{g[0]:.1f}' for g in got)} | {m[0]:.1f} | {m[0] / b['rate']:.2f} | "
          f"{m[1]:.2f} | {m[2]:.2f} | {m[2] / u['p50_ms']:.1f} | {m[3]:.2f} | {m[4]:.2f} | {m[5]:.2f} | {m[6]:.2f} | "
          f"{m[7]:.0f} | {m[8]:.0f} | " + " / ".join(f"{x:.2f}" for x in m[9:]) + " |")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then grep "^policy" "$work/serving.stderr" | tail -14; grep -v "^\s*$" "$work/serving.stderr" | grep -v "^policy" | tail -8; fi
tar -C "$OUT" -czf "$OUT/serve12.tgz" serve12 && echo "wrote $OUT/serve12.tgz"
