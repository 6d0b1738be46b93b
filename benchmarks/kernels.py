"""Microbenchmark of the paged HSTU attention (and the fused output gate) on one GPU.

Effective KV bandwidth = K and V bytes of every history token read / kernel time; it is compared with a
device-to-device copy measured in the same run (copy bandwidth counts read + write bytes, the traffic HBM serves).
The tiling sweep runs first; each (head_dim, candidates) class's rows then use its fastest tiling (the library's
defaults are set from it). Each timed CUDA graph runs the attention over `rotations` disjoint sets of pages, more
bytes than the L2 holds, so the history really comes from HBM; the time reported is per attention call.
With --kv-cache-dtype fp8_e4m3 (or fp8_e5m2) the pages hold fp8 codes and scale rows (layerflow.tier.layout) of
random values quantised by the cache's rule, and the KV bytes counted are those pages' bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from layerflow.bench.clocks import event_times_ms
from layerflow.bench.environment import results_header
from layerflow.kernels import AttentionTiling, PagedAttention, default_tiling, paged_attention_reference
from layerflow.kernels.fp8 import MMA_CHOICES, page_views, quantise
from layerflow.kernels.gluon_attention import GLUON_VARIANTS, KERNEL_CHOICES, GluonTiling
from layerflow.kernels.gluon_fp8 import GluonFp8Attention
from layerflow.kernels.gluon_fp8_tiling import LOADER_WARPS, SCALE_COPIES
from layerflow.kernels.pointwise import gated_layer_norm, gated_layer_norm_reference
from layerflow.tier.layout import KV_CACHE_DTYPES, fp8_scale_rows

APPENDED, HEADS, DTYPE, DEVICE = 64, 4, torch.bfloat16, "cuda"
L2_FLUSH_BYTES = 256 << 20


def median_ms(fn, iters: int) -> float:
    """Median over `iters` timed calls (CUDA events around each)."""
    return statistics.median(event_times_ms(fn, iters))


def graph_of(fn, *, warmup: int = 2) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters)
    return 2 * nbytes / (ms * 1e-3)


def gemm_tflops(iters: int, n: int = 8192) -> float:
    """Dense bf16 GEMM rate (n^3, torch.matmul), the compute ceiling printed beside the copy's."""
    a, b = (torch.randn(n, n, device="cuda", dtype=DTYPE) for _ in range(2))
    return 2 * n ** 3 / (median_ms(lambda: a @ b, iters) * 1e-3) / 1e12


