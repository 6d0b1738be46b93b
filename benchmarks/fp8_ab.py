"""A/B of the fp8 Gluon attention kernel's paths in one process, variants alternated in blocks.

`attention`: attention alone (benchmarks/kernels.py's Case: BS=1, D=256, 64 appended, L2 rotated, the split sum
included, each variant's CUDA graph timed in turn) for bf16 Gluon's default, the fp8 kernel's defaults, its other
paths and ablations of the defaults (benchmarks/fp8_ablation.py: timing only, wrong numbers). `engine`: GPU hits
(benchmarks/gpu_hit_ab.py's request: hstu-bench, 64 appended + 256 candidates, one exact token bucket) of a bf16
engine beside an fp8 engine on the defaults (`--variants` names others), with their scores against the bf16
engine's; with `--layerwise` also CPU hits + layerwise (the user's pages evicted to the host before each request,
onboarded layer by layer), alternated the same way. A variant's fp8 paths are LAYERFLOW_FP8_* settings in force
while its attention or engine is built (that is when gluon_fp8_tiling.default_fp8_tiling reads them). `--warm NAME`
builds one variant (compiling its kernels) and times nothing.

    python3 benchmarks/fp8_ab.py attention --shapes 16K/256,2K/256 --out attention.json
    python3 benchmarks/fp8_ab.py engine --seq-lens 16K,2K --layerwise --out engine.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fp8_ablation import ABLATIONS, AblatedFp8Attention  # noqa: E402
from benchmarks.gpu_hit_ab import (agreement, alternated_walls, gpu_hit, kernel_us, launches,  # noqa: E402
                                  loaded_workloads, top10_overlap)
from benchmarks.kernels import Case, graph_of, median_ms  # noqa: E402
from layerflow.bench.workload import Workload  # noqa: E402
from layerflow.bench.environment import environment  # noqa: E402
from layerflow.bench.measure import transfer_config  # noqa: E402
from layerflow.bench.settings import GPU_DEFAULTS, Settings, parse_lengths  # noqa: E402
from layerflow.kernels.gluon_fp8_tiling import DECODE_ENV, QK_ENV, SILU_ENV  # noqa: E402
from layerflow.model import HSTUWeights  # noqa: E402
from layerflow.runtime.engine import Engine  # noqa: E402
from layerflow.runtime.kv_manager import Tier  # noqa: E402

E4M3 = torch.float8_e4m3fn
SETTINGS = (DECODE_ENV, SILU_ENV, QK_ENV)


@dataclass(frozen=True)
class Variant:
    """fp8 pages or the model's dtype; the LAYERFLOW_FP8_* settings it is built under; an ablation of the kernel."""

    fp8: bool
    env: tuple[tuple[str, str], ...] = ()
    ablation: str | None = None


VARIANTS = {
    "bf16": Variant(False),
    "fp8 main": Variant(True),
    "fp8 cvt": Variant(True, ((DECODE_ENV, "cvt"),)),
    "fp8 decode": Variant(True, ((QK_ENV, "bf16"),)),
    "fp8 tanh": Variant(True, ((SILU_ENV, "tanh"),)),
    "fp8 exact": Variant(True, ((SILU_ENV, "exact"),)),
    **{f"fp8 {name}": Variant(True, ablation=name) for name in ABLATIONS},
}
ATTENTION_VARIANTS = ("bf16", "fp8 main", "fp8 exact", "fp8 decode", *(f"fp8 {name}" for name in ABLATIONS))
ENGINE_VARIANTS = ("bf16", "fp8 main", "fp8 exact")
BASES = ("fp8 main", "bf16")      # what every fp8 row's output is compared with


@contextlib.contextmanager
def built_under(variant: Variant):
    """The variant's LAYERFLOW_FP8_* settings (the others unset) while the body runs; the caller's after."""
    saved = {name: os.environ.pop(name, None) for name in SETTINGS}
    os.environ.update(dict(variant.env))
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def attention_case(name: str, history: int, candidates: int) -> Case:
    """Case of `name` at one shape; every variant's inputs and pages from one seed."""
    variant = VARIANTS[name]
    torch.manual_seed(0)
    with built_under(variant):
        case = Case(1, history, candidates, 256, 32, None, E4M3 if variant.fp8 else None)
    if variant.ablation is not None:
        case.attn.gluon = AblatedFp8Attention(case.attn.gluon.tiling, variant.ablation)
    return case


