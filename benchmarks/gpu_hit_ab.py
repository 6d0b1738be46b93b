"""A/B of the engine's launch choices on GPU hits, in one process: an engine per variant, timed in alternated blocks.

A variant is a token bucket and the environment its engine is built under (the variables the kernels read at
construction, e.g. LAYERFLOW_SPLITS, LAYERFLOW_SELF_TILES). Every engine serves the same users (hstu-bench, BS=1,
64 appended + 256 candidates, as `layerflow bench` stages a GPU hit); each block runs `--requests` GPU hits back to
back on every engine in turn (the order rotating), the host clock around `Engine.score` as `bench` times it. Then
torch.profiler records `--profiled` requests per engine: attention and output-gate device time per layer. Scores
are compared with the first variant's (the split count changes the fp32 summation order, so not bit for bit).

    python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --variant old=320 \
        --variant new=320:LAYERFLOW_SPLITS=rows:LAYERFLOW_SELF_TILES=last --out ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerflow.bench.environment import environment  # noqa: E402
from layerflow.bench.settings import GPU_DEFAULTS, Settings, parse_lengths  # noqa: E402
from layerflow.bench.measure import transfer_config  # noqa: E402
from layerflow.bench.workload import Workload  # noqa: E402
from layerflow.model import HSTUWeights  # noqa: E402
from layerflow.runtime.engine import Engine  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    tokens: int
    env: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """'NAME=TOKENS[:KEY=VALUE...]'."""
        try:
            name, rest = text.split("=", 1)
            tokens, *pairs = rest.split(":")
            return cls(name, int(tokens), dict(pair.split("=", 1) for pair in pairs))
        except ValueError:
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=TOKENS[:KEY=VALUE...]") from None


@contextlib.contextmanager
def environment_of(variant: Variant):
    """The process environment with the variant's variables set, restored afterwards."""
    saved = {key: os.environ.get(key) for key in variant.env}
    os.environ.update(variant.env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def gpu_hit(engine: Engine, workload: Workload) -> tuple[float, list[torch.Tensor]]:
    """One GPU hit: the history truncated back (untimed), then the host-clock ms of `score` and its scores."""
    engine.kv.wait_offloads()
    for r in workload.requests:
        engine.kv.truncate(r.user_id, workload.seq_len)
    start = time.perf_counter()
    scores = engine.score(workload.requests)
    return (time.perf_counter() - start) * 1e3, scores


def kernel_us(engine: Engine, workload: Workload, requests: int, layers: int) -> dict[str, float]:
    """Device us per layer of the attention and of the output gate, and of every kernel per request."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(requests):
            gpu_hit(engine, workload)
        torch.cuda.synchronize()
    sums = {"attention": 0.0, "gate": 0.0, "all": 0.0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        sums["all"] += event.device_time_total
        if "attention" in name:
            sums["attention"] += event.device_time_total
        elif "norm_kernel" in name:
            sums["gate"] += event.device_time_total
    return {"attention_us_per_layer": sums["attention"] / requests / layers,
            "norm_us_per_layer": sums["gate"] / requests / layers, "kernels_us": sums["all"] / requests}


def launches(engine: Engine) -> str:
    """What the engine's attentions launch: split rule and count, grid, the rows rule's table, the Gluon tiling."""
    lines = []
    for attn in getattr(engine.pipeline.kernels, "_attention", {}).values():
        table = None if attn.split_table is None else attn.split_table.tolist()
        lines.append(f"split rule {attn.split_rule}, splits {attn.num_splits}, grid ({attn.num_splits}, "
                     f"{attn.query_slots}, {attn.num_heads}), block_m {attn.block_m}, table {table}, gluon "
                     f"{attn.gluon.tiling if attn.gluon else None}")
    return "; ".join(lines) or "no Triton attention"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=parse_lengths, default=(16384, 2048))
    parser.add_argument("--variant", type=Variant.parse, action="append", required=True)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--requests", type=int, default=20, help="GPU hits per engine per block")
    parser.add_argument("--profiled", type=int, default=10, help="profiled GPU hits per engine per length")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    settings = Settings(**{**GPU_DEFAULTS, "seq_lens": args.seq_lens, "batch_size": 1, "scenarios": ("gpu_hit",)})
    weights = HSTUWeights.init(settings.model, seed=0)
    config = replace(transfer_config(settings, None), cpu_cache_gb=1.0, gpu_cache_gb=1.5)
    layers = settings.model.num_layers
    out = {"command": " ".join(["python3"] + sys.argv), "environment": environment(device), "lengths": {}}
    with contextlib.ExitStack() as stack:
        engines = {}
        for v in args.variant:
            start = time.perf_counter()
            try:
                with environment_of(v):
                    engine = stack.enter_context(Engine(weights, config, device=device, batch_buckets=(1,),
                                                        token_buckets=(v.tokens,)))
                    engine.warmup()
            except Exception as error:      # a variant that does not build is reported, the others still run
                print(f"# {v.name}: {v.tokens} tokens {v.env}: FAILED to build: {error!r}"[:2000], flush=True)
                out.setdefault("failed", {})[v.name] = repr(error)
                continue
            engines[v.name] = engine
            print(f"# {v.name}: {v.tokens} tokens {v.env}: {launches(engine)}; built in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        names = list(engines)
        for index, seq_len in enumerate(settings.seq_lens):
            workloads = {}
            for name, engine in engines.items():
                workloads[name] = Workload.build([index], seq_len, settings.append_len, settings.num_candidates,
                                                 settings.model, 0)
                workloads[name].load(engine)
                for _ in range(5):
                    gpu_hit(engine, workloads[name])
            walls = {name: [] for name in names}
            for block in range(args.blocks):
                for name in names[block % len(names):] + names[:block % len(names)]:
                    walls[name] += [gpu_hit(engines[name], workloads[name])[0] for _ in range(args.requests)]
            first = gpu_hit(engines[names[0]], workloads[names[0]])[1]
            rows = {}
            for name in names:
                scores = gpu_hit(engines[name], workloads[name])[1]
                diff = max(float((a - b).abs().max()) for a, b in zip(scores, first))
                rows[name] = {"wall_ms_median": statistics.median(walls[name]),
                              "wall_ms_p10": statistics.quantiles(walls[name], n=10)[0],
                              "wall_ms_p90": statistics.quantiles(walls[name], n=10)[-1],
                              "score_max_diff": diff,
                              **kernel_us(engines[name], workloads[name], args.profiled, layers)}
            out["lengths"][seq_len] = rows
            print(f"### GPU hit at {seq_len} (BS=1, {settings.append_len} + {settings.num_candidates}), {args.blocks} "
                  f"alternated blocks x {args.requests}")
            print("| variant | wall ms median (p10 / p90) | attention us/layer | LayerNorm + gate us/layer | "
                  "kernels us | score diff |\n|---|---|---|---|---|---|")
            for name, r in rows.items():
                print(f"| {name} | {r['wall_ms_median']:.3f} ({r['wall_ms_p10']:.3f} / {r['wall_ms_p90']:.3f}) | "
                      f"{r['attention_us_per_layer']:.1f} | {r['norm_us_per_layer']:.1f} | {r['kernels_us']:.1f} | "
                      f"{r['score_max_diff']:.2e} |", flush=True)
            for name, engine in engines.items():
                workloads[name].drop(engine)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
