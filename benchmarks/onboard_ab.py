"""The onboarding's issue and the fetch's wait A/B'd in one process on CPU-hit + layerwise and GPU-hit requests, in
alternated blocks (sessions 14 and 15, issues 18 and 20).

A variant is `NAME=WAIT[:ISSUE]`. WAIT: `word`, the engine's wait for each batch's done word (runtime/done_word.py),
or `sync`, torch's Stream.synchronize as main waited (patched onto each bucket's done word here, the graphs
unchanged). ISSUE, how the onboarding is issued by the engine's copy engine (a copy-thread engine over a CUDA one, as
the tier builds its own): `lead` (the default: on the caller's thread, a lead of layers before the launch and the rest
after it, runtime/tiers.LEAD_BYTES), `all` (on the caller's thread, every layer before the launch), `thread` (handed
to the copy thread, as main did whatever the batch) or a lead in MiB. One engine per KV dtype serves every variant.
Per history length, blocks of CPU-hit + layerwise requests, then GPU hits,
run each variant in turn, the order rotating from block to block, so drift of the machine spreads over all variants
alike. The lower bound is the inference benchmark's (stats.lower_bound) from the same run: the transfer probes of
every variant's requests, the GPU hit of the first variant and its per-layer compute. Every result is compared with
the GPU hit's scores (0: bitwise). With `--profile` both scenarios' host phases (bench.phases) are kept per variant.

    python3 benchmarks/onboard_ab.py --seq-lens 16K,2K --variant thread=word:thread --variant all=word:all \
        --variant lead=word:lead --profile
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's layerflow, not an installed one

from layerflow.bench.environment import results_header  # noqa: E402
from layerflow.bench.measure import device_tools, phase_timer, transfer_config, workload_of  # noqa: E402
from layerflow.bench.recording import BenchCopyEngine  # noqa: E402
from layerflow.bench.scenarios import Context, CpuHitLayerwise, GpuHit, Measured, Scenario  # noqa: E402
from layerflow.bench.settings import GPU_DEFAULTS, Settings, parse_lengths  # noqa: E402
from layerflow.bench.stats import Summary, lower_bound  # noqa: E402
from layerflow.bench.workload import as_scores  # noqa: E402
from layerflow.model import HSTUWeights  # noqa: E402
from layerflow.runtime.buffers import Bucket  # noqa: E402
from layerflow.runtime.engine import Engine  # noqa: E402
from layerflow.runtime.tiers import LEAD_BYTES  # noqa: E402
from layerflow.transfer.copy_engine import CopyEngine  # noqa: E402
from layerflow.transfer.issue_thread import IssueThreadCopyEngine  # noqa: E402

# The phase rows `--profile` prints (bench.phases names).
PROFILE_ROWS = ("prepare", "prepare.onboard", "launch.fill", "launch.offload", "collect.fetch", "collect.commit",
                "collect.other")


WAITS = ("word", "sync")


@dataclass(frozen=True)
class Variant:
    wait: str
    thread: bool             # every onboarding handed to the copy thread
    lead_bytes: int | None   # None: every layer before the launch


def parse_variant(text: str) -> tuple[str, Variant]:
    """'NAME=WAIT[:ISSUE]' -> (NAME, Variant)."""
    name, _, spec = text.partition("=")
    wait, _, issue = spec.partition(":")
    issue = issue or "lead"
    named = {"lead": (False, LEAD_BYTES), "all": (False, None), "thread": (True, None)}
    thread, lead = named.get(issue, (False, -1))
    if issue not in named:
        try:
            lead = int(float(issue) * 2**20)
        except ValueError:
            pass
    if not name or wait not in WAITS or (lead is not None and lead <= 0):
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=WAIT[:ISSUE], wait in {WAITS}, issue "
                                         f"'lead', 'all', 'thread' or a lead in MiB")
    return name, Variant(wait, thread, lead)


def apply(ctx: Context, variant: Variant) -> None:
    """Every bucket's fetch waits by the variant's wait from the next request on (the CPU path has no wait: nothing
    changes); the copy engine issues as the variant says (`thread`: the tier's inline hint forced off)."""
    wait, tier, threaded = variant.wait, ctx.engine.kv.below, ctx.copy.inner
    if hasattr(threaded.inner, "lead_bytes"):
        threaded.inner.lead_bytes = variant.lead_bytes
    if variant.thread:
        tier.issue_inline = lambda allowed: setattr(threaded, "inline", False)
    else:
        tier.__dict__.pop("issue_inline", None)
    for buffers in ctx.engine._buffers.values():
        if buffers._done is None:
            continue
        if wait == "sync":
            buffers._done.wait = buffers.stream.synchronize
        else:
            buffers._done.__dict__.pop("wait", None)


class GpuHitsOnly(GpuHit):
    """GPU hits timed back to back, without the per-layer compute probes (the bound takes those once)."""

    def finish(self, ctx: Context, probes, iterations: int) -> None:
        Scenario.finish(self, ctx, probes, iterations)


def _pooled(runs: list[Measured]) -> list[float]:
    return [w for m in runs for w in m.wall.samples]


def _phases(runs: list[Measured]) -> dict[str, float]:
    """Median host ms per phase row over every request of `runs`."""
    return {phase: Summary.of([x for m in runs for x in m.phases[phase].samples]).median for phase in runs[0].phases}


def measure_length(ctx: Context, chosen: dict[str, Variant], blocks: int) -> dict:
    """Every variant's layerwise and GPU-hit requests at one length, alternated in `blocks` blocks; the bound."""
    variants = list(chosen)
    layerwise: dict[str, list[Measured]] = {n: [] for n in variants}
    hits: dict[str, list[Measured]] = {n: [] for n in variants}
    for block in range(blocks):
        for name in variants[block % len(variants):] + variants[:block % len(variants)]:
            apply(ctx, chosen[name])
            layerwise[name].append(CpuHitLayerwise().measure(ctx))
            hits[name].append(GpuHitsOnly().measure(ctx))
    apply(ctx, chosen[variants[0]])
    compute = GpuHit().measure(replace(ctx, timed_iters=3)).probes.layer_compute
    transfers = [t for runs in layerwise.values() for m in runs for t in m.probes.transfers]
    t_transfer = Summary.of([t.total_ms for t in transfers]).median
    t_first = Summary.of([t.layer_ms[0] for t in transfers]).median
    t_last = Summary.of([layers[-1] for layers in compute]).median
    t_compute = Summary.of(_pooled(hits[variants[0]])).median
    bound = lower_bound(t_transfer, t_compute, t_first, t_last)
    rows = {}
    for name in variants:
        wall, hit = Summary.of(_pooled(layerwise[name])), Summary.of(_pooled(hits[name]))
        rows[name] = {"layerwise_ms": wall.to_dict(), "gpu_hit_ms": hit.to_dict(),
                      "pipeline_efficiency": bound / wall.median,
                      "max_abs_diff_vs_gpu_hit": max(m.max_abs_diff for m in layerwise[name] + hits[name])}
        if ctx.phases is not None:
            rows[name]["layerwise_phases_ms"] = _phases(layerwise[name])
            rows[name]["gpu_hit_phases_ms"] = _phases(hits[name])
    return {"seq_len": ctx.workload.seq_len, "lower_bound_ms": bound, "t_transfer_ms": t_transfer,
            "t_compute_ms": t_compute, "t_first_layer_transfer_ms": t_first, "t_last_layer_compute_ms": t_last,
            "variants": rows}


def _copy_engine(device: torch.device) -> CopyEngine:
    """A copy-thread engine over the device's engine, as the tier builds its own (`apply` sets how it issues)."""
    if device.type != "cuda":
        from layerflow.transfer.thread_copy import ThreadCopyEngine
        return IssueThreadCopyEngine(ThreadCopyEngine(), device)
    from layerflow.transfer.cuda_copy import CudaCopyEngine
    return IssueThreadCopyEngine(CudaCopyEngine(device=device.index or 0), device)


def run_dtype(settings: Settings, variants: dict[str, Variant], blocks: int,
              device: torch.device) -> list[dict]:
    """One engine with `settings.kv_cache_dtype`, every length of `settings` (host phases with `settings.profile`)."""
    weights = HSTUWeights.init(settings.model, seed=settings.seed)
    config = replace(transfer_config(settings, None), enable_layerwise=True)
    clock, timer = device_tools(device)
    copy = BenchCopyEngine(_copy_engine(device))
    bucket = Bucket(settings.batch_size, settings.query_tokens)
    out = []
    per_length = (blocks * len(variants) * 2 * (settings.warmup_iters + settings.timed_iters)
                  + settings.warmup_iters + 3)
    try:
        with Engine(weights, config, device=device, batch_buckets=(bucket.max_batch,),
                    token_buckets=(bucket.max_tokens,), copy_engine=copy) as engine, \
                tqdm(total=len(settings.seq_lens) * per_length, desc=f"onboard_ab {config.kv_cache_dtype}",
                     file=sys.stderr, mininterval=2.0) as bar:
            engine.warmup()
            phases = phase_timer(engine, settings)
            for index, seq_len in enumerate(settings.seq_lens):
                workload = workload_of(settings, index, seq_len)
                workload.load(engine)
                reference = as_scores(engine.score(workload.requests))
                ctx = Context(engine, copy, clock, timer, workload, bucket, settings.warmup_iters,
                              settings.timed_iters, False, bar, reference, phases)
                out.append({"kv_cache_dtype": config.kv_cache_dtype, **measure_length(ctx, variants, blocks)})
                workload.drop(engine)
    finally:
        timer.close()
    return out


def table(rows: list[dict]) -> str:
    """One line per dtype, length and variant: layerwise median (p90), LB, efficiency, GPU hit, score difference;
    with the phases, one line per dtype, length, variant and scenario."""
    lines = ["| dtype | history | variant | layerwise ms | LB ms | eff | GPU hit ms | max diff |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, v in row["variants"].items():
            lw, hit = v["layerwise_ms"], v["gpu_hit_ms"]
            lines.append(f"| {row['kv_cache_dtype']} | {row['seq_len']} | {name} | {lw['median']:.3f} "
                         f"({lw['p90']:.3f}) | {row['lower_bound_ms']:.3f} | {v['pipeline_efficiency']:.3f} | "
                         f"{hit['median']:.3f} ({hit['p90']:.3f}) | {v['max_abs_diff_vs_gpu_hit']:.1e} |")
    if all("gpu_hit_phases_ms" in v for row in rows for v in row["variants"].values()):
        lines += ["", "host phases, ms median (lw: CPU hit + layerwise, hit: GPU hit):",
                  "| dtype | hist | variant | sc | " + " | ".join(PROFILE_ROWS) + " |"]
        lines += [f"| {row['kv_cache_dtype'][:4]} | {row['seq_len']} | {name} | {scenario} | "
                  + " | ".join(f"{v[key].get(p, float('nan')):.3f}" for p in PROFILE_ROWS) + " |"
                  for row in rows for name, v in row["variants"].items()
                  for scenario, key in (("hit", "gpu_hit_phases_ms"), ("lw", "layerwise_phases_ms"))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=GPU_DEFAULTS["preset"])
    parser.add_argument("--seq-lens", type=parse_lengths, default=(16384, 2048))
    parser.add_argument("--append-len", type=int, default=GPU_DEFAULTS["append_len"])
    parser.add_argument("--num-candidates", type=int, default=GPU_DEFAULTS["num_candidates"])
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3", help="comma-separated, one engine each")
    parser.add_argument("--variant", type=parse_variant, action="append",
                        help="NAME=WAIT[:ISSUE], repeatable (default: thread=word:thread, all=word:all, "
                             "lead=word:lead)")
    parser.add_argument("--blocks", type=int, default=6, help="alternation blocks per length")
    parser.add_argument("--iters", type=int, default=5, help="timed requests per variant, scenario and block")
    parser.add_argument("--profile", action="store_true", help="keep the requests' host phases too")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    variants = dict(args.variant or [parse_variant(v) for v in ("thread=word:thread", "all=word:all", "lead=word:lead")])
    if args.blocks <= 0:
        raise SystemExit(f"--blocks {args.blocks}: expected blocks > 0")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for dtype in args.kv_cache_dtypes.split(","):   # each dtype's table as soon as it is measured
        settings = Settings(preset=args.preset, seq_lens=args.seq_lens, append_len=args.append_len,
                            num_candidates=args.num_candidates, batch_size=1, timed_iters=args.iters,
                            warmup_iters=1, scenarios=("gpu_hit", "cpu_hit_layerwise"), kv_cache_dtype=dtype,
                            profile=args.profile)
        measured = run_dtype(settings, variants, args.blocks, device)
        print(table(measured), flush=True)
        rows += measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results_header(device) | {"blocks": args.blocks, "iters": args.iters,
                                                    "variants": {n: vars(v) for n, v in variants.items()},
                                                    "rows": rows, "table": table(rows)}, f, indent=1)


if __name__ == "__main__":
    main()
