"""What latency an ideal server would have on the serving benchmark's stream: a discrete-event simulation that says
whether a p99 criterion is reachable at all at a given fraction of the bound, before blaming the runtime for missing
it.

The ideal server keeps every rule the real one must keep and has none of its host costs:
- the stream is the benchmark's (Poisson arrivals at `rate`, Zipf popularity over `num_users`, `layerflow.bench.
  throughput.stream`);
- a batch holds at most `batch_size` requests of distinct users, each its user's oldest queued one, oldest first
  (`take_batch`), and is formed the instant the scheduler may form one: when the copy engine has finished the batch
  before (so copies never idle while requests wait) and the batch two back has computed (one batch computes while
  the next onboards: the GPU pool holds two batches), or at the next arrival when nothing is queued (no fill wait);
- a user is GPU-resident when it is among the `gpu_users` used last (LRU over batch formations); every other user is
  a host hit whose whole KV crosses the copy engine in `copy_ms` (bulk rate, one copy at a time, batch after batch);
- a batch of b computes in `gpu_hit_ms[b]`, layer by layer behind its copies: it ends `gpu_hit_ms[b] / num_layers`
  after its last copy at the earliest, and `gpu_hit_ms[b]` after the batch before it ended;
- a request is answered when its batch ends (no answer, launch or collect cost, no `serve_max_wait_ms`).

`fifo_copy_queue` is a looser ideal still, a lower bound for any server that onboards in arrival order: one queue in
front of the copy engine, each request answered the instant its own copy ends (a GPU hit: the instant the copies
queued before it end), no batches, no per-user order, no compute (M/G/1, solved by Lindley's recursion).

`python3 -m layerflow.bench.serving_ideal RESULTS.json` runs both on a serving result's measured costs (the bulk
rate, one host hit's bytes and the GPU-hit batch times); docs/serving.md has the figures.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass, replace

from layerflow.bench.stats import percentile
from layerflow.bench.throughput import ThroughputSettings, stream, take_batch


@dataclass(frozen=True)
class IdealServer:
    """The units' costs: a host hit's copy (ms), a batch of b GPU hits' compute (ms by b, every b up to the largest
    batch) and the model's layers."""

    copy_ms: float
    gpu_hit_ms: dict[int, float]
    num_layers: int

    def __post_init__(self) -> None:
        if not self.copy_ms > 0:
            raise ValueError(f"copy_ms={self.copy_ms!r}: must be > 0")
        if not self.gpu_hit_ms or sorted(self.gpu_hit_ms) != list(range(1, max(self.gpu_hit_ms) + 1)) \
                or any(not ms > 0 for ms in self.gpu_hit_ms.values()):
            raise ValueError(f"gpu_hit_ms={self.gpu_hit_ms!r}: need a time > 0 for every batch size 1..n")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers!r}: must be >= 1")

    def serve(self, workload: ThroughputSettings) -> dict:
        """Serve `workload`'s stream (its `rate`, `batch_size`, `gpu_users`); the run's figures."""
        if workload.batch_size > max(self.gpu_hit_ms):
            raise ValueError(f"batch_size={workload.batch_size}: gpu_hit_ms covers batches up to "
                             f"{max(self.gpu_hit_ms)}")
        arrivals = stream(workload)
        users = [u for _, u in arrivals]
        resident: OrderedDict[int, None] = OrderedDict()
        queue: list[int] = []
        latencies = [0.0] * len(arrivals)
        host_hits = batches = 0
        copy_free = ended = ended_before = 0.0   # the copy engine free; the last batch's end; the one before it
        nxt = 0
        while nxt < len(arrivals) or queue:
            start = max(copy_free, ended_before)
            if not queue:
                start = max(start, arrivals[nxt][0])
            while nxt < len(arrivals) and arrivals[nxt][0] <= start:
                queue.append(nxt)
                nxt += 1
            batch = take_batch(queue, users, workload.batch_size)
            taken = set(batch)
            queue = [q for q in queue if q not in taken]
            hosts = sum(users[q] not in resident for q in batch)
            for q in batch:
                resident.pop(users[q], None)
                resident[users[q]] = None
            while len(resident) > workload.gpu_users:
                resident.popitem(last=False)
            copy_free = start + hosts * self.copy_ms / 1e3
            compute = self.gpu_hit_ms[len(batch)] / 1e3
            end = max(ended + compute, copy_free + compute / self.num_layers, start + compute)
            ended_before, ended = ended, end
            for q in batch:
                latencies[q] = (end - arrivals[q][0]) * 1e3
            host_hits += hosts
            batches += 1
        span = ended - arrivals[0][0]
        return {"offered_rate": workload.rate, "throughput": len(arrivals) / span, "batches_per_s": batches / span,
                "mean_batch": len(arrivals) / batches, "host_share": host_hits / len(arrivals),
                "p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 99),
                "copy_busy": host_hits * self.copy_ms / 1e3 / span}

    def bound(self, host_share: float) -> float:
        """The copy engine's rate (req/s) at `host_share` host hits a request, as the benchmark's bound counts it."""
        return 1e3 / (host_share * self.copy_ms)

    def unloaded(self, workload: ThroughputSettings) -> dict:
        """The stream at a rate so low that every request finds the server idle."""
        return self.serve(replace(workload, rate=1.0))


