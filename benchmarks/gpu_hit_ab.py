"""A/B of the engine's launch choices on GPU hits, in one process: an engine per variant, timed in alternated blocks.

A variant is a token bucket and the attention's split rule and self-tile split (PagedAttention's `splits`,
GluonTiling's `self_last`: the new defaults "rows" and "last", main's before them "bucket" and "first"). Every engine
serves the same users (hstu-bench, BS=1, 64 appended + 256 candidates, as `layerflow bench` stages a GPU hit); each
block runs `--requests` GPU hits back to back on every engine in turn (the order rotating), the host clock around
`Engine.score` as `bench` times it. Then torch.profiler records `--profiled` requests per engine: attention and
output-gate device time per layer. Each variant's scores are compared with the float64 recompute of the same request
on the GPU (full_forward over history + appended + candidates): max |diff| / max |reference| and the top-10 overlap.
`--ladders` then builds engines over the token ladders of those steps (every batch bucket) and times their warm-up.

    python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --variant main=512:bucket:first --variant new=320 \
        --ladders 4,1 --out ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerflow.bench.environment import environment  # noqa: E402
from layerflow.bench.settings import GPU_DEFAULTS, Settings, parse_lengths  # noqa: E402
from layerflow.bench.measure import transfer_config  # noqa: E402
from layerflow.bench.workload import Workload  # noqa: E402
from layerflow.kernels.attention import PagedAttention  # noqa: E402
from layerflow.kernels.gluon_attention import default_gluon_tiling  # noqa: E402
from layerflow.kernels.splits import SPLIT_RULES  # noqa: E402
from layerflow.model import HSTUConfig, HSTUWeights, full_forward  # noqa: E402
from layerflow.model.layer import LayerWeights  # noqa: E402
from layerflow.runtime.buffers import token_ladder  # noqa: E402
from layerflow.runtime.engine import TOKEN_BUCKETS, Engine  # noqa: E402

SELF_TILES = ("last", "first")


@dataclass(frozen=True)
class Variant:
    name: str
    tokens: int
    splits: str = SPLIT_RULES[0]
    self_tiles: str = SELF_TILES[0]

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """'NAME=TOKENS[:SPLIT_RULE[:first|last]]'."""
        try:
            name, rest = text.split("=", 1)
            tokens, *options = rest.split(":")
            variant = cls(name, int(tokens), *options)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=TOKENS[:SPLIT_RULE[:first|last]]") \
                from None
        if variant.splits not in SPLIT_RULES or variant.self_tiles not in SELF_TILES:
            raise argparse.ArgumentTypeError(f"variant {text!r}: split rule in {SPLIT_RULES}, self tiles in "
                                             f"{SELF_TILES}")
        return variant


@contextlib.contextmanager
def launch_settings(variant: Variant):
    """Every PagedAttention built inside takes the variant's split rule and, over the model's dtype (the Gluon
    kernel's pages), its self-tile split."""
    real_init = PagedAttention.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("splits", variant.splits)
        head_dim, page_size = args[4], args[5]
        if kwargs.get("kv_dtype") is None:
            kwargs.setdefault("gluon_tiling", replace(default_gluon_tiling(head_dim, page_size),
                                                      self_last=variant.self_tiles == "last"))
        real_init(self, *args, **kwargs)

    PagedAttention.__init__ = init
    try:
        yield
    finally:
        PagedAttention.__init__ = real_init


def float64_weights(weights: HSTUWeights, device: torch.device) -> HSTUWeights:
    """The same weights' values in float64 on `device`, under the config's float64 twin."""
    config = HSTUConfig(**{**weights.config.to_dict(), "dtype": "float64"})

    def wide(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, torch.float64)

    layers = [LayerWeights(**{f.name: wide(getattr(layer, f.name)) for f in fields(LayerWeights)})
              for layer in weights.layers]
    return HSTUWeights(config, wide(weights.item_embedding), wide(weights.position_embedding), layers)


def reference_scores(weights64: HSTUWeights, workload: Workload) -> list[torch.Tensor]:
    """The float64 recompute of every request of `workload` (history + appended as one sequence, the candidates its
    targets), on the host."""
    out = []
    for r in workload.requests:
        out.append(full_forward(weights64, [workload.histories[r.user_id] + r.items], [r.candidates]).scores.cpu())
    torch.cuda.empty_cache()
    return out


def agreement(scores: list[torch.Tensor], against: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """max |scores - against| / max |reference| over the requests."""
    return max(float((a.double() - b.double()).abs().max() / r.abs().max())
               for a, b, r in zip(scores, against, reference))


def top10_overlap(scores: list[torch.Tensor], reference: list[torch.Tensor]) -> int:
    """The fewest of the reference's 10 best candidates that `scores` also ranks in its 10 best, over the requests."""
    return min(len(set(s.topk(10).indices.tolist()) & set(r.topk(10).indices.tolist()))
               for s, r in zip(scores, reference))


def gpu_hit(engine: Engine, workload: Workload) -> tuple[float, list[torch.Tensor]]:
    """One GPU hit: the history truncated back (untimed), then the host-clock ms of `score` and its scores."""
    engine.kv.wait_offloads()
    for r in workload.requests:
        engine.kv.truncate(r.user_id, workload.seq_len)
    start = time.perf_counter()
    scores = engine.score(workload.requests)
    return (time.perf_counter() - start) * 1e3, scores


def loaded_workloads(engines: dict[str, Engine], settings: Settings, index: int,
                     seq_len: int) -> dict[str, Workload]:
    """Each engine's copy of user `index`'s request at `seq_len` (the same history and items), its history loaded
    and five GPU hits run (warm)."""
    workloads = {}
    for name, engine in engines.items():
        workloads[name] = Workload.build([index], seq_len, settings.append_len, settings.num_candidates,
                                         settings.model, 0)
        workloads[name].load(engine)
        for _ in range(5):
            gpu_hit(engine, workloads[name])
    return workloads


def alternated_walls(engines: dict[str, Engine], workloads: dict[str, Workload], blocks: int,
                     requests: int) -> dict[str, list[float]]:
    """GPU-hit host ms per engine: `blocks` blocks of `requests` hits on every engine in turn, the order rotating."""
    names = list(engines)
    walls = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            walls[name] += [gpu_hit(engines[name], workloads[name])[0] for _ in range(requests)]
    return walls


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
        if "attention" in name or "gluon_fp8_kernel" in name:     # the fp8 Gluon kernel's name lacks the word
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


def ladder_warmup(weights: HSTUWeights, config, device: torch.device, steps: int) -> dict:
    """An engine over every batch bucket and the token ladder of `steps` per octave between TOKEN_BUCKETS' ends:
    its buckets and graphs, build and warm-up seconds, the split workspace and the device memory it holds."""
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    tokens = token_ladder(TOKEN_BUCKETS[0], TOKEN_BUCKETS[-1], steps)
    with Engine(weights, config, device=device, token_buckets=tokens) as engine:
        built = time.perf_counter() - start
        engine.warmup()
        workspace = getattr(engine.pipeline.kernels, "workspace", None)   # None: no Triton kernels (CPU)
        return {"steps": steps, "token_sizes": len(tokens), "buckets": len(engine.buckets),
                "graphs": 2 * len(engine.buckets), "build_s": built, "warmup_s": time.perf_counter() - start - built,
                "workspace_mib": (workspace.nbytes if workspace else 0) / 2 ** 20,
                "allocated_mib": (torch.cuda.memory_allocated(device) - allocated) / 2 ** 20,
                "reserved_mib": (torch.cuda.memory_reserved(device) - reserved) / 2 ** 20}


def build_engines(variants: list[Variant], weights: HSTUWeights, config, device: torch.device,
                  stack: contextlib.ExitStack, out: dict) -> dict[str, Engine]:
    """A warmed-up BS=1 engine per variant over its one token bucket; one that does not build is reported."""
    engines = {}
    for v in variants:
        start = time.perf_counter()
        try:
            with launch_settings(v):
                engine = stack.enter_context(Engine(weights, config, device=device, batch_buckets=(1,),
                                                    token_buckets=(v.tokens,)))
                engine.warmup()
        except Exception as error:      # a variant that does not build is reported, the others still run
            print(f"# {v}: FAILED to build: {error!r}"[:2000], flush=True)
            out.setdefault("failed", {})[v.name] = repr(error)
            continue
        engines[v.name] = engine
        print(f"# {v}: {launches(engine)}; built in {time.perf_counter() - start:.1f} s", flush=True)
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=parse_lengths, default=(16384, 2048))
    parser.add_argument("--variant", type=Variant.parse, action="append", required=True)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--requests", type=int, default=20, help="GPU hits per engine per block")
    parser.add_argument("--profiled", type=int, default=10, help="profiled GPU hits per engine per length")
    parser.add_argument("--ladders", type=lambda t: [int(s) for s in t.split(",") if s.strip()], default=[],
                        help="token ladder steps whose engines' warm-up to time afterwards, e.g. 1,4,4")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    settings = Settings(**{**GPU_DEFAULTS, "seq_lens": args.seq_lens, "batch_size": 1, "scenarios": ("gpu_hit",)})
    weights = HSTUWeights.init(settings.model, seed=0)
    weights64 = float64_weights(weights, device)
    config = replace(transfer_config(settings, None), cpu_cache_gb=1.0, gpu_cache_gb=1.5)
    layers = settings.model.num_layers
    out = {"command": " ".join(["python3"] + sys.argv), "environment": environment(device), "lengths": {}}
    with contextlib.ExitStack() as stack:
        engines = build_engines(args.variant, weights, config, device, stack, out)
        names = list(engines)
        for index, seq_len in enumerate(settings.seq_lens):
            workloads = loaded_workloads(engines, settings, index, seq_len)
            walls = alternated_walls(engines, workloads, args.blocks, args.requests)
            reference = reference_scores(weights64, workloads[names[0]])
            first = gpu_hit(engines[names[0]], workloads[names[0]])[1]
            rows = {}
            for name in names:
                scores = gpu_hit(engines[name], workloads[name])[1]
                rows[name] = {"wall_ms_median": statistics.median(walls[name]),
                              "wall_ms_p10": statistics.quantiles(walls[name], n=10)[0],
                              "wall_ms_p90": statistics.quantiles(walls[name], n=10)[-1],
                              "relative_diff_vs_first": agreement(scores, first, reference),
                              "relative_diff_vs_float64": agreement(scores, reference, reference),
                              "top10_overlap_vs_float64": top10_overlap(scores, reference),
                              **kernel_us(engines[name], workloads[name], args.profiled, layers)}
            out["lengths"][seq_len] = {"reference_max_abs": max(float(r.abs().max()) for r in reference), **rows}
            print(f"### GPU hit at {seq_len} (BS=1, {settings.append_len} + {settings.num_candidates}), {args.blocks} "
                  f"alternated blocks x {args.requests}; float64 scores' max |s| "
                  f"{out['lengths'][seq_len]['reference_max_abs']:.1f}; diffs are max |d| / max |float64 s|")
            print(f"| variant | wall ms median (p10 / p90) | attention us/layer | LayerNorm + gate us/layer | "
                  f"kernels us | diff vs {names[0]} | diff vs float64 | top-10 vs float64 |\n"
                  f"|---|---|---|---|---|---|---|---|")
            for name, r in rows.items():
                print(f"| {name} | {r['wall_ms_median']:.3f} ({r['wall_ms_p10']:.3f} / {r['wall_ms_p90']:.3f}) | "
                      f"{r['attention_us_per_layer']:.1f} | {r['norm_us_per_layer']:.1f} | {r['kernels_us']:.1f} | "
                      f"{r['relative_diff_vs_first']:.1e} | {r['relative_diff_vs_float64']:.1e} | "
                      f"{r['top10_overlap_vs_float64']}/10 |", flush=True)
            for name, engine in engines.items():
                workloads[name].drop(engine)
    write(args.out, out)
    for steps in args.ladders:
        cost = ladder_warmup(weights, config, device, steps)
        out.setdefault("ladders", []).append(cost)
        print("# ladder " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in cost.items()), flush=True)
        write(args.out, out)


def write(path: str | None, out: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
