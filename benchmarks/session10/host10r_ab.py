"""host10r A/B on the H200 host, one process: GPU-hit wall per request (BS=1, 64 appended + 256 candidates) for the
proven path (staging batch, reap before) and the new default (slab, after), two engines side by side with their
requests alternated in blocks (so neither runs on a warmer host), at each history length given; then the phases of
both (PhaseTimer, alternated again). Scores must be bitwise equal."""
import json, statistics, sys, time
import torch
from layerflow.bench.phases import PhaseTimer, row_names, rows
from layerflow.bench.workload import Workload
from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS

from layerflow.runtime.engine import Engine

out = sys.argv[1]
seqs = [int(s) for s in sys.argv[2].split(",")]
model = PRESETS["hstu-bench"]
weights = HSTUWeights.init(model, seed=0)
MODES = {"batch+before": ("batch", "before"), "slab+after": ("slab", "after")}
res = {}
for seq in seqs:
    engines, loads = {}, {}
    for mode, (staging, reap) in MODES.items():
        cfg = Config(cpu_cache_gb=1.0, gpu_cache_gb=1.0, enable_layerwise=False)
        e = Engine(weights, cfg, device="cuda", batch_buckets=(1,), token_buckets=(320,), staging=staging, reap=reap)
        e.warmup()
        wl = Workload.build([0], seq, 64, 256, model, seed=0)
        wl.load(e)
        engines[mode], loads[mode] = e, wl

    def one(mode, timer=None):
        e, wl = engines[mode], loads[mode]
        e.kv.truncate(0, seq)
        if timer is not None:
            timer.start()
        t = time.perf_counter(); s = e.score(wl.requests); w = (time.perf_counter() - t) * 1e3
        return w, s, (rows(timer.stop(), w) if timer is not None else None)

    for mode in engines:
        for _ in range(20): one(mode)
    walls = {m: [] for m in engines}
    for block in range(8):
        for mode in (list(MODES) if block % 2 == 0 else list(MODES)[::-1]):
            for _ in range(30):
                walls[mode].append(one(mode)[0])
    same = torch.equal(one("batch+before")[1][0], one("slab+after")[1][0])
    r = res[seq] = {"scores_bitwise_equal": same, "wall_ms": {}}
    print(f"GPU hit {seq} BS=1, wall ms over {len(walls['batch+before'])} requests each (alternated blocks), "
          f"scores bitwise equal: {same}")
    print("| path | median | p10 | p90 | mean |")
    print("|---|---|---|---|---|")
    for mode, w in walls.items():
        q = statistics.quantiles(w, n=10)
        r["wall_ms"][mode] = {"median": statistics.median(w), "p10": q[0], "p90": q[-1], "mean": statistics.fmean(w)}
        print(f"| {mode} | {statistics.median(w):.3f} | {q[0]:.3f} | {q[-1]:.3f} | {statistics.fmean(w):.3f} |")
    timers = {}
    for mode, e in engines.items():
        timers[mode] = PhaseTimer(); timers[mode].attach(e)
    samples = {m: [] for m in engines}
    for block in range(6):
        for mode in (list(MODES) if block % 2 == 0 else list(MODES)[::-1]):
            for _ in range(20):
                samples[mode].append(one(mode, timers[mode])[2])
    print(f"| phase {seq} (ms, median) | " + " | ".join(MODES) + " |")
    print("|---" * (len(MODES) + 1) + "|")
    r["phases_ms"] = {}
    for name in row_names():
        med = {m: statistics.median(s[name] for s in samples[m]) for m in MODES}
        r["phases_ms"][name] = med
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in med.values()) + " |")
    for e in engines.values():
        e.close()
    json.dump(res, open(f"{out}/ab.json", "w"), indent=1)
    print(flush=True)