def difference(out: torch.Tensor, base: torch.Tensor | None, same_pages: bool = True) -> str:
    """Bitwise, or the relative norm of out - base; "other pages" where the two cases' pools hold different values
    (Case sizes its L2 rotation by bytes, so an fp8 case at 16K rotates over more page sets than a bf16 one and its
    last rotation reads other random pages: such outputs are unrelated, ~1.4 apart)."""
    if base is None:
        return "-"
    if not same_pages:
        return "other pages"
    if torch.equal(out, base):
        return "bitwise"
    return f"{float((out - base).norm() / base.norm()):.1e}"


def rotated(names: list[str], block: int) -> list[str]:
    return names[block % len(names):] + names[:block % len(names)]


def time_attention(names: list[str], shapes: list[tuple[int, int]], blocks: int, iters: int,
                   deadline: float) -> list[dict]:
    """Per shape, each variant's graph timed in `blocks` alternated blocks of `iters` replays (us per call: the
    median block); fp8 outputs compared with BASES' (not the ablations')."""
    rows = []
    for history, candidates in shapes:
        if time.time() > deadline:
            print(f"# deadline: {history}/{candidates} skipped", flush=True)
            continue
        cases, graphs, outs = {}, {}, {}
        for name in names:
            try:
                case = attention_case(name, history, candidates)
                graph = graph_of(lambda case=case: [case.run(r) for r in range(case.rotations)])
                graph.replay()
                torch.cuda.synchronize()
            except Exception as error:      # a variant that does not build is a result; the others still run
                print(f"| {name} | {history}/{candidates} | ERROR {type(error).__name__}: {str(error)[:300]} |",
                      flush=True)
                continue
            cases[name], graphs[name] = case, graph
            outs[name] = case.out[:case.q.shape[0]].float().clone()
        times = {name: [] for name in graphs}
        for block in range(blocks):
            for name in rotated(list(graphs), block):
                times[name].append(median_ms(graphs[name].replay, iters) / cases[name].rotations * 1e3)
        for name, case in cases.items():
            checked = VARIANTS[name].fp8 and VARIANTS[name].ablation is None
            rows.append(dict(variant=name, history=history, candidates=candidates, us=statistics.median(times[name]),
                             blocks=times[name], splits=case.attn.num_splits, split_rule=case.attn.split_rule,
                             tiling=str(case.attn.gluon.tiling) if case.attn.gluon else "tl",
                             **{f"vs {base}": difference(outs[name], outs.get(base),
                                                         base not in cases or cases[base].rotations == case.rotations)
                                if checked else "-" for base in BASES}))
        del cases, graphs, outs
        torch.cuda.empty_cache()
    return rows


def attention_table(rows: list[dict], names: list[str], shapes: list[tuple[int, int]]) -> str:
    head = " | ".join(f"{h // 1024}K/{c}" for h, c in shapes)
    lines = [f"| variant | {head} | " + " | ".join(f"vs {b} ({head})" for b in BASES) + " |",
             "|---|" + "---|" * (len(shapes) * (1 + len(BASES)))]
    for name in names:
        found = {(r["history"], r["candidates"]): r for r in rows if r["variant"] == name}
        cells = [f"{found[s]['us']:.1f}" if s in found else "-" for s in shapes]
        for base in BASES:
            cells.append(" / ".join(found[s][f"vs {base}"] if s in found else "-" for s in shapes))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def engine_settings(seq_lens: tuple[int, ...]) -> tuple[Settings, HSTUWeights]:
    settings = Settings(**{**GPU_DEFAULTS, "seq_lens": seq_lens, "batch_size": 1, "scenarios": ("gpu_hit",)})
    return settings, HSTUWeights.init(settings.model, seed=0)


