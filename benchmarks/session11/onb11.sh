#!/usr/bin/env bash
# onb11 final (<= 80 s, merged main): 1) GPU tests of the copy paths (RUN_BATCH = one cudaMemcpy3DBatchAsync per
# layer, a 2D op per run) and of the issue-timed engine. 2) Serving at 800/s, 4K history, 64 users / GPU pool of 16,
# 600 requests per run, on ONE engine: scheduler policies off / free / guarded x copy paths auto (default) /
# run_batch (a 3D batch op per run) / by_length (auto, but run_batch where the runs average >= 32 pages), the paths
# alternated in 2 blocks per policy: req/s (and of the copy-engine bound), p99, mean batch, prepare.onboard and
# launch.offload host ms per batch, copy busy, an onboarding's host ms from its call to layer 0's copies issued and
# to the call's end (median per transfer). Questions: with run_batch's cheap onboarding issue, does a prefetch policy
# reach >= 0.9 of the bound (issue 19), or beat off? Does by_length beat auto? Everything under $OUT, tarred into
# $OUT/onb11.tgz.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/onb11; mkdir -p "$work"
t0=$SECONDS
git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null | head -1
echo "=== GPU tests (limit 18s)"
timeout 18 python3 -m pytest -m gpu -q -p no:cacheprovider tests/transfer/test_copy_paths.py \
  tests/bench/test_serving_issue.py tests/transfer/test_copy_engine.py \
  >"$work/gpu-tests.log" 2>&1
rc=$?; tail -1 "$work/gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU TESTS PASS"; else echo "GPU TESTS FAIL rc=$rc"; grep -E "^(FAILED|ERROR)|Error" "$work/gpu-tests.log" | head -12; fi
left=$((76 - (SECONDS - t0)))
echo "=== serving 800/s: policies off/free/guarded x copy paths auto/run_batch/by_length, 2 blocks (at $((SECONDS - t0))s, limit ${left}s)"
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
                              num_requests=600, rate=800.0, zipf=1.0, batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, (800.0,), ("inprocess",), 2.0, policies=("off", "free", "guarded"),
                                   profile=True, copy_paths=("auto", "run_batch", "by_length"), blocks=2)
found = serving.run_serving(settings, device)
serving_report.write_json(settings, found, device, work / "serving-policies-paths-h200.json")
(work / "serving-policies-paths.md").write_text(serving_report.markdown(settings, found, device_name(device)) + "\n")
bound = found["bound"]["rate"]
print(f"bound {bound:.1f} req/s ({found['bound']['limited_by']})")
rows = {}
for r in found["runs"]:
    launched = r["scheduler"]["phases"].get("launch", {"calls": 0})["calls"] or 1
    ph, on = r["engine_phases_ms"], r["issue"].get("onboard")
    rows.setdefault((r["policy"], r["copy_path"]), []).append(
        (r["throughput"], r["p99_ms"] or 0.0, r["mean_batch"], ph.get("prepare.onboard", 0) / launched,
         ph.get("launch.offload", 0) / launched, r["copy_busy"], on["layer0_ms"]["median"] if on else 0.0,
         on["total_ms"]["median"] if on else 0.0))
print("| policy | path | req/s per block | median req/s | of bound | p99 ms | mean batch | prepare.onboard ms/batch "
      "| launch.offload ms/batch | copy busy | onboard: to layer 0 issued / whole call ms |")
print("|---" * 11 + "|")
for (policy, path), got in rows.items():
    med = [statistics.median(g[k] for g in got) for k in range(8)]
    print(f"| {policy} | {path} | {' / '.join(f'{g[0]:.1f}' for g in got)} | {med[0]:.1f} | {med[0] / bound:.2f} | "
          f"{med[1]:.1f} | {med[2]:.2f} | {med[3]:.3f} | {med[4]:.3f} | {med[5]:.2f} | {med[6]:.3f} / {med[7]:.3f} |")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then grep "^policy" "$work/serving.stderr"; grep -v "^\s*$" "$work/serving.stderr" | grep -v "^policy" | tail -8; fi
tar -C "$OUT" -czf "$OUT/onb11.tgz" onb11 && echo "wrote $OUT/onb11.tgz"