def fp8_pool(values: torch.Tensor, rows: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """An fp8 page pool `[pages, 2, rows, H, D]` (uint8) holding `values` `[pages, 2, page_size, H, D]` quantised."""
    pages, _, page_size, heads, dim = values.shape
    pool = torch.zeros(pages, 2, rows, heads, dim, dtype=torch.uint8, device=values.device)
    codes, scales = page_views(pool, page_size)
    quantised, scale_bytes = quantise(values, kv_dtype)
    codes.copy_(quantised)
    scales.copy_(scale_bytes.transpose(2, 3))       # [pages, 2, page_size, H] -> the layout's [pages, 2, H, page]
    return pool


class Case:
    """One shape: inputs, a pool with `rotations` disjoint page sets, and the graph that runs over all of them."""

    def __init__(self, batch: int, history: int, candidates: int, head_dim: int, page_size: int,
                 tiling: AttentionTiling | None, kv_dtype: torch.dtype | None = None, kernel: str = "auto",
                 gluon_tiling: GluonTiling | None = None, fp8_mma: str = "model",
                 fp8_knobs: dict | None = None) -> None:
        self.batch, self.history, self.candidates, self.head_dim = batch, history, candidates, head_dim
        self.kv_dtype = kv_dtype
        self.hist_len = history + APPENDED
        pages = -(-self.hist_len // page_size)
        rows = page_size + (fp8_scale_rows(page_size, head_dim) if kv_dtype is not None else 0)
        row_bytes = HEADS * head_dim * (1 if kv_dtype is not None else DTYPE.itemsize)
        self.kv_bytes = batch * 2 * (self.hist_len * row_bytes if kv_dtype is None
                                     else pages * rows * row_bytes)     # fp8: whole pages, scale rows included
        self.rotations = max(2, min(32, math.ceil(L2_FLUSH_BYTES / self.kv_bytes)))
        tokens = batch * (APPENDED + candidates)
        dev = DEVICE
        self.q, self.k, self.v = (torch.randn(tokens, HEADS, head_dim, device=dev, dtype=DTYPE) for _ in range(3))
        values = torch.randn(self.rotations * batch * pages, 2, page_size, HEADS, head_dim, device=dev, dtype=DTYPE)
        self.pool = values if kv_dtype is None else fp8_pool(values, rows, kv_dtype)
        self.tables = torch.randperm(self.pool.shape[0], device=dev).to(torch.int32).view(
            self.rotations, batch, pages)
        self.offsets = torch.arange(batch + 1, device=dev, dtype=torch.int32) * (APPENDED + candidates)
        self.hist_lens = torch.full((batch,), self.hist_len, device=dev, dtype=torch.int32)
        self.app_lens = torch.full((batch,), APPENDED, device=dev, dtype=torch.int32)
        self.out = torch.empty_like(self.q)
        self.attn = PagedAttention(batch, tokens, pages, HEADS, head_dim, page_size, DTYPE, dev, head_dim ** -0.5,
                                   16384 + 512, tiling=tiling, kv_dtype=kv_dtype, kernel=kernel,
                                   fp8_mma=fp8_mma, gluon_tiling=gluon_tiling if kv_dtype is None else None)
        knobs = dict(fp8_knobs or {})
        if gluon_tiling is not None:
            knobs.update(block_n=gluon_tiling.block_n, stages=gluon_tiling.stages)
        if knobs and kv_dtype is not None and self.attn.gluon is not None:
            self.attn.gluon = GluonFp8Attention(replace(self.attn.gluon.tiling, **knobs))

    def run(self, rotation: int) -> None:
        self.attn.run(self.q, self.k, self.v, self.pool, self.tables[rotation], self.offsets, self.hist_lens,
                      self.app_lens, self.out)

    def time_ms(self, iters: int) -> float:
        graph = graph_of(lambda: [self.run(r) for r in range(self.rotations)])
        return median_ms(graph.replay, iters) / self.rotations

    def reference_ms(self, iters: int) -> float:
        return median_ms(lambda: paged_attention_reference(
            self.q, self.k, self.v, self.pool, self.tables[0], self.offsets, self.hist_lens, self.app_lens,
            torch.empty_like(self.q), alpha=self.head_dim ** -0.5, max_seq_len=16384 + 512, kv_dtype=self.kv_dtype),
            iters)

    def flops(self) -> float:
        """Multiply-adds of QK^T and AV actually needed under the mask, times 2."""
        causal = APPENDED * (self.hist_len - APPENDED) + APPENDED * (APPENDED + 1) / 2
        pairs = causal + self.candidates * (self.hist_len + 1)
        return 4.0 * pairs * HEADS * self.head_dim * self.batch


def attention_row(case: Case, copy_bw: float, iters: int, reference: bool) -> dict:
    ms = case.time_ms(iters)
    bw = case.kv_bytes / (ms * 1e-3)
    gluon = case.attn.gluon
    row = dict(batch=case.batch, history=case.history, appended=APPENDED, candidates=case.candidates,
               head_dim=case.head_dim, heads=HEADS, num_splits=case.attn.num_splits,
               kernel="gluon" if gluon else "triton", gluon_tiling=asdict(gluon.tiling) if gluon else None,
               kv_cache_dtype=str(case.kv_dtype or DTYPE), fp16_scores=case.attn.fp16_scores,
               fp16_values=case.attn.value_unit != 1.0,
               tiling=asdict(case.attn.tiling), rotations=case.rotations, time_us=ms * 1e3,
               kv_bytes=case.kv_bytes, kv_tb_s=bw / 1e12, copy_ratio=bw / copy_bw,
               tflops=case.flops() / (ms * 1e-3) / 1e12)
    if reference:
        ref_ms = case.reference_ms(max(3, iters // 10))
        row.update(reference_us=ref_ms * 1e3, speedup=ref_ms / ms)
    return row


def gate_rows(iters: int) -> list[dict]:
    """Fused u * LayerNorm(a) against the model's torch ops, each in a CUDA graph, at the block's token counts."""
    rows = []
    for tokens in (64, 320, 2560):
        u, a = (torch.randn(tokens, 1024, device="cuda", dtype=DTYPE) for _ in range(2))
        w, b = torch.randn(1024, device="cuda", dtype=DTYPE), torch.randn(1024, device="cuda", dtype=DTYPE)
        out = torch.empty_like(a)
        reps = 20
        fused = graph_of(lambda: [gated_layer_norm(u, a, w, b, 1e-6, out) for _ in range(reps)])
        torch_ops = graph_of(lambda: [gated_layer_norm_reference(u, a, w, b, 1e-6) for _ in range(reps)])
        fused_us = median_ms(fused.replay, iters) * 1e3 / reps
        torch_us = median_ms(torch_ops.replay, iters) * 1e3 / reps
        rows.append(dict(tokens=tokens, width=1024, fused_us=fused_us, torch_us=torch_us,
                         speedup=torch_us / fused_us))
    return rows


T = AttentionTiling
SWEEP_SHAPE = dict(batch=1, history=16384)
SWEEP = {
    # (head_dim, candidates): tilings tried on SWEEP_SHAPE besides the default; the fastest serves that class's rows
    (256, 0): [T(64, 64, 8, 2, 1, True), T(64, 32, 4, 2, 2), T(64, 32, 4, 2, 2, True), T(64, 32, 8, 2, 2, True),
               T(64, 64, 8, 3, 1, True), T(64, 32, 8, 3, 1, True), T(64, 64, 4, 2, 1, True)],
    (256, 256): [T(128, 64, 8, 2, 1, True), T(128, 32, 8, 2, 1, True), T(128, 32, 8, 3, 1, True),
                 T(64, 64, 8, 2, 1, True)],
    (128, 0): [T(64, 64, 4, 2, 2, True), T(64, 64, 4, 3, 2, True), T(64, 128, 8, 2, 1, True),
               T(64, 64, 8, 2, 2, True), T(64, 32, 4, 3, 2, True), T(64, 64, 4, 2, 1)],
    (128, 256): [T(128, 64, 8, 2, 1, True), T(128, 64, 8, 3, 1, True), T(128, 128, 8, 2, 1, True),
                 T(64, 64, 4, 2, 2, True), T(128, 64, 4, 2, 1, True)],
}
FP8_SWEEP = {
    # fp8 pages move half the bytes per tile, so wider key tiles fit the same shared memory
    (256, 0): [T(64, 128, 8, 2, 1, True), T(64, 64, 8, 2, 1, True), T(64, 32, 8, 3, 1, True)],
    (256, 256): [T(128, 64, 8, 3, 1, True), T(128, 64, 8, 2, 1, True)],
}


GLUON_OPTIONS = ("m64 / m128 (query rows per program), tma (the TMA loader), tanh (tanh SiLU), "
                 "rN (the loader's registers per thread), wt (no mask on whole tiles), sl (self tiles on the last "
                 "split), fN (64-row blocks' split count fills N% of a wave)")


def gluon_tiling(text: str) -> GluonTiling:
    """'32x3' -> GluonTiling(block_n=32, stages=3); '64x2:pv' -> 64-key tiles two deep, variant 'pv';
    '64x3:pv:m64:tma:tanh' -> 64-key tiles three deep with 64-row query blocks, the TMA loader and the tanh SiLU."""
    shape, *words = text.split(":")
    usage = f"gluon tiling {text!r}: expected KEYSxSTAGES[:VARIANT][:OPTION...], e.g. 32x3 or 64x2:pv:tma"
    try:
        block_n, stages = (int(part) for part in shape.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(usage) from None
    variant = words.pop(0) if words else GluonTiling.variant
    if variant not in GLUON_VARIANTS:
        raise argparse.ArgumentTypeError(f"gluon tiling {text!r}: variant {variant!r} is not one of {GLUON_VARIANTS}")
    options = dict(block_n=block_n, stages=stages, variant=variant)
    for word in words:
        if word in ("m64", "m128"):
            options["block_m"] = int(word[1:])
        elif word == "tma":
            options["loader"] = "tma"
        elif word == "tanh":
            options["tanh_silu"] = True
        elif word == "wt":
            options["unmasked_whole_tiles"] = True
        elif word == "sl":
            options["self_last"] = True
        elif word[:1] == "r" and word[1:].isdigit():
            options["producer_registers"] = int(word[1:])
        elif word[:1] == "f" and word[1:].isdigit():
            options["m64_fill"] = int(word[1:]) / 100
        else:
            raise argparse.ArgumentTypeError(f"gluon tiling {text!r}: option {word!r} is not one of {GLUON_OPTIONS}")
    return GluonTiling(**options)


def gluon_label(tiling: dict) -> str:
    """A results row's Gluon tiling as the --gluon-tiling text that selects it."""
    words = [f"gluon {tiling['block_n']}x{tiling['stages']}"]
    if "scale_copy" in tiling:      # the fp8 kernel's knobs (gluon_fp8_tiling.Fp8Tiling)
        words += [f"c{tiling['code_stages']}", tiling["scale_copy"], f"w{tiling['producer_warps']}"]
        words += ["dots"] * (tiling.get("scale_site") == "dots") + ["tanh"] * (tiling.get("silu") == "tanh")
        return ":".join(words + ["wt"] * bool(tiling.get("unmasked_whole_tiles")))
    words.append(tiling.get("variant", "sync"))
    if tiling.get("block_m"):
        words.append(f"m{tiling['block_m']}")
    if tiling.get("loader") == "tma":
        words.append("tma")
    if tiling.get("tanh_silu"):
        words.append("tanh")
    if tiling.get("producer_registers", GluonTiling.producer_registers) != GluonTiling.producer_registers:
        words.append(f"r{tiling['producer_registers']}")
    if tiling.get("unmasked_whole_tiles"):
        words.append("wt")
    if tiling.get("self_last"):
        words.append("sl")
    if tiling.get("m64_fill", 1.0) != 1.0:
        words.append(f"f{round(tiling['m64_fill'] * 100)}")
    return ":".join(words)


def kernel_row(batch: int, history: int, candidates: int, head_dim: int, args: argparse.Namespace,
               tiling: AttentionTiling | None, kernel: str, g_tiling: GluonTiling | None, fp8_mma: str,
               copy_bw: float, fp8_knobs: dict | None = None, cases: dict | None = None) -> dict:
    """One timed row, or the failure (with its traceback printed) as the row: a kernel that does not compile on
    this GPU is a result too. `cases` keeps each shape's Case for the next block (--blocks) to time again."""
    try:
        key = (batch, history, candidates, head_dim, tiling, kernel, g_tiling, fp8_mma, str(fp8_knobs))
        case = (cases or {}).get(key) or Case(batch, history, candidates, head_dim, args.page_size, tiling,
                                              KV_CACHE_DTYPES[args.kv_cache_dtype], kernel, g_tiling, fp8_mma,
                                              fp8_knobs)
        if cases is not None:
            cases[key] = case
        row = attention_row(case, copy_bw, args.iters, not args.no_reference)
        print(markdown([row]).splitlines()[-1], flush=True)
    except Exception as error:
        traceback.print_exc()
        row = dict(batch=batch, history=history, candidates=candidates, head_dim=head_dim, kernel=kernel,
                   num_splits=tiling.num_splits if tiling else None,
                   gluon_tiling=asdict(g_tiling) if g_tiling else None, fp8_mma=fp8_mma, error=str(error)[:2000])
        print(f"# {kernel} {g_tiling}: {type(error).__name__}", flush=True)
    if cases is None:
        torch.cuda.empty_cache()
    return row


def block_summary(rows: list[dict]) -> str:
    """Each (kernel, shape)'s median, min and max time over the blocks (--blocks), with its TFLOP/s and KV TB/s
    at the median, as a markdown table."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            label = markdown([r]).splitlines()[-1].split(" | ")[0].removeprefix("| ")
            groups.setdefault((label, r["batch"], r["history"], r["candidates"], r["head_dim"]), []).append(r)
    lines = ["| kernel | BS | history | cand | D | blocks | median us | min | max | TFLOP/s | KV TB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (label, bs, hist, cand, d), group in groups.items():
        times = [r["time_us"] for r in group]
        mid = statistics.median(times)
        scale = group[0]["time_us"] / mid
        lines.append(f"| {label} | {bs} | {hist} | {cand} | {d} | {len(times)} | {mid:.1f} | {min(times):.1f} | "
                     f"{max(times):.1f} | {group[0]['tflops'] * scale:.0f} | {group[0]['kv_tb_s'] * scale:.2f} |")
    return "\n".join(lines)


def fp8_knobs(scale_copy: str | None, code_stages: int | None, producer_warps: int | None) -> dict:
    """The Fp8Tiling fields the command line sets (the library's default for the others)."""
    knobs = dict(scale_copy=scale_copy, code_stages=code_stages, producer_warps=producer_warps)
    return {name: value for name, value in knobs.items() if value is not None}


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | BS | history | cand | D | splits | time (us) | KV TB/s | / copy | TFLOP/s | torch ref (us) "
             "| speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = f"{r['reference_us']:.0f} | {r['speedup']:.1f}x" if "reference_us" in r else "- | -"
        gluon = r.get("gluon_tiling")
        kernel = gluon_label(gluon) if gluon else r.get("kernel", "triton")
        if r.get("kv_cache_dtype", "torch.bfloat16") != "torch.bfloat16":
            mma = " fp16 q.k + V" if r.get("fp16_values") else " fp16 q.k" if r.get("fp16_scores") else ""
            kernel += f" {r['kv_cache_dtype'].removeprefix('torch.')}{mma}"
        lines.append(f"| {kernel} | {r['batch']} | {r['history']} | {r['candidates']} | {r['head_dim']} | "
                     f"{r['num_splits']} | {r['time_us']:.1f} | {r['kv_tb_s']:.2f} | {r['copy_ratio']:.2f} | "
                     f"{r['tflops']:.0f} | {ref} |")
    return "\n".join(lines)


def row_specs(args: argparse.Namespace, chosen: dict, kv_dtype: torch.dtype | None):
    """Every timed row's (batch, history, candidates, head_dim, tiling, kernel, gluon tiling, fp8 MMA, fp8 knobs),
    in the order they run: head dims, batches, candidates, then histories x kernels x MMAs x tilings x splits."""
    for d, bs, cand in itertools.product(args.head_dim, args.batch, args.candidates):
        for hist, kernel, mma in itertools.product(args.history, args.kernel, args.fp8_mma):
            fp8_gluon = kernel == "gluon" and kv_dtype is not None
            fp8_sets = (list(itertools.product(args.fp8_scale_copy, args.fp8_code_stages, args.fp8_producer_warps))
                        if fp8_gluon else [(None, None, None)])
            g_tilings = args.gluon_tiling if kernel == "gluon" else [None]
            for g_tiling, splits, fp8_set in itertools.product(g_tilings, args.num_splits, fp8_sets):
                tiling = chosen.get((d, cand))
                if splits is not None:
                    tiling = replace(tiling or default_tiling(d, DTYPE, APPENDED + cand), num_splits=splits)
                yield bs, hist, cand, d, tiling, kernel, g_tiling, mma, fp8_knobs(*fp8_set)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--history", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--candidates", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=1,
                        help="time every row this many times, the rows alternated within each block (A/B in one "
                             "process), and print each row's median over the blocks")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tiling sweep")
    parser.add_argument("--no-gate", action="store_true", help="skip the fused u * LayerNorm(a) benchmark")
    parser.add_argument("--kernel", nargs="+", choices=KERNEL_CHOICES, default=["auto"],
                        help="attention kernel(s) to time (PagedAttention's kernel argument)")
    parser.add_argument("--gluon-tiling", nargs="+", type=gluon_tiling, default=[None],
                        help="Gluon tilings KEYSxSTAGES[:VARIANT] to time with --kernel gluon (default: the "
                             "library's; over fp8 pages only KEYSxSTAGES applies)")
    parser.add_argument("--fp8-scale-copy", nargs="+", choices=SCALE_COPIES, default=[None],
                        help="scale copies of the fp8 Gluon kernel to time (default: $LAYERFLOW_FP8_SCALE_COPY, "
                             "else async where pages hold a multiple of 4 tokens)")
    parser.add_argument("--fp8-code-stages", type=int, nargs="+", default=[None],
                        help="code slots in flight of the fp8 Gluon kernel to time (default: the library's)")
    parser.add_argument("--fp8-producer-warps", type=int, nargs="+", choices=LOADER_WARPS, default=[None],
                        help="loader warps of the fp8 Gluon kernel to time (8: 64-row query blocks only)")
    parser.add_argument("--num-splits", type=int, nargs="+", default=[None],
                        help="split counts to time (default: PagedAttention's choice)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="what the pages hold: auto (the model's dtype) or an fp8 format")
    parser.add_argument("--fp8-mma", nargs="+", choices=MMA_CHOICES, default=["model"],
                        help="MMA dtype choice(s) over fp8 pages to time (PagedAttention's fp8_mma; the sweep "
                             "uses the first)")
    args = parser.parse_args()
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")

    result = dict(**results_header(torch.device(DEVICE)), dtype=str(DTYPE), page_size=args.page_size,
                  kv_cache_dtype=args.kv_cache_dtype, rows=[],
                  sweep=[], gate=[])

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))

    started = time.perf_counter()
    copy_bw = copy_bandwidth(1 << 30, args.iters)
    result["copy_tb_s"] = copy_bw / 1e12
    gpu = result["environment"]["device"]
    result["gemm_tflops"] = gemm_tflops(args.iters)
    print(f"# {gpu}: device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write), bf16 GEMM "
          f"{result['gemm_tflops']:.0f} TFLOP/s", flush=True)
    chosen: dict[tuple[int, int], AttentionTiling | None] = {}
    if not args.no_sweep:
        sweep = {shape: tilings for shape, tilings in (SWEEP if kv_dtype is None else FP8_SWEEP).items()
                 if shape[0] in args.head_dim and shape[1] in args.candidates}
        for (d, cand), tilings in sweep.items():
            best = (math.inf, None)
            for tiling in [None] + tilings:
                try:
                    case = Case(SWEEP_SHAPE["batch"], SWEEP_SHAPE["history"], cand, d, args.page_size, tiling,
                                kv_dtype, fp8_mma=args.fp8_mma[0])
                    row = attention_row(case, copy_bw, args.iters, False)
                    best = min(best, (row["time_us"], tiling), key=lambda b: b[0])
                except Exception as error:  # a tiling that does not compile or fit is a result of the sweep
                    row = dict(batch=SWEEP_SHAPE["batch"], history=SWEEP_SHAPE["history"], candidates=cand,
                               head_dim=d, tiling=asdict(tiling or default_tiling(d, DTYPE, APPENDED + cand)),
                               error=str(error)[:200])
                row["default"] = tiling is None
                result["sweep"].append(row)
                save()
                print("# sweep", json.dumps({k: row.get(k) for k in ("tiling", "num_splits", "time_us", "kv_tb_s",
                                                                       "tflops", "error")}), flush=True)
                torch.cuda.empty_cache()
            chosen[(d, cand)] = best[1]
        result["chosen"] = {f"d{d}_cand{c}": asdict(t) if t else "default" for (d, c), t in chosen.items()}
    cases: dict | None = {} if args.blocks > 1 else None
    for block in range(args.blocks):
        for bs, hist, cand, d, tiling, kernel, g_tiling, mma, knobs in row_specs(args, chosen, kv_dtype):
            row = kernel_row(bs, hist, cand, d, args, tiling, kernel, g_tiling, mma, copy_bw, knobs, cases)
            row["block"] = block
            result["rows"].append(row)
            save()
    if not args.no_gate:
        result["gate"] = gate_rows(args.iters)
        save()
        for g in result["gate"]:
            print(f"# u*LayerNorm(a) T={g['tokens']}: fused {g['fused_us']:.2f} us, torch {g['torch_us']:.2f} us")
    result["seconds"] = time.perf_counter() - started
    save()
    print()
    print(markdown([r for r in result["rows"] if "error" not in r]))
    if args.blocks > 1:
        result["summary"] = block_summary(result["rows"])
        save()
        print()
        print(result["summary"])


if __name__ == "__main__":
    main()