def build_engine(name: str, settings: Settings, weights: HSTUWeights, stack: contextlib.ExitStack) -> Engine:
    """A warmed-up BS=1 engine of variant `name` over the request's exact token bucket."""
    variant = VARIANTS[name]
    config = replace(transfer_config(settings, None), cpu_cache_gb=1.0, gpu_cache_gb=1.5)
    if variant.fp8:
        config = replace(config, kv_cache_dtype="fp8_e4m3")
    tokens = settings.append_len + settings.num_candidates
    with built_under(variant):
        engine = stack.enter_context(Engine(weights, config, device=torch.device("cuda"), batch_buckets=(1,),
                                            token_buckets=(tokens,)))
        engine.warmup()
    return engine


def host_hit(engine: Engine, workload: Workload) -> float:
    """One CPU hit + layerwise: the history truncated back and evicted to the host (untimed), then the host-clock ms
    of `score` (RuntimeError if a request would not hit the host)."""
    engine.kv.wait_offloads()
    for r in workload.requests:
        engine.kv.truncate(r.user_id, workload.seq_len)
        engine.kv.evict_from_gpu(r.user_id)
        if engine.kv.tier(r.user_id) is not Tier.HOST:
            raise RuntimeError(f"user {r.user_id}: expected a host hit, got {engine.kv.tier(r.user_id).value}")
    start = time.perf_counter()
    engine.score(workload.requests)
    return (time.perf_counter() - start) * 1e3


def alternated_host_hits(engines: dict[str, Engine], workloads: dict[str, Workload], blocks: int,
                         requests: int) -> dict[str, list[float]]:
    """CPU-hit + layerwise ms per engine: two warm hits each, then `blocks` blocks of `requests` on every engine in
    turn, the order rotating."""
    for name, engine in engines.items():
        host_hit(engine, workloads[name])
        host_hit(engine, workloads[name])
    walls = {name: [] for name in engines}
    for block in range(blocks):
        for name in rotated(list(engines), block):
            walls[name] += [host_hit(engines[name], workloads[name]) for _ in range(requests)]
    return walls


