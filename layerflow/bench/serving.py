"""Serving mode (`layerflow bench --serve`): the throughput stream's users through the serving layer, at rising rates.

Returning users with Zipf popularity, more of them than the GPU pool holds, arrive open-loop (Poisson) at each
offered rate; the same arrivals go through the AsyncEngine in process and through the HTTP server with a real aiohttp
client, under each scheduler policy (layerflow.serving.async_engine.POLICIES: prefetch across batches off and
guarded), all on one engine. Each visit appends `append_len` items (histories grow during a run and are
truncated back to `history_len` between runs).

Every (policy, copy path) run is repeated in `blocks` blocks, each block running them all in turn (so slow
drift of the machine spreads over every variant). With `copy_paths` every run is repeated per copy path
(layerflow.transfer.cuda_copy.CopyPath), its copy engine timing each transfer's issue on the host
(layerflow.bench.serving_issue). With several `copy_threads` values there is one engine per value (its copies issued
by the scheduler thread or by a copy thread of their own), loaded with the same histories, and each block runs
every engine's runs in turn (odd blocks in reverse order).

Per run: achieved throughput (answered requests over first arrival to last answer), the sustained rate (answers
between the 10th and the 90th percentile answer over the time between them: the run's start and its drain left out),
the ideal server's throughput on the same arrivals and measured costs (layerflow.bench.serving_ideal: no host
costs), p50/p99 latency, tier mix, mean batch, and the copy engine's and the GPU's busy fractions, estimated from
figures measured in the same run: each onboarded byte at the bulk pinned memcpy rate, each batch at the measured
GPU-hit time of its size (no hardware counters are read). The bound is the rate at which either saturates, whichever
is lower: the copy engine at the bulk rate over the mean onboarded bytes per request, the GPU at full batches of GPU
hits. An open loop cannot serve more than it is offered: below the bound even the ideal server's throughput stays
under the offered rate (a run ends with its last arrivals' latency), so a fraction of the bound is a claim about the
server only at offered rates past it, where its queue never empties; below it, compare the throughput with the ideal
server's. Beside it, per run, the cap the hottest user sets: one request of it per batch, so req/s <= batches/s over
its share of the stream. """

from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch

from layerflow.bench.phases import PhaseTimer
from layerflow.bench.probes import CudaTransferTimer, HostTransferTimer
from layerflow.bench.serving_copies import TimelineCopyEngine, idle_attribution
from layerflow.bench.serving_ideal import IdealServer
from layerflow.bench.serving_issue import IssueTimedCopyEngine, summarize_issue
from layerflow.bench.serving_load import TRANSPORTS, Record, in_process, over_http
from layerflow.bench.serving_timeline import EngineIntervals, thread_cpu_s
from layerflow.bench.serving_variants import VARIANTS, scheduler
from layerflow.bench.stats import percentile
from layerflow.bench.throughput import (ThroughputSettings, load_users, pool_config, returning_visits, stream,
                                        stream_engine)
from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.serving.async_engine import POLICIES, AsyncEngine
from layerflow.serving.server import BackgroundServer
from layerflow.tier.layout import KVLayout
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.cuda_copy import CopyPath
from layerflow.transfer.issue_thread import IssueThreadCopyEngine

CALIBRATION_ITERS = 5
THREADS = ("MainThread", "layerflow-scheduler", "layerflow-copy-issue")   # whose CPU time each run reports


