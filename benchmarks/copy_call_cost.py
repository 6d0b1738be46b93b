"""What the CUDA calls of a layerwise onboarding cost the issuing host (issues 18, 20).

Per row count (one row = one page of a block-first host layout: `--page-kib` bytes, `--layers` pages apart), host
microseconds of one cudaMemcpy2DAsync host -> device and device -> host from pinned memory, and the device time from
an event recorded just before the call to one recorded after it (the call's host time plus the copy); then the
waitvalue post's event record and the posting stream's wait. Medians of `--iters` calls, the stream drained between
copies. On the H200 (session 16) a pitched copy's call costs 3-5 us whatever its rows (1 to 512): the host cost of an
onboarding is not in the driver's copy calls (docs/performance.md).

    python3 benchmarks/copy_call_cost.py --rows 1,8,64,256,512 --page-kib 128 --out call-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's layerflow, not an installed one

from layerflow.bench.environment import results_header  # noqa: E402
from layerflow.transfer import cuda_api, cudart  # noqa: E402


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def copy_costs(rows: int, page: int, layers: int, iters: int, to_gpu: bool) -> dict:
    """Host us of one pitched copy of `rows` pages and the device's wait for it (event before the call -> copy end,
    less the same copy queued before its start event)."""
    host = torch.empty(rows * layers * page, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(rows * page, dtype=torch.uint8, device="cuda")
    stream = cuda_api.create_stream()
    before, after = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)
    kind = cudart.MEMCPY_HOST_TO_DEVICE if to_gpu else cudart.MEMCPY_DEVICE_TO_HOST
    dst, dpitch, src, spitch = ((gpu.data_ptr(), page, host.data_ptr(), layers * page) if to_gpu
                                else (host.data_ptr(), layers * page, gpu.data_ptr(), page))
    calls, spans = [], []
    for i in range(iters + 3):
        cuda_api.record(before, stream)
        start = time.perf_counter()
        cudart.memcpy_2d_async(dst, dpitch, src, spitch, page, rows, kind, stream)
        spent = time.perf_counter() - start
        cuda_api.record(after, stream)
        cuda_api.synchronize(after)
        if i >= 3:
            calls.append(spent)
            spans.append(cuda_api.elapsed_ms(before, after) * 1e-3)
    cuda_api.destroy_stream(stream)
    return {"rows": rows, "to_gpu": to_gpu, "call_us": _median_us(calls), "event_to_copy_end_us": _median_us(spans)}


def post_costs(iters: int) -> dict:
    """Host us of a post's event record on the copy stream and the posting stream's wait for it, through ctypes (as
    the C loop makes them)."""
    copy_stream, post_stream = cuda_api.create_stream(), cuda_api.create_stream()
    event = cuda_api.create_event()
    rt = cudart.lib()
    times: dict[str, list[float]] = {"event_record": [], "stream_wait_event": []}
    for _ in range(iters):
        start = time.perf_counter()
        rt.cudaEventRecord(int(event), copy_stream)
        mid = time.perf_counter()
        rt.cudaStreamWaitEvent(post_stream, int(event), 0)
        times["event_record"].append(mid - start)
        times["stream_wait_event"].append(time.perf_counter() - mid)
    torch.cuda.synchronize()
    cuda_api.destroy_event(event)
    for stream in (copy_stream, post_stream):
        cuda_api.destroy_stream(stream)
    return {name: _median_us(samples) for name, samples in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,256,512")
    parser.add_argument("--page-kib", type=int, default=128, help="bytes of one page of one layer (bf16 seed: 128)")
    parser.add_argument("--layers", type=int, default=8, help="layers a host block holds (the host pitch)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    page = args.page_kib << 10
    rows = [int(r) for r in args.rows.split(",")]
    copies = [copy_costs(r, page, args.layers, args.iters, True) for r in rows]
    copies += [copy_costs(r, page, args.layers, args.iters, False) for r in (1, 3, 8)]
    posts = post_costs(args.iters)
    for c in copies:
        print(f"{'H2D' if c['to_gpu'] else 'D2H'} rows {c['rows']:4d}: call {c['call_us']:7.1f} us, event -> copy end "
              f"{c['event_to_copy_end_us']:8.1f} us")
    print("post: " + ", ".join(f"{k} {v:.1f} us" for k, v in posts.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results_header(torch.device("cuda")) | {"page_bytes": page, "layers": args.layers,
                                                              "copies": copies, "posts": posts}, f, indent=1)


if __name__ == "__main__":
    main()
