"""Host time per phase of one BS=1 request on the CPU path, with the model's compute made small.

The host work of a request (packing, buffer fill, history record, offload issue) depends on the request's shape
(appended tokens, candidates, embedding width) and not on the model's depth, so this harness keeps a preset's
shape and cuts its layers (`--layers`) and history (`--seq-len`) to make the eager forward cheap; it then times the
phases of `layerflow bench --profile` (layerflow/bench/phases.py) over many requests, and optionally writes a
cProfile of the same loop. GPU hits replay one request on a constant history; CPU hits evict the user first.

    python benchmarks/host_phases.py --preset dlrmv3 --layers 1 --seq-len 512 --iters 200
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's layerflow, not an installed one

from layerflow.bench.phases import PhaseTimer, row_names, rows  # noqa: E402
from layerflow.bench.stats import Summary  # noqa: E402
from layerflow.bench.workload import Workload  # noqa: E402
from layerflow.config import Config  # noqa: E402
from layerflow.model import HSTUWeights  # noqa: E402
from layerflow.model.config import PRESETS  # noqa: E402
from layerflow.runtime.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="hstu-bench")
    parser.add_argument("--layers", type=int, help="the preset's layers cut to this many (default: all on a GPU, 1 "
                                                   "on the CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--append-len", type=int, default=64)
    parser.add_argument("--num-candidates", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--scenario", choices=("gpu_hit", "cpu_hit_layerwise"), default="gpu_hit")
    parser.add_argument("--cprofile", help="write the loop's cProfile stats here (and print the top functions)")
    parser.add_argument("--top", type=int, default=25, help="how many functions the cProfile listing prints")
    parser.add_argument("--only", default="", help="the listing's functions restricted to this regex (e.g. layerflow)")
    parser.add_argument("--callees", default=r"\((fill|_batch|offload_early)\)",
                        help="regex of the functions whose callees the listing prints")
    args = parser.parse_args()

    cuda = torch.device(args.device).type == "cuda"
    model = PRESETS[args.preset]
    layers = args.layers or (model.num_layers if cuda else 1)
    model = replace(model, num_layers=layers)
    weights = HSTUWeights.init(model, seed=0)
    config = Config(cpu_cache_gb=1.0, gpu_cache_gb=1.0, enable_layerwise=args.scenario != "gpu_hit")
    tokens = -(-(args.append_len + args.num_candidates) // 64) * 64
    with Engine(weights, config, device=args.device, batch_buckets=(1,),
                token_buckets=(tokens,)) as engine:
        engine.warmup()
        workload = Workload.build([0], args.seq_len, args.append_len, args.num_candidates, model, seed=0)
        workload.load(engine)
        timer = PhaseTimer()
        timer.attach(engine)
        samples: list[dict[str, float]] = []
        profile = cProfile.Profile() if args.cprofile else None
        for _ in range(args.iters):
            engine.kv.truncate(0, args.seq_len)
            if args.scenario != "gpu_hit":
                engine.kv.evict_from_gpu(0)
            timer.start()
            if profile is not None:
                profile.enable()
            start = time.perf_counter()
            engine.score(workload.requests)
            wall = (time.perf_counter() - start) * 1e3
            if profile is not None:
                profile.disable()
            samples.append(rows(timer.stop(), wall))
    print(f"{args.preset} ({layers} layers, {args.device}), {args.scenario}, {args.seq_len} cached + "
          f"{args.append_len} appended + {args.num_candidates} candidates, {args.iters} requests: host ms, median (p90)")
    for name in row_names():
        s = Summary.of([row[name] for row in samples])
        print(f"  {name:26s} {s.median:8.3f} ({s.p90:.3f})")
    if profile is not None:
        profile.dump_stats(args.cprofile)
        stats = pstats.Stats(args.cprofile).sort_stats("tottime")
        stats.print_stats(*[r for r in (args.only,) if r], args.top)
        stats.print_callees(args.callees)


if __name__ == "__main__":
    main()
