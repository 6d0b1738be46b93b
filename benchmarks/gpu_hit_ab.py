"""A/B of the engine's launch choices on GPU hits, in one process: an engine per variant, timed in alternated blocks.

A variant is a token bucket and the attention's split rule and self-tile split (PagedAttention's `splits`,
GluonTiling's `self_last`: the new defaults "rows" and "last", main's before them "bucket" and "first"). Every engine
serves the same users (hstu-bench, BS=1, 64 appended + 256 candidates, as `layerflow bench` stages a GPU hit); each
block runs `--requests` GPU hits back to back on every engine in turn (the order rotating), the host clock around
`Engine.score` as `bench` times it. Then torch.profiler records `--profiled` requests per engine: attention and
output-gate device time per layer, the device span of a request's graph kernels (first start to last end, copies left
out) and the split count each attention launched. Each variant's scores are compared with the float64 recompute of
the same request on the GPU (full_forward over history + appended + candidates): max |diff| / max |reference| and the
top-10 overlap. `--phases` times every engine's host phases (`layerflow bench --profile`'s, bench/phases.py) in
`--phase-blocks` more alternated blocks after the walls, and prints each variant's medians (its timers are attached
from the start, so every wall of that run pays the same wrappers).
`--ladders` then builds engines over the token ladders of those steps (every batch bucket) and times their warm-up.
`--sweep-splits` then times the attention and its gate alone per fixed split count (8 layers' pages in one graph).

    python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --variant main=512:bucket:first --variant new=320 \
        --ladders 4,1 --sweep-splits 2,4,8,11 --out ab.json
    python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --variant new=320 --phases --out phases.json
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
from benchmarks.kernel_breakdown import spans_us  # noqa: E402
from layerflow.kernels.attention import PagedAttention  # noqa: E402
from layerflow.kernels.gluon_attention import default_gluon_tiling  # noqa: E402
from layerflow.kernels.pointwise import gated_split_norm  # noqa: E402
from layerflow.kernels.splits import SPLIT_RULES  # noqa: E402
from layerflow.kernels.tiling import default_tiling  # noqa: E402
from layerflow.model import HSTUConfig, HSTUWeights, full_forward  # noqa: E402
from layerflow.model.layer import LayerWeights  # noqa: E402
from layerflow.runtime.buffers import token_ladder  # noqa: E402
from layerflow.runtime.engine import TOKEN_BUCKETS, Engine  # noqa: E402
from layerflow.bench.phases import PhaseTimer, row_names, rows as phase_rows  # noqa: E402

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
        form = "NAME=TOKENS[:SPLIT_RULE[:first|last]]"
        try:
            name, rest = text.split("=", 1)
            tokens, *options = rest.split(":")
            variant = cls(name, int(tokens), *options)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected {form}") from None
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


def gpu_hit(engine: Engine, workload: Workload, timer: PhaseTimer | None = None) -> tuple[float, list[torch.Tensor]]:
    """One GPU hit: the history truncated back (untimed), then the host-clock ms of `score` and its scores; with a
    `timer` (attached to `engine`), its phases recorded for this request."""
    engine.kv.wait_offloads()
    for r in workload.requests:
        engine.kv.truncate(r.user_id, workload.seq_len)
    if timer is not None:
        timer.start()
    start = time.perf_counter()
    scores = engine.score(workload.requests)
    return (time.perf_counter() - start) * 1e3, scores


def alternated_phases(engines: dict[str, Engine], timers: dict[str, PhaseTimer], workloads: dict[str, Workload],
                      blocks: int, requests: int) -> dict[str, dict[str, float]]:
    """Median host ms of every phase row per engine over `blocks` alternated blocks of `requests` timed GPU hits."""
    names = list(engines)
    samples = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            for _ in range(requests):
                wall = gpu_hit(engines[name], workloads[name], timers[name])[0]
                samples[name].append(phase_rows(timers[name].stop(), wall))
    return {name: {row: statistics.median(s[row] for s in samples[name]) for row in row_names()}
            for name in names}


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
    """Device us per layer of the attention and of the LayerNorms + gate, of every kernel per request, and the median
    span of a request's kernels (copies left out: the offload's D2H runs beside them)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(requests):
            gpu_hit(engine, workload)
        torch.cuda.synchronize()
    sums = {"attention": 0.0, "gate": 0.0, "all": 0.0}
    intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        sums["all"] += event.device_time_total
        if "attention" in name or "gluon_fp8_kernel" in name:     # the fp8 Gluon kernel's name lacks the word
            sums["attention"] += event.device_time_total
        elif "norm_kernel" in name:
            sums["gate"] += event.device_time_total
        if "memcpy" not in name and "memset" not in name:
            intervals.append((event.time_range.start, event.time_range.end))
    spans = spans_us(intervals)
    return {"attention_us_per_layer": sums["attention"] / requests / layers,
            "norm_us_per_layer": sums["gate"] / requests / layers, "kernels_us": sums["all"] / requests,
            "span_us_median": statistics.median(spans) if spans else 0.0}