def fifo_copy_queue(copy_ms: float, host_share: float, fraction: float, requests: int, seed: int = 0) -> dict:
    """Poisson arrivals at `fraction` of the copy engine's rate, each a host hit (`copy_ms` of copy) with probability
    `host_share`, else free: every request's time from arrival to the end of its own copy (module docstring); with
    the Pollaczek-Khinchine mean wait for comparison."""
    if not 0 < fraction < 1 or not 0 < host_share <= 1 or not copy_ms > 0:
        raise ValueError(f"fraction={fraction!r}, host_share={host_share!r}, copy_ms={copy_ms!r}: need 0 < fraction "
                         f"< 1, 0 < host_share <= 1, copy_ms > 0")
    service = copy_ms / 1e3
    rate = fraction / (host_share * service)
    rng = random.Random(seed)
    wait, times = 0.0, []
    for _ in range(requests):
        own = service if rng.random() < host_share else 0.0
        times.append((wait + own) * 1e3)
        wait = max(0.0, wait + own - rng.expovariate(rate))
    mean_wait = rate * host_share * service ** 2 / (2 * (1 - fraction)) * 1e3
    return {"offered_rate": rate, "p50_ms": statistics.median(times), "p99_ms": percentile(times, 99),
            "mean_wait_ms": statistics.fmean(times) - host_share * copy_ms, "pk_mean_wait_ms": mean_wait}


def main(path: str, fractions: tuple[float, ...] = (0.5, 0.8, 0.9), requests: int = 20000, seeds: int = 3) -> None:
    """Both ideals on the costs measured in the serving results file `path` (its first run's workload)."""
    found = json.loads(open(path).read())
    cal, w = found["calibration"], found["settings"]["workload"]
    server = IdealServer(cal["bulk_bytes"] / (cal["bulk_gb_per_s"] * 1e9) * 1e3,
                         {int(b): ms for b, ms in cal["gpu_hit_ms"].items()}, 8)
    workload = ThroughputSettings(preset=w["preset"], history_len=w["history_len"], append_len=w["append_len"],
                                  num_candidates=w["num_candidates"], num_users=w["num_users"],
                                  gpu_users=w["gpu_users"], num_requests=requests, rate=w["rate"], zipf=w["zipf"],
                                  batch_size=w["batch_size"])
    unloaded = server.unloaded(replace(workload, num_requests=2000))
    print(f"copy {server.copy_ms:.2f} ms a host hit; ideal unloaded p50 {unloaded['p50_ms']:.2f} ms")
    print("| fraction | seed | ideal req/s | of bound | p50 | p99 | mean batch | batches/s | FIFO p50 | FIFO p99 |")
    for seed in range(seeds):
        share = server.serve(replace(workload, seed=seed))["host_share"]
        for fraction in fractions:
            run = server.serve(replace(workload, seed=seed, rate=fraction * server.bound(share)))
            fifo = fifo_copy_queue(server.copy_ms, run["host_share"], fraction, 10 * requests, seed)
            print(f"| {fraction:g} | {seed} | {run['throughput']:.0f} | "
                  f"{run['throughput'] / server.bound(run['host_share']):.3f} | {run['p50_ms']:.1f} | "
                  f"{run['p99_ms']:.0f} | {run['mean_batch']:.2f} | {run['batches_per_s']:.0f} | "
                  f"{fifo['p50_ms']:.1f} | {fifo['p99_ms']:.0f} |")
    over = server.serve(replace(workload, rate=2 * server.bound(share)))
    print(f"overloaded (2x the bound): {over['throughput'] / server.bound(over['host_share']):.3f} of the bound, "
          f"mean batch {over['mean_batch']:.2f}, {over['batches_per_s']:.0f} batches/s")


if __name__ == "__main__":
    main(sys.argv[1])
