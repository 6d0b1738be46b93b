"""serve16 A/B: the serving benchmark's scheduler variants (layerflow.bench.serving_variants) on one engine,
alternated in blocks, at the benchmark's workload (hstu-bench, 4K cached, Zipf 1.0, 64 users, GPU pool for 16, batches
up to 8, Poisson arrivals, guarded, copy thread on, copy timeline); prints a short table.

Usage: serve_ab.py OUT_DIR DEVICE REQUESTS BLOCKS VARIANTS RATES JSON_NAME [--trace] [--unloaded N]
With --trace the runs' raw timelines go to JSON_NAME with "-trace" before ".json" (they stay out of JSON_NAME).
"sust" is the answer rate between the 10th and the 90th percentile answer (the run's start and its drain left out),
"ideal" the ideal server's rate on the same arrivals and costs (layerflow.bench.serving_ideal).
"""
import json
import statistics
import sys
from pathlib import Path

import torch

from layerflow.bench import serving, serving_report
from layerflow.bench.throughput import ThroughputSettings

args = [a for a in sys.argv[1:] if not a.startswith("--")]
trace = "--trace" in sys.argv
unloaded = int(sys.argv[sys.argv.index("--unloaded") + 1]) if "--unloaded" in sys.argv else 0
if unloaded:
    args.remove(str(unloaded))
work, device, requests, blocks = Path(args[0]), torch.device(args[1]), int(args[2]), int(args[3])
variants = tuple(args[4].split(","))
rates = tuple(float(r) for r in args[5].split(","))
name = args[6]
cpu = device.type == "cpu"
d = serving.CPU_DEFAULTS if cpu else serving.GPU_DEFAULTS
workload = ThroughputSettings(preset=d["preset"], history_len=d["history_len"], append_len=d["append_len"],
                              num_candidates=d["num_candidates"], num_users=16 if cpu else 64,
                              gpu_users=d["gpu_users"], num_requests=requests, rate=800.0, zipf=1.0,
                              batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, rates, ("inprocess",), 2.0, policies=("guarded",), profile=True,
                                   copy_timeline=not cpu, blocks=blocks, unloaded=unloaded, copy_threads=(True,),
                                   variants=variants, trace=trace)
found = serving.run_serving(settings, device)


traces = [dict(block=r["block"], variant=r["variant"], rate=r["offered_rate"], **r.pop("trace"))
          for r in found["runs"] if "trace" in r]
serving_report.write_json(settings, found, device, work / name)
if traces:
    (work / name.replace(".json", "-trace.json")).write_text(json.dumps(traces) + "\n")
b = found["bound"]
u = found["unloaded"] or {"p50_ms": 0.0, "p99_ms": 0.0}
print(f"bound {b['rate']:.1f} req/s ({b['limited_by']}); unloaded p50 {u['p50_ms']:.2f} p99 {u['p99_ms']:.2f} ms; "
      f"hot share {max(r['hot_user_share'] for r in found['runs']):.3f}")
SCHED = ("prepare ahead", "launch", "collect", "poll")
ENGINE = ("launch.offload", "prepare", "prepare.alloc", "prepare.onboard", "collect.fetch")
rows = {}
for r in found["runs"]:
    t, ci = r["scheduler"], r.get("copy_idle")
    batches = max(1, t["phases"].get("launch", {"calls": 0})["calls"])
    span = ((ci["busy_s"] + ci["idle_s"]) or 1.0) if ci else 1.0
    wall = t["wall_s"] or 1.0
    cpu_s = r.get("thread_cpu_s", {})
    rows.setdefault((r["offered_rate"], r["variant"]), []).append(dict(
        rps=r["throughput"], sus=r["sustained_rate"], ideal=r["ideal_throughput"], p50=r["p50_ms"] or 0.0,
        p99=r["p99_ms"] or 0.0,
        bps=r["batches_per_s"], batch=r["mean_batch"], busy=ci["busy_s"] / span if ci else r["copy_busy"],
        host=ci["host_late_s"] / span if ci else 0.0,
        cpu=[cpu_s.get(k, 0.0) / wall for k in ("layerflow-scheduler", "layerflow-copy-issue", "MainThread")],
        phases={k: v / span for k, v in ci["idle_by_phase_s"].items()} if ci else {},
        sched=[t["phases"].get(p, {"s": 0.0})["s"] * 1e3 / batches for p in SCHED],
        engine=[r.get("engine_phases_ms", {}).get(p, 0.0) / batches for p in ENGINE]))
med = lambda got, k: statistics.median(g[k] for g in got)
order = sorted(rows.items(), key=lambda kv: (-kv[0][0], variants.index(kv[0][1])))
print("| off. | variant | req/s | med | /bound | sust | ideal | p50 | p99 | b/s | batch | busy | late | cpu s/c/m |")
for (rate, v), got in order:
    m = med(got, "rps")
    each = "/".join(f"{g['rps']:.0f}" for g in got)
    cpu_frac = "/".join(f"{statistics.median(g['cpu'][i] for g in got):.2f}" for i in range(3))
    print(f"| {rate:g} | {v} | {each} | {m:.0f} | {m / b['rate']:.3f} | {med(got, 'sus'):.0f} | "
          f"{med(got, 'ideal'):.0f} | "
          f"{med(got, 'p50'):.1f} | {med(got, 'p99'):.0f} | {med(got, 'bps'):.0f} | {med(got, 'batch'):.2f} | "
          f"{med(got, 'busy'):.2f} | {med(got, 'host'):.2f} | {cpu_frac} |")
print("| off. | variant | sched ms/b " + "/".join(SCHED) + " | eng ms/b " + "/".join(ENGINE) + " | idle by phase |")
for (rate, v), got in order:
    sched = [statistics.median(g["sched"][i] for g in got) for i in range(len(SCHED))]
    engine = [statistics.median(g["engine"][i] for g in got) for i in range(len(ENGINE))]
    phases = {}
    for g in got:
        for k, x in g["phases"].items():
            phases[k] = phases.get(k, 0.0) + x / len(got)
    top = ", ".join(f"{k} {x:.3f}" for k, x in sorted(phases.items(), key=lambda kv: -kv[1])[:3]) or "-"
    print(f"| {rate:g} | {v} | {'/'.join(f'{x:.2f}' for x in sched)} | {'/'.join(f'{x:.2f}' for x in engine)} | "
          f"{top} |")