@dataclass(frozen=True)
class ServingSettings:
    """The stream (`workload`; its `rate` is unused, its `batch_size` is the most requests per batch), the offered
    rates, the transports, the scheduler's wait for a batch to fill, the scheduler policies compared, whether
    each run also sums the engine's host time per phase (layerflow.bench.phases), the copy paths compared (CopyPath
    names, CUDA only; empty: the engine's own path, untimed), whether each run times every onboarding on the device
    and attributes the copy engine's idle time (`copy_timeline`, CUDA only; layerflow.bench.serving_copies), and how
    many alternated blocks repeat every run; `unloaded`: how many requests of the stream are first served one at a
    time (each sent once the last was answered) for the unloaded latency (0: none); `copy_threads`: the Config
    `copy_thread` values compared, one engine each (the copies issued by the scheduler thread or by a copy thread,
    layerflow.transfer.issue_thread); `variants`: the scheduler behaviours compared on each engine, alternated in every
    block (layerflow.bench.serving_variants.VARIANTS; "library" is the AsyncEngine as it is); `trace`: each run also
    keeps its raw timeline (scheduler steps, onboarding spans, batches, requests) under "trace"."""

    workload: ThroughputSettings
    rates: tuple[float, ...]
    transports: tuple[str, ...] = TRANSPORTS
    max_wait_ms: float = 2.0
    policies: tuple[str, ...] = ("off", "guarded")
    profile: bool = False
    copy_paths: tuple[str, ...] = ()
    copy_timeline: bool = False
    blocks: int = 1
    unloaded: int = 0
    copy_threads: tuple[bool, ...] = (True,)
    variants: tuple[str, ...] = ("library",)
    trace: bool = False

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"rates={self.rates!r}: need at least one rate, each > 0")
        if not self.transports or any(t not in TRANSPORTS for t in self.transports):
            raise ValueError(f"transports={self.transports!r}: expected some of {TRANSPORTS}")
        if not self.policies or any(p not in POLICIES for p in self.policies):
            raise ValueError(f"policies={self.policies!r}: expected some of {POLICIES}")
        paths = [name.lower() for name in CopyPath.__members__]
        if any(p not in paths for p in self.copy_paths):
            raise ValueError(f"copy_paths={self.copy_paths!r}: expected some of {paths}")
        if self.copy_timeline and self.copy_paths:
            raise ValueError(f"copy_timeline with copy_paths={self.copy_paths!r}: one timed copy engine per run")
        if not self.copy_threads or any(not isinstance(c, bool) for c in self.copy_threads) \
                or len(set(self.copy_threads)) != len(self.copy_threads):
            raise ValueError(f"copy_threads={self.copy_threads!r}: expected distinct booleans, at least one")
        if self.copy_paths and True in self.copy_threads:
            raise ValueError(f"copy_paths={self.copy_paths!r} with a copy thread: the issue is timed on the calling "
                             f"thread")
        if not self.variants or any(v not in VARIANTS for v in self.variants) \
                or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants={self.variants!r}: expected distinct names of {tuple(VARIANTS)}")
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 1:
            raise ValueError(f"blocks={self.blocks!r}: must be an integer >= 1")
        if isinstance(self.unloaded, bool) or not isinstance(self.unloaded, int) or self.unloaded < 0:
            raise ValueError(f"unloaded={self.unloaded!r}: must be an integer >= 0")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms={self.max_wait_ms!r}: must be >= 0")
        if self.workload.gpu_users < self.workload.batch_size:
            raise ValueError(f"gpu_users={self.workload.gpu_users} < batch_size={self.workload.batch_size}: the "
                             "bound times a full batch of GPU hits")

    def to_dict(self) -> dict:
        workload = asdict(self.workload) | {"signal": None if self.workload.signal is None
                                            else self.workload.signal.value}
        return {"workload": workload, "rates": list(self.rates), "transports": list(self.transports),
                "max_wait_ms": self.max_wait_ms, "policies": list(self.policies), "profile": self.profile,
                "copy_paths": list(self.copy_paths), "copy_timeline": self.copy_timeline, "blocks": self.blocks,
                "unloaded": self.unloaded, "copy_threads": list(self.copy_threads), "variants": list(self.variants),
                "trace": self.trace}


GPU_DEFAULTS = dict(preset="hstu-bench", history_len=4096, append_len=16, num_candidates=256, gpu_users=16,
                    num_requests=1000, rates=(100.0, 200.0, 400.0, 800.0, 1600.0), max_batch_size=8)
CPU_DEFAULTS = dict(preset="tiny", history_len=128, append_len=4, num_candidates=16, gpu_users=4, num_requests=40,
                    rates=(50.0, 200.0, 800.0), max_batch_size=4)
USERS_PER_GPU_USER = 4   # the default number of users: four times what the GPU pool holds


