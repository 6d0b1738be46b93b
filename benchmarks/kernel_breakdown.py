"""Per-kernel breakdown of one GPU-hit request, beside its floor (issue 18's table).

The engine is built and staged as `layerflow bench` stages a GPU hit (hstu-bench, BS=1, 64 appended + 256 candidates,
the batch's token bucket, CUDA graphs on); torch.profiler records `--requests` requests per history length and each
kernel's count and device time are divided by that number. The floor is counted from the model's shape against two
ceilings measured in the same run: a large bf16 GEMM (FLOP/s) and a device-to-device copy (bytes/s); a group's floor
is the larger of its FLOPs and its bytes at those rates.

    python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K --out benchmarks/results/kernel-breakdown-h200.json

With `--kv-cache-dtype fp8_e4m3` the pages hold fp8 codes and scale rows (docs/fp8.md) and the KV bytes of the
attention's floor are those pages' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerflow.bench.clocks import event_times_ms  # noqa: E402
from layerflow.bench.environment import environment  # noqa: E402
from layerflow.bench.settings import GPU_DEFAULTS, Settings, parse_lengths  # noqa: E402
from layerflow.bench.measure import transfer_config  # noqa: E402
from layerflow.bench.workload import Workload  # noqa: E402
from layerflow.model import HSTUWeights  # noqa: E402
from layerflow.runtime.engine import Engine  # noqa: E402
from layerflow.tier.layout import KV_CACHE_DTYPES, KVLayout  # noqa: E402

GROUPS = (("attention", ("attention", "_gluon_fp8_kernel")), ("split sum", ("sum_splits",)),
          ("GEMM", ("nvjet", "gemm", "cutlass", "sm90")),
          ("LayerNorm", ("norm",)), ("KV append", ("kv_append",)), ("copy D2H", ("DtoH",)), ("copy H2D", ("HtoD",)),
          ("direct_copy", ("direct_copy",)))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k.lower() in name.lower() for k in keys):
            return group
    return "other pointwise"


def ceilings(device: torch.device) -> dict[str, float]:
    """Dense bf16 GEMM TFLOP/s (8192^3) and D2D copy TB/s (1 GiB), best of 10 each."""
    def best_ms(fn) -> float:
        fn()
        return min(event_times_ms(fn, 10))

    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm_ms = best_ms(lambda: a @ b)
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = best_ms(lambda: dst.copy_(src))
    return {"gemm_tflops": 2 * n**3 / gemm_ms / 1e9, "d2d_tb_s": 2 * src.numel() / copy_ms / 1e9}


def floors_us(settings: Settings, seq_len: int, ceiling: dict[str, float], page_size: int) -> dict[str, float]:
    """Counted work of one request: attention FLOPs and KV bytes (the pages of the cache's dtype), GEMM FLOPs and
    weight bytes, at the ceilings."""
    m = settings.model
    queries = settings.append_len + settings.num_candidates
    keys = seq_len + settings.append_len
    attn_flops = m.num_layers * m.num_heads * queries * keys * 2 * (m.dqk + m.dv)
    layout = KVLayout.for_hstu(m, page_size, settings.kv_cache_dtype)
    kv_bytes = layout.pages_for_tokens(keys) * layout.page_bytes
    proj = m.embedding_dim * m.num_heads * (2 * m.dqk + 2 * m.dv) + m.num_heads * m.dv * m.embedding_dim
    gemm_flops = m.num_layers * 2 * queries * proj
    weight_bytes = m.num_layers * proj * m.dtype.itemsize
    flop_rate, byte_rate = ceiling["gemm_tflops"] * 1e12, ceiling["d2d_tb_s"] * 1e12

    def us(flops: float, nbytes: float) -> float:
        return max(flops / flop_rate, nbytes / byte_rate) * 1e6

    return {"attention": us(attn_flops, kv_bytes), "GEMM": us(gemm_flops, weight_bytes),
            "attention_gflop": attn_flops / 1e9, "kv_mib": kv_bytes / 2**20, "gemm_gflop": gemm_flops / 1e9}


def breakdown(engine: Engine, workload: Workload, requests: int,
              trace: str | None = None) -> tuple[list[dict], list[float]]:
    def hit():
        engine.kv.wait_offloads()
        for r in workload.requests:
            engine.kv.truncate(r.user_id, workload.seq_len)
        return engine.score(workload.requests)

    for _ in range(5):
        hit()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(requests):
            hit()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    count, total = defaultdict(int), defaultdict(float)
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count[event.name] += 1
            total[event.name] += event.device_time_total
            intervals.append((event.time_range.start, event.time_range.end))
    rows = [{"kernel": name, "group": group_of(name), "count": count[name] / requests, "us": total[name] / requests}
            for name in sorted(total, key=total.get, reverse=True)]
    return rows, spans_us(intervals)


def spans_us(intervals: list[tuple[float, float]], gap_us: float = 100.0) -> list[float]:
    """First kernel start to last kernel end of each request: device activity split where the device idles longer
    than `gap_us` (the host's part between two requests)."""
    spans, start, end = [], None, None
    for lo, hi in sorted(intervals):
        if start is not None and lo - end > gap_us:
            spans.append(end - start)
            start = None
        if start is None:
            start, end = lo, hi
        end = max(end, hi)
    if start is not None:
        spans.append(end - start)
    return spans


def table(seq_len: int, rows: list[dict], floor: dict[str, float]) -> str:
    groups = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        groups[r["group"]][0] += r["count"]
        groups[r["group"]][1] += r["us"]
    lines = [f"### GPU hit at {seq_len}: kernels per request", "| group | kernels | us | floor us |", "|---|---|---|---|"]
    for g, (n, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {g} | {n:.1f} | {t:.1f} | {floor[g]:.1f} |" if g in floor else f"| {g} | {n:.1f} | {t:.1f} | |")
    all_n, all_t = sum(v[0] for v in groups.values()), sum(v[1] for v in groups.values())
    lines.append(f"| **all** | {all_n:.1f} | {all_t:.1f} | {floor['attention'] + floor['GEMM']:.1f} |")
    lines.append("")
    lines.append("| kernel | count | us |\n|---|---|---|")
    lines += [f"| {r['kernel'][:100]} | {r['count']:.1f} | {r['us']:.1f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=parse_lengths, default=(2048, 16384))
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="what the pages hold: auto (the model's dtype) or an fp8 format")
    parser.add_argument("--out")
    parser.add_argument("--trace", help="write each length's Chrome trace to TRACE.<seq_len>.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    settings = Settings(**{**GPU_DEFAULTS, "seq_lens": args.seq_lens, "batch_size": args.batch_size,
                           "scenarios": ("gpu_hit",), "kv_cache_dtype": args.kv_cache_dtype})
    ceiling = ceilings(device)
    torch.cuda.empty_cache()
    weights = HSTUWeights.init(settings.model, seed=0)
    out = {"command": " ".join(["python3"] + sys.argv), "environment": environment(device), "ceilings": ceiling,
           "kv_cache_dtype": args.kv_cache_dtype, "lengths": {}}
    config = transfer_config(settings, None)
    with Engine(weights, config, device=device, batch_buckets=(args.batch_size,),
                token_buckets=(settings.query_tokens,)) as engine:
        engine.warmup()
        for index, seq_len in enumerate(settings.seq_lens):
            users = [index * args.batch_size + b for b in range(args.batch_size)]
            workload = Workload.build(users, seq_len, settings.append_len, settings.num_candidates, settings.model, 0)
            workload.load(engine)
            trace = f"{args.trace}.{seq_len}.json" if args.trace else None
            rows, spans = breakdown(engine, workload, args.requests, trace)
            floor = floors_us(settings, seq_len, ceiling, config.page_size)
            span = sorted(spans)[len(spans) // 2] if spans else None
            out["lengths"][seq_len] = {"rows": rows, "floor_us": floor, "summed_us": sum(r["us"] for r in rows),
                                       "device_span_us": spans, "device_span_median_us": span}
            print(table(seq_len, rows, floor), flush=True)
            print(f"device span per request (first kernel start -> last kernel end), median: {span} us "
                  f"over {len(spans)} spans", flush=True)
            workload.drop(engine)
    print(f"ceilings: {ceiling}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
