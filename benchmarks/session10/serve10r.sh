#!/usr/bin/env bash
# serve10r (<= 60 s): the serving GPU test of the new prefetch policies (guarded, then free, on one engine), then
# `bench --serve` (4K history, Zipf 1.0, 64 users, GPU pool for 16, batches up to 8, 400 Poisson arrivals, in
# process) at 800 req/s under the policies off (the new default) / guarded / mixed (the old default) / free, all on
# ONE engine in ONE process: achieved rate, p50/p99, tier mix, batch sizes, copy busy, the scheduler's phase table
# and the engine's host time per batch. Everything under $OUT, tarred into $OUT/serve10r.tgz.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve10r; mkdir -p "$work"
t0=$SECONDS
git log --oneline -1 2>/dev/null
echo "=== GPU test: tests/serving/test_serving_gpu.py -k guarded (guarded, then free, on one engine; limit 28s)"
timeout 28 python3 -m pytest -m gpu -q -p no:cacheprovider -k guarded tests/serving/test_serving_gpu.py \
  >"$work/gpu-tests.log" 2>&1
rc=$?; tail -2 "$work/gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU TEST PASS (guarded+free)"; else echo "GPU TEST FAIL rc=$rc"; tail -30 "$work/gpu-tests.log"; fi
left=$((57 - (SECONDS - t0)))
echo "=== serving A/B at 800 req/s: off / guarded / mixed / free (at $((SECONDS - t0))s, limit ${left}s)"
timeout $left python3 - "$work" <<'PY' 2>"$work/serving.stderr"
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
                              num_requests=400, rate=800.0, zipf=1.0, batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, (800.0,), ("inprocess",), 2.0,
                                   policies=("off", "guarded", "mixed", "free"), profile=True)
found = serving.run_serving(settings, device)
serving_report.write_json(settings, found, device, work / "serving-h200.json")
print(serving_report.markdown(settings, found, device_name(device)))
print("\nper run: fraction of the bound, batches launched, prepared with nothing in flight / behind one")
for r in found["runs"]:
    ph = r["scheduler"]["phases"]
    print(f"{r['policy']:>8} {r['offered_rate']:>4g}/s: {r['throughput'] / found['bound']['rate']:.2f} of bound, "
          f"{ph.get('launch', {}).get('calls', 0)} batches, {ph.get('prepare', {}).get('calls', 0)} / "
          f"{ph.get('prepare ahead', {}).get('calls', 0)}")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
[ $rc -eq 0 ] || grep -v "^\s*$" "$work/serving.stderr" | tail -20
tar -C "$OUT" -czf "$OUT/serve10r.tgz" serve10r && echo "wrote $OUT/serve10r.tgz"
