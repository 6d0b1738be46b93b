#!/usr/bin/env bash
# serve15 final (<= 60 s), on merged main; serve15 kept no library change (every variant lost to session 14's
# behaviour in same-run A/Bs). 1) GPU tests of the serving area: the copy thread (offload fence, per-layer signals)
# and the serving GPU tests. 2) the default serving run at the benchmark's workload (hstu-bench, 4K cached, Zipf 1.0,
# 64 users, GPU pool for 16, batches up to 8, 300 Poisson requests a run, guarded, copy thread on, copy timeline),
# 960/s offered, 2 blocks, and the ideal server (layerflow.bench.serving_ideal) on that run's measured costs and
# stream -> $OUT/serve15/serving-s15-final-h200.json
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve15; mkdir -p "$work"
t0=$SECONDS
echo "=== GPU tests (limit 30s)"
timeout 30 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/transfer/test_issue_thread.py \
  tests/serving/test_serving_gpu.py >"$work/gpu-tests.log" 2>&1
rc=$?; grep -E "[0-9]+ (passed|failed)" "$work/gpu-tests.log" | tail -1
if [ $rc -eq 0 ]; then echo "GPU TESTS PASS"; else echo "GPU TESTS FAIL rc=$rc"; grep -E "^(FAILED|ERROR)" "$work/gpu-tests.log" | head -3; fi
left=$((58 - (SECONDS - t0))); [ $left -lt 26 ] && left=26
echo "=== serving default + ideal (at $((SECONDS - t0))s, limit ${left}s)"
timeout $left python3 - "$work" <<'PY' 2>"$work/serving.stderr"
import sys
from dataclasses import replace
from pathlib import Path

import torch

from layerflow.bench import serving, serving_report
from layerflow.bench.serving_ideal import IdealServer
from layerflow.bench.throughput import ThroughputSettings

work = Path(sys.argv[1])
d = serving.GPU_DEFAULTS
workload = ThroughputSettings(preset=d["preset"], history_len=d["history_len"], append_len=d["append_len"],
                              num_candidates=d["num_candidates"], num_users=64, gpu_users=d["gpu_users"],
                              num_requests=300, rate=960.0, zipf=1.0, batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, (960.0,), ("inprocess",), 2.0, policies=("guarded",), profile=False,
                                   copy_timeline=True, blocks=2)
found = serving.run_serving(settings, torch.device("cuda"))
serving_report.write_json(settings, found, torch.device("cuda"), work / "serving-s15-final-h200.json")
b, cal = found["bound"], found["calibration"]
for r in found["runs"]:
    ci = r["copy_idle"]
    span = ci["busy_s"] + ci["idle_s"]
    print(f"block {r['block']}: {r['throughput']:.0f} req/s = {r['throughput'] / b['rate']:.3f} of the bound "
          f"{b['rate']:.0f}; p50 {r['p50_ms']:.0f} p99 {r['p99_ms']:.0f} ms; {r['batches_per_s']:.0f} batches/s of "
          f"{r['mean_batch']:.2f}; copy busy {ci['busy_s'] / span:.2f}, host late {ci['host_late_s'] / span:.2f}")
ideal = IdealServer(cal.bulk_bytes / cal.bulk_bytes_per_s * 1e3, dict(cal.gpu_hit_ms), 8).serve(workload)
print(f"ideal server, same stream and costs: {ideal['throughput']:.0f} req/s = {ideal['throughput'] / b['rate']:.3f} "
      f"of the bound, {ideal['batches_per_s']:.0f} batches/s, copy busy {ideal['copy_busy']:.2f}")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
[ $rc -ne 0 ] && grep -v "^\s*$" "$work/serving.stderr" | tail -3
exit 0
