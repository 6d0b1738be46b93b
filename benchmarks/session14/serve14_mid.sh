#!/usr/bin/env bash
# serve14 mid (<= 90 s; supersedes serve14.sh). 1) GPU tests: the copy thread's offload fence + per-layer waitvalue
# signals, and host hits issued by the copy thread scoring bitwise as issued by the caller. 2) the serving benchmark's
# workload (hstu-bench, 4K cached, Zipf 1.0, 64 users, GPU pool for 16, batches up to 8, 300 Poisson requests a run),
# policy guarded, one engine per copy_thread value (off / on), each run at GIL switch interval 0 (Python's 5 ms) and
# 0.5 ms (serve_switch_interval_ms), the 4 modes alternated in 2 blocks (the second reversed) at 960 and 880 offered,
# copy timeline and engine phases on: req/s, of bound, p50/p99, batches/s, hot-user cap, device copy busy and its idle
# split, the scheduler's and the engine's ms per batch by phase.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve14; mkdir -p "$work"
t0=$SECONDS
git log --oneline -1 2>/dev/null
echo "=== GPU tests (limit 30s)"
timeout 30 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/transfer/test_issue_thread.py \
  tests/serving/test_serving_gpu.py -k "callers_stream or copy_thread" >"$work/gpu-tests.log" 2>&1
rc=$?; grep -E "[0-9]+ (passed|failed)" "$work/gpu-tests.log" | tail -1
if [ $rc -eq 0 ]; then echo "GPU TESTS PASS"; else echo "GPU TESTS FAIL rc=$rc"; grep -E "^(FAILED|ERROR)|Error" "$work/gpu-tests.log" | head -4; fi
left=$((88 - (SECONDS - t0))); [ $left -lt 50 ] && left=50
echo "=== serving: copy thread off|on x switch 5|0.5 ms, 960/880 offered, 2 blocks (at $((SECONDS - t0))s, limit ${left}s)"
timeout $left python3 - "$work" cuda 300 2 <<'PY' 2>"$work/serving.stderr"
import statistics
import sys
from pathlib import Path

import torch

from layerflow.bench import serving, serving_report
from layerflow.bench.environment import device_name
from layerflow.bench.throughput import ThroughputSettings

work, device, requests, blocks = Path(sys.argv[1]), torch.device(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cpu = device.type == "cpu"   # a dry run of this table on the CPU path
d = serving.CPU_DEFAULTS if cpu else serving.GPU_DEFAULTS
workload = ThroughputSettings(preset=d["preset"], history_len=d["history_len"], append_len=d["append_len"],
                              num_candidates=d["num_candidates"], num_users=16 if cpu else 64,
                              gpu_users=d["gpu_users"], num_requests=requests, rate=800.0, zipf=1.0,
                              batch_size=d["max_batch_size"])
rates = (200.0, 100.0) if cpu else (960.0, 880.0)
settings = serving.ServingSettings(workload, rates, ("inprocess",), 2.0, policies=("guarded",), profile=True,
                                   copy_timeline=not cpu, blocks=blocks, unloaded=40, copy_threads=(False, True),
                                   switch_intervals_ms=(0.0, 0.5))
found = serving.run_serving(settings, device)
serving_report.write_json(settings, found, device, work / "serving-mid.json")
(work / "serving-mid.md").write_text(serving_report.markdown(settings, found, device_name(device)) + "\n")
b, u = found["bound"], found["unloaded"]
print(f"bound {b['rate']:.1f} req/s ({b['limited_by']}, {b['onboard_bytes_per_request'] / 1e6:.1f} MB/req); unloaded "
      f"p50 {u['p50_ms']:.2f} p99 {u['p99_ms']:.2f} ms; hot share "
      f"{max(r['hot_user_share'] for r in found['runs']):.3f}")
SCHED = ("prepare ahead", "launch", "collect", "poll")
ENGINE = ("prepare.onboard", "launch.offload", "collect.fetch")
rows = {}
for r in found["runs"]:
    t, ci = r["scheduler"], r.get("copy_idle")
    batches = max(1, t["phases"].get("launch", {"calls": 0})["calls"])
    span = (ci["busy_s"] + ci["idle_s"]) or 1.0 if ci else 1.0
    rows.setdefault((r["offered_rate"], r["copy_thread"], r["switch_interval_ms"]), []).append(dict(
        rps=r["throughput"], p50=r["p50_ms"] or 0.0, p99=r["p99_ms"] or 0.0, bps=r["batches_per_s"],
        cap=r["hot_user_cap"], batch=r["mean_batch"],
        busy=ci["busy_s"] / span if ci else 0.0, host=ci["host_late_s"] / span if ci else 0.0,
        dev=ci["device_late_s"] / span if ci else 0.0,
        phases={k: v / span for k, v in ci["idle_by_phase_s"].items()} if ci else {},
        sched=[t["phases"].get(p, {"s": 0.0})["s"] * 1e3 / batches for p in SCHED],
        engine=[r["engine_phases_ms"].get(p, 0.0) / batches for p in ENGINE]))
order = sorted(rows.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2]))
med = lambda got, k: statistics.median(g[k] for g in got)
print("| off. | thr | sw | req/s | med | /bound | p50 | p99 | b/s | cap | batch | busy | late h/d |")
for (rate, thread, sw), got in order:
    m, each = med(got, "rps"), "/".join(f"{g['rps']:.0f}" for g in got)
    print(f"| {rate:g} | {'on' if thread else 'off'} | {sw:g} | {each} | {m:.0f} | {m / b['rate']:.3f} | "
          f"{med(got, 'p50'):.1f} | {med(got, 'p99'):.0f} | {med(got, 'bps'):.0f} | {med(got, 'cap'):.0f} | "
          f"{med(got, 'batch'):.2f} | {med(got, 'busy'):.2f} | {med(got, 'host'):.2f}/{med(got, 'dev'):.2f} |")
print("| off. | thr | sw | sched ms/b " + "/".join(SCHED) + " | engine ms/b " + "/".join(ENGINE) + " | idle by phase |")
for (rate, thread, sw), got in order:
    sched = [statistics.median(g["sched"][i] for g in got) for i in range(len(SCHED))]
    engine = [statistics.median(g["engine"][i] for g in got) for i in range(len(ENGINE))]
    phases = {}
    for g in got:
        for k, v in g["phases"].items():
            phases[k] = phases.get(k, 0.0) + v / len(got)
    top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])[:3]) or "-"
    print(f"| {rate:g} | {'on' if thread else 'off'} | {sw:g} | {'/'.join(f'{x:.2f}' for x in sched)} | "
          f"{'/'.join(f'{x:.2f}' for x in engine)} | {top} |")
PY
rc=$?; echo "=== serving rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then
  grep "^policy" "$work/serving.stderr" | sed 's/policy guarded, //; s/inprocess, //' | tail -16
  grep -v "^policy" "$work/serving.stderr" | grep -v "^\s*$" | tail -3
fi
