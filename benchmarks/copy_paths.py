"""Copy paths A/B: the host time to issue an onboarding (and an offload) and its copy time, per copy path, on
fragmented placements of a 4K-token user, in one process with the paths alternated in blocks.

Per transfer, by the host clock (layerflow.bench.serving_issue): the whole `onboard` call, of it the copy calls (the
driver) and the address set-up; by CUDA events on the copy stream: from an event recorded just before the call to one
after the transfer's last copy (so the copy engine's wait for the first call counts), against one bulk pinned
cudaMemcpyAsync of the same bytes (benchmarks/transfer.py). Onboardings post an eventfd signal per layer, as the
runtime does. Placements (both sides): runs of 1, 4 and 16 pages; `batch3`, three one-run users in one onboarding (a
serving batch of host hits, one call per layer for all of them); `offload2`, an offload of 2 pages whose host blocks
are apart (a visit's appended page and the one before it). Paths: `auto` (the default: 2D for one run, else a batch
entry per page), `run_batch` (a 3D batch op per run), `runs` (a 2D call per run).

    PYTHONPATH=. python3 benchmarks/copy_paths.py --out copy-paths-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from layerflow.bench.environment import results_header
from layerflow.bench.serving_issue import IssueTimedCopyEngine
from layerflow.config import SignalMode
from layerflow.transfer import cuda_api
from layerflow.transfer.cuda_copy import CopyPath
from layerflow.transfer.signals import make_signals
from transfer import BulkCopy, add_model_arguments, runs_of

PATHS = ("auto", "run_batch", "runs")


def placements(pages: int) -> dict[str, tuple[np.ndarray, np.ndarray, bool]]:
    """name -> (GPU pages, host blocks, onboard?)."""
    users = [np.arange(pages) + u * (pages + 3) for u in range(3)]
    return {
        "runs1": (runs_of(pages, 1, 1), runs_of(pages, 1, 1) + 1, True),
        "runs4": (runs_of(pages, 4, 1), runs_of(pages, 4, 2), True),
        "runs16": (runs_of(pages, 16, 1), runs_of(pages, 16, 3), True),
        "batch3": (np.concatenate(users), np.concatenate(users[::-1]), True),
        "offload2": (np.array([7, 8]), np.array([40, 90]), False),
    }


def measure(engine: IssueTimedCopyEngine, ring, gpu, host, pages, blocks, onboard: bool) -> tuple[float, float]:
    """One transfer: (host ms of the whole call, GPU ms from before the call to after its last copy)."""
    stream = engine.h2d_stream if onboard else engine.d2h_stream
    start, end = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)
    torch.cuda.synchronize()
    cuda_api.record(start, stream)
    handle = ring.acquire() if onboard else None
    began = time.perf_counter()
    transfer = engine.onboard(gpu, host, pages, blocks, handle) if onboard else engine.offload(gpu, host, pages,
                                                                                                blocks)
    issued = time.perf_counter() - began
    cuda_api.record(end, stream)
    transfer.wait(10)
    if handle is not None:
        handle.wait()
        handle.release()
    cuda_api.synchronize(end)
    gpu_ms = cuda_api.elapsed_ms(start, end)
    cuda_api.destroy_event(start)
    cuda_api.destroy_event(end)
    return issued * 1e3, gpu_ms


def run(args) -> list[dict]:
    shape = (2, args.page, args.heads, args.dim)
    pool = 3 * (args.tokens // args.page + 3) + 8
    # The bytes do not matter here (tests/transfer check them): uninitialised pools, no seconds spent filling them.
    gpu = [torch.empty((2 * pool, *shape), dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
    host = torch.empty((2 * pool, args.layers, *shape), dtype=torch.bfloat16, pin_memory=True)
    page_bytes = gpu[0][0].numel() * gpu[0].element_size()
    places = placements(args.tokens // args.page)
    bulk = BulkCopy(max(p.size for p, _, _ in places.values()) * args.layers * page_bytes)
    engine = IssueTimedCopyEngine()
    ring = make_signals(SignalMode.EVENTFD, args.layers, num_counters=4)
    samples: dict[tuple[str, str], list[tuple]] = {}
    try:
        for _block in range(args.blocks):
            for name, (pages, blocks, onboard) in places.items():
                for path in PATHS:
                    engine.path = CopyPath[path.upper()]
                    measure(engine, ring, gpu, host, pages, blocks, onboard)   # warm: first call per shape
                    engine.records.clear()
                    for _ in range(args.iters):
                        issued, gpu_ms = measure(engine, ring, gpu, host, pages, blocks, onboard)
                        record = engine.records.pop()
                        nbytes = pages.size * args.layers * page_bytes
                        bulk_ms = bulk.gpu_seconds(nbytes, onboard) * 1e3
                        samples.setdefault((name, path), []).append(
                            (issued, record.calls_s * 1e3, record.setup_s * 1e3, gpu_ms, bulk_ms, record.runs,
                             record.path))
    finally:
        ring.close()
        engine.close()
    rows = []
    for (name, path), values in samples.items():
        issued, calls, setup, gpu_ms, bulk_ms, runs, taken = zip(*values)
        rows.append({"placement": name, "path": path, "taken": taken[0], "runs": runs[0],
                     "pages": int(places[name][0].size), "onboard": places[name][2], "samples": len(values),
                     "issue_ms": statistics.median(issued), "calls_ms": statistics.median(calls),
                     "setup_ms": statistics.median(setup), "gpu_ms": statistics.median(gpu_ms),
                     "bulk_ms": statistics.median(bulk_ms),
                     "gpu_efficiency": statistics.median(bulk_ms) / statistics.median(gpu_ms)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| placement | runs | path (taken) | issue ms | of it copy calls | set-up | GPU ms | bulk ms | GPU eff. |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['placement']} | {r['runs']} | {r['path']} ({r['taken']}) | {r['issue_ms']:.3f} | "
              f"{r['calls_ms']:.3f} | {r['setup_ms']:.3f} | {r['gpu_ms']:.3f} | {r['bulk_ms']:.3f} | "
              f"{r['gpu_efficiency']:.3f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=4096, help="one user's tokens")
    parser.add_argument("--iters", type=int, default=8, help="transfers per path per block")
    parser.add_argument("--blocks", type=int, default=3, help="alternated blocks of every placement x path")
    args = parser.parse_args()
    rows = run(args)
    table = markdown(rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**results_header(torch.device("cuda")), "settings": vars(args) | {
            "out": str(args.out)}, "rows": rows, "table": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