@dataclass(frozen=True)
class Calibration:
    """Measured in the run: the wall time of a batch of b GPU hits (ms, median) and the bulk memcpy rate."""

    gpu_hit_ms: dict[int, float]
    bulk_bytes_per_s: float
    bulk_bytes: int

    def to_dict(self) -> dict:
        return {"gpu_hit_ms": {str(b): ms for b, ms in self.gpu_hit_ms.items()},
                "bulk_gb_per_s": self.bulk_bytes_per_s / 1e9, "bulk_bytes": self.bulk_bytes}


def calibrate(engine: Engine, settings: ThroughputSettings, visits: dict, device: torch.device) -> Calibration:
    """GPU-hit batch times for every batch size up to the largest, on GPU-resident users (histories truncated back
    after each), and the bulk rate of one host hit's bytes."""
    resident = [u for u in engine.kv.gpu.users() if u in visits]
    gpu_hit_ms = {}
    for size in range(1, settings.batch_size + 1):
        users = resident[-size:]
        samples = []
        for _ in range(CALIBRATION_ITERS + 1):
            start = time.perf_counter()
            engine.score([visits[u] for u in users])
            samples.append((time.perf_counter() - start) * 1e3)
            for u in users:
                engine.kv.truncate(u, settings.history_len)
        gpu_hit_ms[size] = statistics.median(samples[1:])
    layout = engine.layout
    nbytes = layout.pages_for_tokens(settings.history_len) * layout.page_bytes
    timer = CudaTransferTimer(device) if device.type == "cuda" else HostTransferTimer()
    try:
        bulk_ms = statistics.median(timer.bulk_ms(nbytes) for _ in range(CALIBRATION_ITERS))
    finally:
        timer.close()
    return Calibration(gpu_hit_ms, nbytes / (bulk_ms / 1e3), nbytes)


def onboard_bytes(record: Record, layout: KVLayout) -> int:
    if record.tier not in ("host", "ssd"):
        return 0
    return layout.pages_for_tokens(record.cached_tokens) * layout.page_bytes


def hottest_share(arrivals: list[tuple[float, Request]]) -> float:
    """The hottest user's share of a run's requests."""
    return max(Counter(r.user_id for _, r in arrivals).values()) / len(arrivals)


def sustained_rate(records: list[Record]) -> float:
    """Answers per second between the 10th and the 90th percentile answer (0 for fewer than 10 answers)."""
    times = sorted(r.answered_s for r in records if r.error is None)
    if len(times) < 10:
        return 0.0
    lo, hi = len(times) // 10, len(times) * 9 // 10
    return (hi - lo) / (times[hi] - times[lo]) if times[hi] > times[lo] else 0.0


def summarize(records: list[Record], rate: float, transport: str, policy: str, layout: KVLayout,
              calibration: Calibration, hot_share: float = 1.0) -> dict:
    """One run's figures (see the module docstring); `hot_share`: the hottest user's share of the requests."""
    ok = [r for r in records if r.error is None]
    elapsed = max(r.answered_s for r in records) - min(r.arrival_s for r in records)
    onboarded = sum(onboard_bytes(r, layout) for r in ok)
    largest = max(calibration.gpu_hit_ms)
    gpu_s = sum(calibration.gpu_hit_ms[min(r.batch_size, largest)] / r.batch_size for r in ok) / 1e3
    latencies = [r.latency_ms for r in ok]
    batches_per_s = sum(1 / r.batch_size for r in ok) / elapsed if elapsed > 0 else 0.0
    return {"transport": transport, "policy": policy, "prefetch": policy != "off", "offered_rate": rate,
            "num_requests": len(records),
            "answered": len(ok), "throughput": len(ok) / elapsed if elapsed > 0 else 0.0,
            "sustained_rate": sustained_rate(records),
            "p50_ms": percentile(latencies, 50) if ok else None, "p99_ms": percentile(latencies, 99) if ok else None,
            "tiers": dict(Counter(r.tier for r in ok)), "errors": dict(Counter(r.error for r in records if r.error)),
            "mean_batch": len(ok) / sum(1 / r.batch_size for r in ok) if ok else 0.0,
            "onboard_bytes": onboarded, "copy_busy": onboarded / calibration.bulk_bytes_per_s / elapsed,
            "sm_busy": gpu_s / elapsed, "batches_per_s": batches_per_s, "hot_user_share": hot_share,
            "hot_user_cap": batches_per_s / hot_share}


