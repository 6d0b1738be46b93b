"""Transfer microbenchmark: copy-engine onboarding/offload against one bulk pinned memcpy, and signal latency.

Efficiency = bulk time / transfer time for the same bytes, both measured here (medians, engine and bulk alternated so
drift hits both). The bulk is one plain cudaMemcpyAsync issued through ctypes, like the engine's copies. Onboardings
run as in the runtime: with a counter of the `--signal` mode's ring, posted after each layer, waited and released.
"wall" is host wall clock from issue to completion (Python issue cost included); "GPU" is CUDA-event time on the copy
stream from a start event to an end event (no timing events between layers: each costs the copy engine 1-2 us).
`signal_cost` repeats the smallest fragmented user per signal mode and without signals. Fragmented placements are
measured on both copy paths (per-run 2D copies, per-page batch; "auto" marks the engine's default). Placements of a
user's pages:
- contiguous: one run on both sides;
- runs16: runs of 16 pages on both sides (a history written a few visits at a time into a pool with room);
- churn: first-fit (lowest free index) allocations on a GPU pool and a host pool fragmented by random users coming
  and going, the allocator behaviour a bitmap pool gives;
- scattered: random pages and blocks (every run one page: the cudaMemcpyBatchAsync path).
Signal latency, per mode, per layer ("copy complete -> waiter released"): the copy stream is held behind a gate word
(cuStreamWaitValue32) until every command is queued, then opened at host time t0. Host waiters: release time - t0 -
GPU time from the gate to the layer's last copy (an upper bound: it includes the gate's few-microsecond wake-up).
GPU waiters: CUDA-event time from the layer's last copy to an event recorded right after the wait on the compute
stream (eager), or inside a captured graph (graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from cuda.bindings import driver

from layerflow.bench.copy_timing import Marks, TimedCudaCopyEngine, TimedTransfer
from layerflow.bench.environment import results_header
from layerflow.transfer import cuda_api, cudart
from layerflow.config import SignalMode, Config
from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.cuda_copy import CopyPath, CudaCopyEngine, resolved_path
from layerflow.transfer.signals.base import LayerSignals
from layerflow.transfer.signals import make_signals


def first_fit(free: np.ndarray, n: int) -> np.ndarray:
    taken = np.flatnonzero(free)[:n]
    free[taken] = False
    return taken


def churned(total: int, n: int, seed: int, steps: int = 3000) -> np.ndarray:
    """`n` first-fit indices from a pool of `total` after `steps` of churn.

    Users' histories grow a few pages per visit (so their pages interleave), and whole users are evicted: the holes
    left behind are the sizes of those growth steps.
    """
    rng = np.random.default_rng(seed)
    free = np.ones(total, dtype=bool)
    users: list[list[int]] = []
    for _ in range(steps):
        grow = int(rng.integers(1, 5))
        if users and (free.sum() < grow + n // 4 or rng.random() < 0.05):
            free[users.pop(int(rng.integers(len(users))))] = True
        elif users and rng.random() < 0.9:
            users[int(rng.integers(len(users)))].extend(first_fit(free, grow).tolist())
        else:
            users.append(first_fit(free, grow).tolist())
    while free.sum() < n:
        free[users.pop(int(rng.integers(len(users))))] = True
    return first_fit(free, n)


def runs_of(n: int, run: int, gap: int) -> np.ndarray:
    """`n` indices in runs of `run` with `gap` indices skipped between runs."""
    i = np.arange(n)
    return i + (i // run) * gap


def placements(pages: int, total: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "contiguous": (np.arange(pages), np.arange(pages)),
        "runs16": (runs_of(pages, 16, gap=3), runs_of(pages, 16, gap=5)),
        "churn": (churned(total, pages, seed), churned(total, pages, seed + 1000)),
        "scattered": (rng.permutation(total)[:pages], rng.permutation(total)[:pages]),
    }


class BulkCopy:
    """The reference: one plain cudaMemcpyAsync of the same bytes, issued through the engine's own ctypes path on a
    stream of its own (torch's `copy_` adds a dispatch of 5-70 us before the copy starts, which varied between runs)."""

    def __init__(self, max_bytes: int) -> None:
        self.host = torch.empty(max_bytes, dtype=torch.uint8).pin_memory()
        self.gpu = torch.empty(max_bytes, dtype=torch.uint8, device="cuda")
        self.stream = cuda_api.create_stream()
        self.start, self.end = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)

    def _issue(self, nbytes: int, to_gpu: bool) -> None:
        if to_gpu:
            cudart.memcpy_async(self.gpu.data_ptr(), self.host.data_ptr(), nbytes, cudart.MEMCPY_HOST_TO_DEVICE,
                                self.stream)
        else:
            cudart.memcpy_async(self.host.data_ptr(), self.gpu.data_ptr(), nbytes, cudart.MEMCPY_DEVICE_TO_HOST,
                                self.stream)
        cuda_api.record(self.end, self.stream)

    def wall_seconds(self, nbytes: int, to_gpu: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        self._issue(nbytes, to_gpu)
        cuda_api.synchronize(self.end)
        return time.perf_counter() - start

    def gpu_seconds(self, nbytes: int, to_gpu: bool) -> float:
        torch.cuda.synchronize()
        cuda_api.record(self.start, self.stream)
        self._issue(nbytes, to_gpu)
        cuda_api.synchronize(self.end)
        return cuda_api.elapsed_ms(self.start, self.end) / 1e3


def alternate(engine_fn: Callable[[], float], bulk_fn: Callable[[], float], iters: int) -> tuple[float, float]:
    """Median seconds of `engine_fn` and `bulk_fn` (each returns its own seconds), alternated so drift hits both."""
    engine_fn(), bulk_fn()
    engine_times, bulk_times = [], []
    for _ in range(iters):
        engine_times.append(engine_fn())
        bulk_times.append(bulk_fn())
    return statistics.median(engine_times), statistics.median(bulk_times)


PATH_NAMES = {CopyPath.RUNS: "2d", CopyPath.PAGES: "batch"}


def transfer_seconds(transfer: TimedTransfer) -> float:
    """GPU time from a timed transfer's start event to its end event (`Marks.TOTAL`)."""
    seconds = transfer.marks_ms()[-1] / 1e3
    transfer.release()
    return seconds


class Onboarder:
    """Onboards as the runtime does: a counter of a signal ring per onboarding, posted after every layer's copies,
    consumed and released after the transfer. `ring=None`: no signals (the copies alone)."""

    def __init__(self, engine: CudaCopyEngine, ring: LayerSignals | None) -> None:
        self.engine, self.ring = engine, ring

    def __call__(self, *place) -> Transfer:
        handle = self.ring.acquire() if self.ring is not None else None
        transfer = self.engine.onboard(*place, handle)
        transfer.wait()
        if handle is not None:
            handle.wait()
            handle.release()
        return transfer


def wall_of(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth(args, engine, timed, gpu, host, bulk) -> list[dict]:
    """Every size x placement x copy path, onboarding with `args.signal` signals, against the bulk copy."""
    ring = make_signals(SignalMode(args.signal), args.layers, num_counters=4)
    page_bytes = gpu[0][0].numel() * gpu[0].element_size()
    onboard, onboard_timed = Onboarder(engine, ring), Onboarder(timed, ring)
    rows = []
    for tokens in args.tokens:
        pages = tokens // args.page
        nbytes = pages * args.layers * page_bytes
        for name, (gpu_pages, host_blocks) in placements(pages, args.pool_pages, tokens).items():
            runs = int(1 + np.count_nonzero((np.diff(gpu_pages) != 1) | (np.diff(host_blocks) != 1)))
            for path in ([CopyPath.RUNS] if runs == 1 else list(PATH_NAMES)):
                engine.path = timed.path = path
                place = (gpu, host, gpu_pages, host_blocks)
                on, on_bulk = alternate(lambda: wall_of(lambda: onboard(*place)),
                                        lambda: bulk.wall_seconds(nbytes, True), args.iters)
                off, off_bulk = alternate(lambda: wall_of(lambda: engine.offload(*place).wait()),
                                          lambda: bulk.wall_seconds(nbytes, False), args.iters)
                on_gpu, h2d_gpu = alternate(lambda: transfer_seconds(onboard_timed(*place)),
                                            lambda: bulk.gpu_seconds(nbytes, True), args.iters)
                off_gpu, d2h_gpu = alternate(lambda: transfer_seconds(timed.offload(*place)),
                                             lambda: bulk.gpu_seconds(nbytes, False), args.iters)
                issue = statistics.median(_issue_time(engine, *place) for _ in range(5))
                rows.append({
                    "tokens": tokens, "placement": name, "path": PATH_NAMES[path],
                    "auto": path is resolved_path(CopyPath.AUTO, runs), "runs": runs, "bytes": nbytes,
                    "signal": args.signal,
                    "onboard_GBps": nbytes / on / 1e9, "bulk_h2d_GBps": nbytes / on_bulk / 1e9,
                    "onboard_efficiency": on_bulk / on, "onboard_gpu_efficiency": h2d_gpu / on_gpu,
                    "offload_GBps": nbytes / off / 1e9, "bulk_d2h_GBps": nbytes / off_bulk / 1e9,
                    "offload_efficiency": off_bulk / off, "offload_gpu_efficiency": d2h_gpu / off_gpu,
                    "onboard_ms": on * 1e3, "bulk_h2d_ms": on_bulk * 1e3, "issue_ms": issue * 1e3,
                })
                print(json.dumps(rows[-1]), flush=True)
    ring.close()
    return rows


def signal_cost(args, timed, gpu, host, bulk) -> list[dict]:
    """What each signal mode's per-layer marks cost the copy engine: GPU efficiency of the smallest user after churn
    (the case where per-layer costs weigh most), per mode and with no signals."""
    tokens = min(args.tokens)
    pages = tokens // args.page
    nbytes = pages * args.layers * gpu[0][0].numel() * gpu[0].element_size()
    gpu_pages, host_blocks = placements(pages, args.pool_pages, tokens)["churn"]
    place = (gpu, host, gpu_pages, host_blocks)
    timed.path = CopyPath.AUTO
    rows = []
    for mode in [None, *SignalMode]:
        ring = None if mode is None else make_signals(mode, args.layers, num_counters=4)
        onboard = Onboarder(timed, ring)
        on_gpu, h2d_gpu = alternate(lambda: transfer_seconds(onboard(*place)),
                                    lambda: bulk.gpu_seconds(nbytes, True), 3 * args.iters)
        rows.append({"tokens": tokens, "placement": "churn", "signal": "none" if mode is None else mode.value,
                     "onboard_gpu_efficiency": h2d_gpu / on_gpu, "onboard_gpu_us": on_gpu * 1e6,
                     "bulk_gpu_us": h2d_gpu * 1e6})
        print(json.dumps(rows[-1]), flush=True)
        if ring is not None:
            ring.close()
    return rows


def _issue_time(engine, gpu, host, gpu_pages, host_blocks) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    transfer = engine.onboard(gpu, host, gpu_pages, host_blocks)
    issued = time.perf_counter() - start
    transfer.wait()
    return issued


class Gate:
    """A pinned word the current stream waits on: queue everything, then open at a known host time."""

    def __init__(self) -> None:
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.host = self.word.numpy()
        self.value = 0

    def close(self) -> None:
        self.value += 1
        stream = torch.cuda.current_stream().cuda_stream
        err, = driver.cuStreamWaitValue32(stream, self.word.data_ptr(), self.value,
                                          driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        assert int(err) == 0, err

    def open(self) -> float:
        now = time.perf_counter()
        self.host[0] = self.value
        return now


def signal_latency(args, gpu, host) -> list[dict]:
    engine = TimedCudaCopyEngine(Marks.LAYERS)
    pages = args.latency_tokens // args.page
    gate = Gate()
    rows = []
    for mode in SignalMode:
        ring = make_signals(mode, args.layers, num_counters=4)
        host_us: list[float] = []
        gpu_us: list[float] = []
        graph_us: list[float] = []
        compute = torch.cuda.Stream()
        after = [cuda_api.create_event(timing=True) for _ in range(args.layers)]
        graph = None
        if mode is not SignalMode.EVENTFD:
            graph_events = [cuda_api.create_event(timing=True) for _ in range(args.layers)]
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                capture = torch.cuda.current_stream().cuda_stream
                for layer in range(args.layers):
                    ring.capture_gpu_wait(layer, capture)
                    cuda_api.record_external(graph_events[layer], capture)
        for it in range(args.latency_iters):
            torch.cuda.synchronize()
            gate.close()
            handle = ring.acquire()
            transfer = engine.onboard(gpu, host, np.arange(pages), np.arange(pages), handle)
            use_graph = graph is not None and it % 2 == 1
            if use_graph:
                with torch.cuda.stream(compute):
                    ring.prepare_replay(handle, compute.cuda_stream)
                    graph.replay()
            elif graph is not None:
                for layer in range(args.layers):
                    handle.gpu_wait_layer(layer, compute.cuda_stream)
                    cuda_api.record(after[layer], compute.cuda_stream)
            opened = gate.open()
            released = []
            for layer in range(args.layers):
                handle.wait_layer(layer)
                released.append(time.perf_counter())
            transfer.wait()
            compute.synchronize()
            layer_done = transfer.events[1:]
            for layer, gpu_done_ms in enumerate(transfer.marks_ms()):
                host_us.append((released[layer] - opened - gpu_done_ms / 1e3) * 1e6)
                if use_graph:
                    graph_us.append(cuda_api.elapsed_ms(layer_done[layer], graph_events[layer]) * 1e3)
                elif graph is not None:
                    gpu_us.append(cuda_api.elapsed_ms(layer_done[layer], after[layer]) * 1e3)
            transfer.release()
            handle.release()
        row = {"mode": mode.value}
        for name, values in (("host_wait_us", host_us), ("gpu_wait_us", gpu_us), ("graph_wait_us", graph_us)):
            if values:
                row[name] = {"median": statistics.median(values), "p90": float(np.percentile(values, 90)),
                             "n": len(values)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        ring.close()
    engine.close()
    return rows


def markdown(results: dict) -> str:
    lines = [f"GPU: {results['environment']['device']}", "",
             "| tokens | placement | runs | path | onboard GB/s | bulk H2D GB/s | onboard eff. (wall / GPU) "
             "| offload GB/s | bulk D2H GB/s | offload eff. (wall / GPU) | issue ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["bandwidth"]:
        lines.append(f"| {r['tokens']} | {r['placement']} | {r['runs']} | {r['path']}{' (auto)' * r['auto']} | "
                     f"{r['onboard_GBps']:.1f} | "
                     f"{r['bulk_h2d_GBps']:.1f} | {r['onboard_efficiency']:.3f} / {r['onboard_gpu_efficiency']:.3f} | "
                     f"{r['offload_GBps']:.1f} | {r['bulk_d2h_GBps']:.1f} | "
                     f"{r['offload_efficiency']:.3f} / {r['offload_gpu_efficiency']:.3f} | {r['issue_ms']:.3f} |")
    lines += ["", "| signal marks (smallest user, churn) | onboard GPU eff. | onboard us | bulk us |",
              "|---|---|---|---|"]
    lines += [f"| {r['signal']} | {r['onboard_gpu_efficiency']:.3f} | {r['onboard_gpu_us']:.1f} | "
              f"{r['bulk_gpu_us']:.1f} |" for r in results["signal_cost"]]
    lines += ["", "| signal | host wait us (median / p90) | GPU wait us | captured-graph wait us |",
              "|---|---|---|---|"]
    for r in results["signal_latency"]:
        cells = [f"{r[k]['median']:.1f} / {r[k]['p90']:.1f}" if k in r else "-"
                 for k in ("host_wait_us", "gpu_wait_us", "graph_wait_us")]
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV shape flags (the hstu-bench model's by default): layers, heads, head dim, page size."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--page", type=int, default=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results JSON here (and a .md table next to it)")
    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--pool-pages", type=int, default=2048, help="GPU pages per layer = host blocks")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--signal", choices=[m.value for m in SignalMode], default=Config().signal.value,
                        help="signal mode of the onboardings timed for bandwidth (default: the config default)")
    parser.add_argument("--latency-tokens", type=int, default=2048)
    parser.add_argument("--latency-iters", type=int, default=20)
    args = parser.parse_args()

    shape = (2, args.page, args.heads, args.dim)
    gpu = [torch.randn((args.pool_pages, *shape), device="cuda").to(torch.bfloat16) for _ in range(args.layers)]
    host = torch.randn((args.pool_pages, args.layers, *shape)).to(torch.bfloat16).pin_memory()
    bulk = BulkCopy(max(args.tokens) // args.page * args.layers * gpu[0][0].numel() * 2)

    engine, timed = CudaCopyEngine(), TimedCudaCopyEngine(Marks.TOTAL)
    results = {
        **results_header(torch.device("cuda")),
        "model": {"layers": args.layers, "heads": args.heads, "head_dim": args.dim, "dtype": "bf16", "page": args.page},
        "bandwidth": bandwidth(args, engine, timed, gpu, host, bulk),
        "signal_cost": signal_cost(args, timed, gpu, host, bulk),
        "signal_latency": signal_latency(args, gpu, host),
    }
    engine.close()
    timed.close()
    table = markdown(results)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