def launches(engine: Engine) -> str:
    """What the engine's attentions launch: split rule and count, grid, the rows rule's table, the Gluon tiling."""
    lines = []
    for attn in getattr(engine.pipeline.kernels, "_attention", {}).values():
        table = None if attn.split_table is None else attn.split_table.tolist()
        lines.append(f"split rule {attn.split_rule}, splits {attn.num_splits}, grid ({attn.num_splits}, "
                     f"{attn.query_slots}, {attn.num_heads}), block_m {attn.block_m}, table {table}, gluon "
                     f"{attn.gluon.tiling if attn.gluon else None}")
    return "; ".join(lines) or "no Triton attention"


def active_splits(engine: Engine) -> str:
    """The split count each "rows" attention of the engine launched last (its device count), "-" for none."""
    counts = [str(int(attn.active_splits)) for attn in getattr(engine.pipeline.kernels, "_attention", {}).values()
              if attn.active_splits is not None]
    return ",".join(counts) or "-"


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


def split_sweep(settings: Settings, seq_len: int, counts: list[int], blocks: int, replays: int,
                device: torch.device) -> dict[int, float]:
    """us per layer of the attention plus its gate at each split count (the "rows" rule's table under a capacity
    count of that many: the engine's kernel; ValueError if a launch took another count), hstu-bench's request
    (BS=1, 64 appended + 256 candidates, 320-token capacity) over 8 layers' own pages in one captured graph, the
    counts (each >= 2: one split writes no partials) timed in alternated blocks of `replays` replays."""
    m, page, tokens = settings.model, 32, settings.append_len + settings.num_candidates
    keys = seq_len + settings.append_len
    pages = -(-keys // page)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(m.dtype)

    caches = [randn(pages, 2, page, m.num_heads, m.dqk) for _ in range(m.num_layers)]
    table = torch.randperm(pages, device=device, dtype=torch.int32).view(1, pages)
    offsets = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    history = torch.tensor([keys], dtype=torch.int32, device=device)
    appended = torch.tensor([settings.append_len], dtype=torch.int32, device=device)
    q, k, v = randn(tokens, m.num_heads, m.dqk), randn(tokens, m.num_heads, m.dqk), randn(tokens, m.num_heads, m.dqk)
    u, w, b = randn(tokens, m.num_heads * m.dv), randn(m.num_heads * m.dv), randn(m.num_heads * m.dv)
    gated = torch.empty_like(u)
    # The attentions outlive their graphs' replays: a graph holds no reference to the buffers it was captured on,
    # and the next capture's empty_cache would hand a dropped attention's partials and split table back.
    attns, graphs = {}, {}
    for count in counts:
        tiling = replace(default_tiling(m.dqk, m.dtype, tokens), num_splits=count)
        attn = attns[count] = PagedAttention(1, tokens, pages, m.num_heads, m.dqk, page, m.dtype, device, m.alpha,
                                             m.max_seq_len, tiling=tiling)

        def step(attn=attn, count=count) -> None:
            for cache in caches:
                out = attn.run(q, k, v, cache, table, offsets, history, appended, torch.empty_like(q), reduce=False)
                gated_split_norm(u, out.partials.view(count, tokens, -1), w, b, m.layer_norm_eps, out=gated,
                                 active_splits=out.active)

        step()
        if attn.active_splits is not None and int(attn.active_splits) != count:
            raise ValueError(f"{count} splits asked for, {int(attn.active_splits)} launched")
        graphs[count] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[count]):
            step()
    times = {count: [] for count in counts}
    for block in range(blocks):
        for count in counts[block % len(counts):] + counts[:block % len(counts)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graphs[count].replay()
            start.record()
            for _ in range(replays):
                graphs[count].replay()
            end.record()
            end.synchronize()
            times[count].append(start.elapsed_time(end) * 1e3 / replays / m.num_layers)
    return {count: statistics.median(t) for count, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=parse_lengths, default=(16384, 2048))
    parser.add_argument("--variant", type=Variant.parse, action="append", required=True)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--requests", type=int, default=20, help="GPU hits per engine per block")
    parser.add_argument("--profiled", type=int, default=10, help="profiled GPU hits per engine per length")
    parser.add_argument("--phases", action="store_true", help="time each engine's host phases after the walls")
    parser.add_argument("--phase-blocks", type=int, default=4, help="alternated blocks of --requests for --phases")
    parser.add_argument("--ladders", type=lambda t: [int(s) for s in t.split(",") if s.strip()], default=[],
                        help="token ladder steps whose engines' warm-up to time afterwards, e.g. 1,4,4")
    parser.add_argument("--sweep-splits", type=lambda t: [int(s) for s in t.split(",") if s.strip()], default=[],
                        help="split counts (>= 2) to time the attention and its gate alone at, after the GPU hits")
    parser.add_argument("--sweep-lens", type=parse_lengths, default=(16384, 8192, 4096, 2048))
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
        timers = {name: PhaseTimer() for name in names} if args.phases else {}
        for name, timer in timers.items():   # attached before any wall is timed: every wall pays the same wrappers
            timer.attach(engines[name])
        for index, seq_len in enumerate(settings.seq_lens):
            workloads = loaded_workloads(engines, settings, index, seq_len)
            walls = alternated_walls(engines, workloads, args.blocks, args.requests)
            rows = {name: {"wall_ms_median": statistics.median(walls[name]),
                           "wall_ms_p10": statistics.quantiles(walls[name], n=10)[0],
                           "wall_ms_p90": statistics.quantiles(walls[name], n=10)[-1],
                           **kernel_us(engines[name], workloads[name], args.profiled, layers),
                           "splits": active_splits(engines[name])} for name in names}
            out["lengths"][seq_len] = rows
            print(f"### GPU hit at {seq_len} (BS=1, {settings.append_len} + {settings.num_candidates}), {args.blocks} "
                  f"alternated blocks x {args.requests}\n| variant | wall ms median (p10 / p90) | attention us/layer | "
                  f"LayerNorm + gate us/layer | kernels us | span us | splits |\n|---|---|---|---|---|---|---|")
            for name, r in rows.items():
                print(f"| {name} | {r['wall_ms_median']:.3f} ({r['wall_ms_p10']:.3f} / {r['wall_ms_p90']:.3f}) | "
                      f"{r['attention_us_per_layer']:.1f} | {r['norm_us_per_layer']:.1f} | {r['kernels_us']:.1f} | "
                      f"{r['span_us_median']:.1f} | {r['splits']} |", flush=True)
            if args.phases:
                phase_table(engines, timers, workloads, args, rows)
            write(args.out, out)
            reference = reference_scores(weights64, workloads[names[0]])
            first = gpu_hit(engines[names[0]], workloads[names[0]])[1]
            out["lengths"][seq_len]["reference_max_abs"] = max(float(r.abs().max()) for r in reference)
            print(f"scores at {seq_len} (max |d| / max |float64 s|, float64 max |s| "
                  f"{out['lengths'][seq_len]['reference_max_abs']:.1f}): vs {names[0]} / vs float64 / top-10")
            for name in names:
                scores = gpu_hit(engines[name], workloads[name])[1]
                rows[name].update(relative_diff_vs_first=agreement(scores, first, reference),
                                  relative_diff_vs_float64=agreement(scores, reference, reference),
                                  top10_overlap_vs_float64=top10_overlap(scores, reference))
                print(f"  {name}: {rows[name]['relative_diff_vs_first']:.1e} / "
                      f"{rows[name]['relative_diff_vs_float64']:.1e} / {rows[name]['top10_overlap_vs_float64']}/10",
                      flush=True)
            for name, engine in engines.items():
                workloads[name].drop(engine)
    write(args.out, out)
    if args.sweep_splits:
        print(f"### attention + gate alone, us per layer, by split count\n| history | "
              + " | ".join(f"{c} splits" for c in args.sweep_splits) + " |\n|---|"
              + "---|" * len(args.sweep_splits), flush=True)
    for seq_len in args.sweep_splits and args.sweep_lens:
        sweep = split_sweep(settings, seq_len, args.sweep_splits, args.blocks, 20, device)
        out.setdefault("split_sweep_us_per_layer", {})[seq_len] = sweep
        print(f"| {seq_len} | " + " | ".join(f"{us:.1f}" for us in sweep.values()) + " |", flush=True)
        write(args.out, out)
    for steps in args.ladders:
        cost = ladder_warmup(weights, config, device, steps)
        out.setdefault("ladders", []).append(cost)
        print("# ladder " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in cost.items()), flush=True)
        write(args.out, out)


# The phase rows --phases prints (every row goes to the JSON).
PRINTED_PHASES = ("prepare", "prepare.pack", "prepare.other", "launch.fill", "launch.forward", "launch.offload",
                  "collect.fetch", "collect.commit", "outside", "wall")


def phase_table(engines: dict[str, Engine], timers: dict[str, PhaseTimer], workloads: dict[str, Workload],
                args: argparse.Namespace, rows: dict[str, dict]) -> None:
    """Time the engines' phases (`timers`, attached to them) in alternated blocks, print the medians and add them to
    each variant's row."""
    phases = alternated_phases(engines, timers, workloads, args.phase_blocks, args.requests)
    print("| host ms (phases on) | " + " | ".join(PRINTED_PHASES) + " |\n|---|" + "---|" * len(PRINTED_PHASES))
    for name, medians in phases.items():
        rows[name]["phases_ms_median"] = medians
        print(f"| {name} | " + " | ".join(f"{medians[p]:.3f}" for p in PRINTED_PHASES) + " |", flush=True)


def write(path: str | None, out: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
