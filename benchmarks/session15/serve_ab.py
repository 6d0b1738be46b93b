"""serve15 A/B: the serving variants on one engine, alternated in blocks; prints a short table.

The variants were removed after they lost (docs/serving.md): this runs on a tree at commit 5afb097, which has
layerflow/bench/serving_variants.py. Usage: serve_ab.py OUT_DIR DEVICE REQUESTS BLOCKS VARIANTS RATES [JSON_NAME].
"""
import statistics
import sys
from pathlib import Path

import torch

from layerflow.bench import serving, serving_report
from layerflow.bench.environment import device_name
from layerflow.bench.throughput import ThroughputSettings

work, device, requests, blocks = Path(sys.argv[1]), torch.device(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
variants = tuple(sys.argv[5].split(","))
rates = tuple(float(r) for r in sys.argv[6].split(","))
cpu = device.type == "cpu"
d = serving.CPU_DEFAULTS if cpu else serving.GPU_DEFAULTS
workload = ThroughputSettings(preset=d["preset"], history_len=d["history_len"], append_len=d["append_len"],
                              num_candidates=d["num_candidates"], num_users=16 if cpu else 64,
                              gpu_users=d["gpu_users"], num_requests=requests, rate=800.0, zipf=1.0,
                              batch_size=d["max_batch_size"])
settings = serving.ServingSettings(workload, rates, ("inprocess",), 2.0, policies=("guarded",), profile=True,
                                   copy_timeline=not cpu, blocks=blocks, unloaded=0 if cpu else 40,
                                   copy_threads=(True,), variants=variants)
found = serving.run_serving(settings, device)
name = sys.argv[7] if len(sys.argv) > 7 else "serving-variants.json"
serving_report.write_json(settings, found, device, work / name)
b = found["bound"]
u = found["unloaded"] or {"p50_ms": 0.0, "p99_ms": 0.0}
print(f"bound {b['rate']:.1f} req/s ({b['limited_by']}); unloaded p50 {u['p50_ms']:.2f} p99 {u['p99_ms']:.2f} ms; "
      f"hot share {max(r['hot_user_share'] for r in found['runs']):.3f}")
SCHED = ("prepare ahead", "launch", "collect", "poll")
ENGINE = ("launch.offload", "prepare", "prepare.alloc", "prepare.onboard", "prepare.tiers")
rows = {}
for r in found["runs"]:
    t, ci = r["scheduler"], r.get("copy_idle")
    batches = max(1, t["phases"].get("launch", {"calls": 0})["calls"])
    span = ((ci["busy_s"] + ci["idle_s"]) or 1.0) if ci else 1.0
    rows.setdefault((r["offered_rate"], r["variant"]), []).append(dict(
        rps=r["throughput"], p50=r["p50_ms"] or 0.0, p99=r["p99_ms"] or 0.0, bps=r["batches_per_s"],
        batch=r["mean_batch"], ahead=t["mean_prepared_ahead"], busy=ci["busy_s"] / span if ci else r["copy_busy"],
        host=ci["host_late_s"] / span if ci else 0.0,
        phases={k: v / span for k, v in ci["idle_by_phase_s"].items()} if ci else {},
        sched=[t["phases"].get(p, {"s": 0.0})["s"] * 1e3 / batches for p in SCHED],
        engine=[r.get("engine_phases_ms", {}).get(p, 0.0) / batches for p in ENGINE]))
med = lambda got, k: statistics.median(g[k] for g in got)
order = sorted(rows.items(), key=lambda kv: (-kv[0][0], variants.index(kv[0][1])))
print("| off. | variant | req/s | med | /bound | p50 | p99 | b/s | batch | ahead | busy | host late |")
for (rate, v), got in order:
    m = med(got, "rps")
    each = "/".join(f"{g['rps']:.0f}" for g in got)
    print(f"| {rate:g} | {v} | {each} | {m:.0f} | "
          f"{m / b['rate']:.3f} | {med(got, 'p50'):.1f} | {med(got, 'p99'):.0f} | {med(got, 'bps'):.0f} | "
          f"{med(got, 'batch'):.2f} | {med(got, 'ahead'):.2f} | {med(got, 'busy'):.2f} | {med(got, 'host'):.2f} |")
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
