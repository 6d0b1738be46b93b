"""What the layerwise timeline's "wake" is made of (session 14, issues 18 and 20): a small captured graph shaped like
the engine's tail (a sleep kernel, the results' device-to-host copy into pinned memory, the done word's
cuStreamWriteValue32) replayed on a stream of its own, the host waiting for it as `BatchBuffers.fetch` does, then an
event recorded as `bench.marks` records "woke".

Per wait (`sync`: torch's Stream.synchronize; `flag`: a poll of the pinned done word; `event`: cudaEventSynchronize
on the event after the graph) and mark (`raw`: the woke event on the stream's raw handle; `lookup`: its stream looked
up through torch.cuda.current_stream() as the timeline's marks do; `offload`: raw, with a device-to-host copy of
`--offload-mib` on a side stream queued behind the graph's end before the wait, as the engine's offload of a batch's
new pages is: does its traffic delay the host's view of the end?), alternated rep by rep, medians in microseconds:
- `dev_wake`: the event after the graph -> the event recorded right after the wait returned (the timeline's "wake");
- `host_wait`: host time in the wait call (the graph's sleep makes the host wait before the GPU ends);
- `host_record`: host time of the second event's record (cuda.bindings; with `+lookup` the stream lookup too).
And once, on an idle stream: `idle_round_trip` (an event recorded and synchronised on the host: submit -> GPU ->
host seen), `idle_record_gap` (two records back to back: device gap against the host's).

    python3 benchmarks/wake_probe.py --reps 200 --out /tmp/wake.json
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

from layerflow.transfer import cuda_api  # noqa: E402
from layerflow.transfer.signals.native_post import NativePoster  # noqa: E402

VARIANTS = (("sync", "raw"), ("sync", "lookup"), ("sync", "offload"), ("flag", "raw"), ("flag", "offload"),
            ("event", "raw"), ("event", "offload"))


class TailGraph:
    """The captured tail (sleep, results copy, done word) on a stream of its own, and the events around it."""

    def __init__(self, sleep_cycles: int, floats: int, offload_bytes: int) -> None:
        self.stream, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        self.raw = self.stream.cuda_stream
        self.offload_src = torch.ones(offload_bytes, dtype=torch.uint8, device="cuda")
        self.offload_dst = torch.zeros(offload_bytes, dtype=torch.uint8, pin_memory=True)
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.bits = self.word.numpy()
        self.src = torch.ones(floats, device="cuda")
        self.dst = torch.zeros(floats, pin_memory=True)
        self.graph = torch.cuda.CUDAGraph()
        writer = NativePoster(self.raw)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(1000)   # warm the kernel outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(self.graph, stream=self.stream):
                torch.cuda._sleep(sleep_cycles)
                self.dst.copy_(self.src, non_blocking=True)
                writer.write(self.raw, self.word.data_ptr(), 1)
        torch.cuda.synchronize()
        self.end, self.woke = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)

    def wait(self, how: str) -> None:
        if how == "sync":
            self.stream.synchronize()
        elif how == "flag":
            bits = self.bits
            while not bits[0]:
                pass
        else:
            cuda_api.synchronize(self.end)

    def rep(self, how: str, mark: str) -> dict[str, float]:
        """One replay waited for by `how`, marked by `mark` (module docstring)."""
        self.bits[0] = 0
        lookup = mark == "lookup"
        with torch.cuda.stream(self.stream):
            self.graph.replay()
            cuda_api.record(self.end, self.raw)
            if mark == "offload":
                cuda_api.stream_wait(self.side.cuda_stream, self.end)
                with torch.cuda.stream(self.side):
                    self.offload_dst.copy_(self.offload_src, non_blocking=True)
            t0 = time.perf_counter()
            self.wait(how)
            t1 = time.perf_counter()
            cuda_api.record(self.woke, torch.cuda.current_stream().cuda_stream if lookup else self.raw)
            t2 = time.perf_counter()
        self.stream.synchronize()
        self.side.synchronize()
        return {"dev_wake": cuda_api.elapsed_ms(self.end, self.woke) * 1e3, "host_wait": (t1 - t0) * 1e6,
                "host_record": (t2 - t1) * 1e6}


def idle(stream: int, reps: int) -> dict[str, float]:
    """An idle stream: record + host synchronise (round trip), and two back-to-back records' device gap."""
    a, b = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)
    trips, gaps, host_gaps = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cuda_api.record(a, stream)
        cuda_api.synchronize(a)
        t1 = time.perf_counter()
        cuda_api.record(b, stream)
        t2 = time.perf_counter()
        cuda_api.synchronize(b)
        trips.append((t1 - t0) * 1e6)
        gaps.append(cuda_api.elapsed_ms(a, b) * 1e3)
        host_gaps.append((t2 - t1) * 1e6)
    return {"idle_round_trip_us": statistics.median(trips), "idle_record_gap_dev_us": statistics.median(gaps),
            "idle_record_gap_host_us": statistics.median(host_gaps)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200, help="replays per wait and mark")
    parser.add_argument("--sleep-cycles", type=int, default=200_000, help="the graph's sleep kernel (~0.1 ms)")
    parser.add_argument("--floats", type=int, default=256, help="results copied to the host (256: 256 scores)")
    parser.add_argument("--offload-mib", type=float, default=2.0, help="the side copy of the `offload` mark (2 MiB: "
                                                                        "64 new tokens' bf16 KV of hstu-bench)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("wake_probe needs a GPU")
    tail = TailGraph(args.sleep_cycles, args.floats, int(args.offload_mib * 2**20))
    samples: dict[str, dict[str, list[float]]] = {}
    variants = list(VARIANTS)
    for _ in range(5):   # warm every variant
        for how, mark in variants:
            tail.rep(how, mark)
    for i in range(args.reps):
        for how, mark in variants[i % len(variants):] + variants[:i % len(variants)]:
            name = f"{how}+{mark}"
            for key, value in tail.rep(how, mark).items():
                samples.setdefault(name, {}).setdefault(key, []).append(value)
    out = {name: {key: statistics.median(values) for key, values in cols.items()} for name, cols in samples.items()}
    out["idle"] = idle(tail.raw, args.reps)
    for name, row in out.items():
        print(f"{name:13s} " + " ".join(f"{k}={v:.1f}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"reps": args.reps, "sleep_cycles": args.sleep_cycles, "us": out}, f, indent=1)


if __name__ == "__main__":
    main()