def time_engines(names: list[str], settings: Settings, weights: HSTUWeights, blocks: int, requests: int,
                 profiled: int, deadline: float, layerwise: bool = False) -> dict:
    """Per length, every engine's GPU hits (with `layerwise` then its CPU hits + layerwise) in alternated blocks;
    scores against the bf16 engine's and the first fp8 engine's; attention device us per layer from `profiled`
    profiled requests."""
    out = {"launches": {}}
    with contextlib.ExitStack() as stack:
        engines = {}
        for name in names:
            start = time.perf_counter()
            engines[name] = build_engine(name, settings, weights, stack)
            out["launches"][name] = launches(engines[name])
            print(f"# {name} built in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        for index, seq_len in enumerate(settings.seq_lens):
            if time.time() > deadline:
                print(f"# deadline: {seq_len} skipped", flush=True)
                continue
            workloads = loaded_workloads(engines, settings, index, seq_len)
            walls = alternated_walls(engines, workloads, blocks, requests)
            host_walls = alternated_host_hits(engines, workloads, blocks, requests) if layerwise else {}
            scores = {name: gpu_hit(engine, workloads[name])[1] for name, engine in engines.items()}
            first_fp8 = next((n for n in engines if VARIANTS[n].fp8), None)
            rows = {}
            for name, engine in engines.items():
                rows[name] = {"wall_ms_median": statistics.median(walls[name]),
                              "wall_ms_p90": statistics.quantiles(walls[name], n=10)[-1]}
                if layerwise:
                    rows[name].update(layerwise_ms_median=statistics.median(host_walls[name]),
                                      layerwise_ms_p90=statistics.quantiles(host_walls[name], n=10)[-1])
                for base in ("bf16", first_fp8):
                    if base in scores and base != name:
                        rows[name][f"diff_vs {base}"] = agreement(scores[name], scores[base], scores[base])
                        rows[name][f"top10_vs {base}"] = top10_overlap(scores[name], scores[base])
                rows[name].update(kernel_us(engine, workloads[name], profiled, settings.model.num_layers))
            out[seq_len] = rows
            print(f"### GPU hit at {seq_len} (BS=1, {settings.append_len} + {settings.num_candidates}), {blocks} "
                  f"alternated blocks x {requests}; diffs: max |d| / max |base s|, top-10 overlap with the base\n"
                  f"| engine | wall ms median (p90) | layerwise ms median (p90) | attention us/layer | kernels us | "
                  f"vs bf16 | vs {first_fp8} |\n|---|---|---|---|---|---|---|", flush=True)
            for name, r in rows.items():
                against = [f"{r[f'diff_vs {b}']:.1e}, {r[f'top10_vs {b}']}/10" if f"diff_vs {b}" in r else "-"
                           for b in ("bf16", first_fp8)]
                host = f"{r['layerwise_ms_median']:.3f} ({r['layerwise_ms_p90']:.3f})" if layerwise else "-"
                print(f"| {name} | {r['wall_ms_median']:.3f} ({r['wall_ms_p90']:.3f}) | {host} | "
                      f"{r['attention_us_per_layer']:.1f} | {r['kernels_us']:.1f} | {against[0]} | {against[1]} |",
                      flush=True)
            for name, engine in engines.items():
                workloads[name].drop(engine)
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'16K/256,2K/256' -> [(16384, 256), (2048, 256)]."""
    shapes = []
    for part in text.split(","):
        history, _, candidates = part.partition("/")
        shapes.append((parse_lengths(history)[0], int(candidates or 0)))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("attention", "engine"))
    parser.add_argument("--variants", help="comma-separated names (default: the part's list)")
    parser.add_argument("--warm", metavar="NAME", help="build this variant at every shape/length and exit")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("16K/256,2K/256"))
    parser.add_argument("--seq-lens", type=parse_lengths, default=(16384, 2048))
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10, help="graph replays per attention block")
    parser.add_argument("--requests", type=int, default=20, help="GPU hits per engine per block")
    parser.add_argument("--profiled", type=int, default=3, help="profiled GPU hits per engine per length")
    parser.add_argument("--seconds", type=float, default=1e9, help="start no new shape or length after this")
    parser.add_argument("--layerwise", action="store_true", help="engine: CPU hits + layerwise too")
    parser.add_argument("--out")
    args = parser.parse_args()
    deadline = time.time() + args.seconds
    default = ATTENTION_VARIANTS if args.part == "attention" else ENGINE_VARIANTS
    names = [n.strip() for n in args.variants.split(",")] if args.variants else list(default)
    unknown = [n for n in names + ([args.warm] if args.warm else []) if n not in VARIANTS]
    if unknown:
        parser.error(f"variants {unknown}: expected names from {list(VARIANTS)}")
    if args.warm and args.part == "attention":
        for history, candidates in args.shapes:
            attention_case(args.warm, history, candidates).run(0)
        torch.cuda.synchronize()
        return
    if args.warm:
        settings, weights = engine_settings(args.seq_lens)
        with contextlib.ExitStack() as stack:
            build_engine(args.warm, settings, weights, stack)
        return
    out = {"command": " ".join(["python3"] + sys.argv), "environment": environment(torch.device("cuda"))}
    if args.part == "attention":
        out["rows"] = []
        for shape in args.shapes:       # a table per shape, so a run cut short still shows the shapes done
            out["rows"] += time_attention(names, [shape], args.blocks, args.iters, deadline)
            print(f"### attention alone, BS=1, D=256, H=4, 64 appended, us (median of {args.blocks} alternated "
                  "blocks); outputs against the fp8 bases (bitwise, or relative norm of the difference)\n"
                  + attention_table(out["rows"], names, [shape]), flush=True)
    else:
        settings, weights = engine_settings(args.seq_lens)
        out["lengths"] = time_engines(names, settings, weights, args.blocks, args.requests, args.profiled, deadline,
                                      args.layerwise)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