def bound(runs: list[dict], calibration: Calibration, batch_size: int) -> dict:
    """The rate at which the copy engine or the GPU saturates (requests/s), and which one it is (the copy engine's
    rate is None when nothing was onboarded)."""
    answered = sum(r["answered"] for r in runs)
    per_request = sum(r["onboard_bytes"] for r in runs) / answered if answered else 0.0
    copy = calibration.bulk_bytes_per_s / per_request if per_request else None
    full = min(batch_size, max(calibration.gpu_hit_ms))
    gpu = full / (calibration.gpu_hit_ms[full] / 1e3)
    by_copy = copy is not None and copy < gpu
    return {"rate": copy if by_copy else gpu, "limited_by": "copy engine" if by_copy else "GPU",
            "copy_engine_rate": copy, "gpu_rate": gpu, "onboard_bytes_per_request": per_request,
            "full_batch": full}


def serving_config(settings: ServingSettings) -> Config:
    """The stream's pools (the host's with room for every item a run appends) and the scheduler's keys: no deadline,
    a queue that holds the whole stream (an open-loop run past saturation queues, it is not refused); the prefetch
    policy is each run's."""
    workload = settings.workload
    config = pool_config(workload, layerwise=True)
    if workload.config_path is None:
        appended = workload.num_requests * workload.append_len / (workload.num_users * workload.history_len)
        config = replace(config, cpu_cache_gb=config.cpu_cache_gb * (1 + appended))
    return replace(config, serve_max_batch_size=workload.batch_size, serve_max_wait_ms=settings.max_wait_ms,
                   serve_max_queue=workload.num_requests, serve_deadline_ms=0.0)


def _progress(run: dict) -> None:
    p99 = "-" if run["p99_ms"] is None else f"{run['p99_ms']:.2f}"
    path = f", copy path {run['copy_path']}" if "copy_path" in run else ""
    path += ", copy thread" if run.get("copy_thread") else ""
    path += f", {run['variant']}" if "variant" in run else ""
    print(f"policy {run['policy']}{path}, {run['transport']}, {run['offered_rate']:g}/s: "
          f"{run['throughput']:.1f} req/s, p99 {p99} ms, mean batch {run['mean_batch']:.2f}, copy busy "
          f"{run['copy_busy']:.2f}", file=sys.stderr, flush=True)


def unloaded_latency(engine: Engine, requests: list[Request]) -> dict:
    """Each request served alone through an AsyncEngine (policy "off"), sent once the last was answered: the
    latency of a request that finds the server idle (it still waits `serve_max_wait_ms` for company)."""
    with AsyncEngine(engine, policy="off") as serving:
        served = [serving.submit(r).result() for r in requests]
    latencies = [s.latency_ms for s in served]
    return {"requests": len(served), "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
            "tiers": dict(Counter(s.tier.value for s in served))}


def _timed_copies(settings: ServingSettings, device: torch.device) -> CopyEngine | None:
    """The copy engine a run times (`copy_paths`: the issue; `copy_timeline`: the device spans), or None."""
    if settings.copy_paths:
        return IssueTimedCopyEngine(device=device.index or 0)
    return TimelineCopyEngine(device=device.index or 0) if settings.copy_timeline else None


def run_serving(settings: ServingSettings, device: torch.device) -> dict:
    """Every (block, copy thread, policy, copy path, transport, rate) run, on one engine per `copy_threads` value,
    their users loaded first (the same histories); the calibration and the unloaded latency (measured on the first
    engine before the runs) and the bound. Histories are truncated back after each run (the engine is idle then)."""
    workload = settings.workload
    weights = HSTUWeights.init(PRESETS[workload.preset], seed=workload.seed)
    rng = random.Random(workload.seed + 1)
    visits = returning_visits(workload, weights.config.item_vocab_size, rng)
    histories = rng.getstate()
    runs = []
    with contextlib.ExitStack() as stack:
        engines = []
        for copy_thread in settings.copy_threads:
            copies = given = _timed_copies(settings, device)
            if copies is not None and copy_thread:   # the tier uses a given engine as given: wrapped here
                given = IssueThreadCopyEngine(copies, device)
            config = replace(serving_config(settings), copy_thread=copy_thread)
            engine = stack.enter_context(stream_engine(workload, weights, config, device, copy_engine=given))
            rng.setstate(histories)
            load_users(engine, workload, visits, rng)
            timer = PhaseTimer() if settings.profile else None
            if timer is not None:
                timer.attach(engine)
            steps = EngineIntervals(engine) if settings.trace else None
            engines.append((copy_thread, engine, copies, timer, steps))
        first = engines[0][1]
        calibration = calibrate(first, workload, visits, device)
        ideal = IdealServer(calibration.bulk_bytes / calibration.bulk_bytes_per_s * 1e3, dict(calibration.gpu_hit_ms),
                            weights.config.num_layers)
        unloaded = None
        if settings.unloaded:
            users = [u for _, u in stream(replace(workload, num_requests=settings.unloaded))]
            unloaded = unloaded_latency(first, [visits[u] for u in users])
            for u in visits:
                first.kv.truncate(u, workload.history_len)
        # Odd blocks take the engines and the variants in reverse order, so none always runs first in its block.
        for block, (copy_thread, engine, copies, timer, steps), policy, name in (
                (block, e, p, v) for block in range(settings.blocks) for e in (engines[::-1] if block % 2 else engines)
                for p in settings.policies for v in (settings.variants[::-1] if block % 2 else settings.variants)):
            serving = scheduler(name, engine, policy)
            server = BackgroundServer(serving) if "http" in settings.transports else None
            try:
                for path, transport, rate in itertools.product(settings.copy_paths or (None,), settings.transports,
                                                               settings.rates):
                    arrivals = [(t, visits[u]) for t, u in stream(replace(workload, rate=rate))]
                    serving.reset()
                    serving.hot_user = Counter(r.user_id for _, r in arrivals).most_common(1)[0][0]
                    if settings.copy_paths:
                        copies.path = CopyPath[path.upper()]
                        copies.records.clear()
                    elif copies is not None:
                        copies.begin()
                    if timer is not None:
                        timer.start()
                    if steps is not None:
                        steps.reset()
                    cpu = thread_cpu_s(THREADS)
                    t0 = time.perf_counter()   # the requests' clock starts here (within microseconds)
                    records = over_http(server.url, arrivals) if transport == "http" \
                        else in_process(serving, arrivals)
                    cpu = {k: v - cpu.get(k, 0.0) for k, v in thread_cpu_s(THREADS).items()}
                    extra = {"block": block, "copy_thread": copy_thread, "variant": name, "thread_cpu_s": cpu}
                    if timer is not None:
                        extra["engine_phases_ms"] = timer.stop()
                    if settings.copy_paths:
                        extra |= {"copy_path": path, "issue": summarize_issue(copies.records)}
                    elif copies is not None:
                        spans = copies.spans()
                        extra["copy_idle"] = idle_attribution(spans, serving.intervals)
                        if settings.trace:
                            extra["trace"] = {"spans": [asdict(x) for x in spans]}
                    if settings.trace:
                        extra.setdefault("trace", {}).update(
                            t0=t0, intervals=serving.intervals, engine=steps.intervals, batches=serving.batches,
                            requests=[(r.arrival_s, r.answered_s, r.tier, r.batch_size, q.user_id)
                                      for r, (_, q) in zip(records, arrivals)], hot_user=serving.hot_user)
                    runs.append(summarize(records, rate, transport, policy, engine.layout, calibration,
                                          hottest_share(arrivals))
                                | {"ideal_throughput": ideal.serve(replace(workload, rate=rate))["throughput"],
                                   "scheduler": serving.timeline()} | extra)
                    _progress(runs[-1])
                    for u in visits:
                        engine.kv.truncate(u, workload.history_len)
            finally:
                if server is not None:
                    server.close()
                serving.close()
    return {"calibration": calibration, "runs": runs, "bound": bound(runs, calibration, workload.batch_size),
            "unloaded": unloaded}
