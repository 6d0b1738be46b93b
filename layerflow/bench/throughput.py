"""Throughput mode: returning users with Zipf popularity, more of them than the GPU pool holds, arriving open-loop.

Arrivals are a Poisson process at `rate` requests/s fixed before the run (open loop: a slow server does not slow the
arrivals, its queue grows). One server loop takes the oldest waiting requests (up to `batch_size` distinct users) as a
batch; a request's latency runs from its arrival to its scores on the host, queueing included. Each user's history is
truncated back to `history_len` after its visit (inside the loop, so it is paid for), which keeps the shapes constant.
The same stream is served with layerwise onboarding off and on.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from layerflow.bench.environment import device_name, results_header
from layerflow.bench.settings import check_settings
from layerflow.bench.stats import percentile
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.config import SignalMode, Config, load_config
from layerflow.tier.layout import KVLayout
from layerflow.transfer.copy_engine import CopyEngine


@dataclass(frozen=True)
class ThroughputSettings:
    preset: str
    history_len: int
    append_len: int
    num_candidates: int
    num_users: int
    gpu_users: int
    num_requests: int
    rate: float
    zipf: float
    batch_size: int
    use_cuda_graph: bool = True
    signal: SignalMode | None = None
    config_path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_settings(self, ("history_len", "append_len", "num_candidates", "num_users", "gpu_users",
                              "num_requests", "batch_size"))
        if not self.rate > 0 or not self.zipf >= 0:
            raise ValueError(f"rate={self.rate!r}, zipf={self.zipf!r}: need rate > 0 and zipf >= 0")
        if self.gpu_users >= self.num_users:
            raise ValueError(f"gpu_users={self.gpu_users} >= num_users={self.num_users}: the stream must not fit "
                             "in the GPU pool")

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return tuple(sorted({min(2 ** i, self.batch_size) for i in range(self.batch_size.bit_length() + 1)}))

    def query_tokens(self, batch: int) -> int:
        return -(-batch * (self.append_len + self.num_candidates) // 64) * 64


GPU_DEFAULTS = dict(preset="hstu-bench", history_len=4096, append_len=64, num_candidates=256, num_users=64, gpu_users=16,
                    num_requests=1000, rate=150.0)
CPU_DEFAULTS = dict(preset="tiny", history_len=128, append_len=8, num_candidates=16, num_users=16, gpu_users=4,
                    num_requests=60, rate=40.0)


def stream(settings: ThroughputSettings) -> list[tuple[float, int]]:
    """(arrival time s, user) of every request: Poisson arrivals, Zipf(s) popularity over the users."""
    rng = random.Random(settings.seed)
    weights = [1.0 / (k + 1) ** settings.zipf for k in range(settings.num_users)]
    users = rng.choices(range(settings.num_users), weights=weights, k=settings.num_requests)
    t, out = 0.0, []
    for u in users:
        t += rng.expovariate(settings.rate)
        out.append((t, u))
    return out


def take_batch(queue: list[int], users: list[int], batch_size: int) -> list[int]:
    """The oldest queued requests of distinct users, at most `batch_size` (the others stay queued)."""
    picked, seen = [], set()
    for q in queue:
        if users[q] not in seen:
            picked.append(q)
            seen.add(users[q])
            if len(picked) == batch_size:
                break
    return picked


def pool_config(settings: ThroughputSettings, layerwise: bool) -> Config:
    """The run's config: the file's if one is named, else pools sized for the stream (the GPU's for `gpu_users`
    users, the host's for all of them); `signal` and `layerwise` on top."""
    config = load_config(settings.config_path) if settings.config_path else Config()
    layout = KVLayout.for_hstu(PRESETS[settings.preset], config.page_size)
    user_gb = layout.pages_for_tokens(settings.history_len + settings.append_len) * layout.page_bytes / 2**30
    if settings.config_path is None:
        config = replace(config, gpu_cache_gb=settings.gpu_users * user_gb,
                         cpu_cache_gb=(settings.num_users + settings.batch_size) * user_gb * 1.1)
    if settings.signal is not None:
        config = replace(config, signal=settings.signal)
    return replace(config, enable_layerwise=layerwise)


def returning_visits(settings: ThroughputSettings, vocab: int, rng: random.Random) -> dict[int, Request]:
    """The request each user sends on every visit of the stream."""
    return {u: Request(u, [rng.randrange(vocab) for _ in range(settings.append_len)],
                       [rng.randrange(vocab) for _ in range(settings.num_candidates)])
            for u in range(settings.num_users)}


def stream_engine(settings: ThroughputSettings, weights: HSTUWeights, config: Config, device: torch.device,
                  copy_engine: CopyEngine | None = None) -> Engine:
    """An engine whose graph buckets are the stream's batch sizes and their query tokens (`copy_engine`: see
    Engine)."""
    tokens = tuple(sorted({settings.query_tokens(b) for b in settings.batch_buckets}))
    return Engine(weights, config, device=device, use_cuda_graph=settings.use_cuda_graph,
                  batch_buckets=settings.batch_buckets, token_buckets=tokens, copy_engine=copy_engine)


def load_users(engine: Engine, settings: ThroughputSettings, visits: dict[int, Request], rng: random.Random) -> None:
    """Capture the graphs, cache `history_len` tokens per user (offloaded to host), then one visit each so every graph
    and kernel is compiled before the clock; every history is truncated back to `history_len`."""
    vocab = engine.weights.config.item_vocab_size
    engine.warmup()
    for u in range(settings.num_users):
        engine.score([Request(u, [rng.randrange(vocab) for _ in range(settings.history_len)], [])])
    engine.kv.wait_offloads()
    for u in range(settings.num_users):
        engine.score([visits[u]])
        engine.kv.truncate(u, settings.history_len)


def serve(settings: ThroughputSettings, weights: HSTUWeights, layerwise: bool, device: torch.device) -> dict:
    """Serve the stream once; return throughput, latency percentiles, the tiers hit and the batch sizes."""
    rng = random.Random(settings.seed + 1)
    visits = returning_visits(settings, weights.config.item_vocab_size, rng)
    arrivals = stream(settings)
    users = [u for _, u in arrivals]
    with stream_engine(settings, weights, pool_config(settings, layerwise), device) as engine:
        load_users(engine, settings, visits, rng)
        queue: list[int] = []
        latencies, tiers, sizes = [0.0] * len(arrivals), Counter(), []
        nxt, served = 0, 0
        with tqdm(total=len(arrivals), desc=f"throughput, layerwise {'on' if layerwise else 'off'}",
                  file=sys.stderr, mininterval=1.0) as progress:
            start = time.perf_counter()
            while served < len(arrivals):
                now = time.perf_counter() - start
                while nxt < len(arrivals) and arrivals[nxt][0] <= now:
                    queue.append(nxt)
                    nxt += 1
                if not queue:
                    time.sleep(max(0.0, arrivals[nxt][0] - now))
                    continue
                picked = take_batch(queue, users, settings.batch_size)
                tiers.update(engine.kv.tier(users[q]).value for q in picked)
                engine.score([visits[users[q]] for q in picked])
                done = time.perf_counter() - start
                for q in picked:
                    latencies[q] = (done - arrivals[q][0]) * 1e3
                    engine.kv.truncate(users[q], settings.history_len)
                queue = [q for q in queue if q not in picked]
                sizes.append(len(picked))
                served += len(picked)
                progress.update(len(picked))
            elapsed = time.perf_counter() - start - arrivals[0][0]
    return {"layerwise": layerwise, "offered_rate": settings.rate, "throughput": len(arrivals) / elapsed,
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
            "mean_ms": sum(latencies) / len(latencies), "tiers": dict(tiers),
            "mean_batch": sum(sizes) / len(sizes), "num_requests": len(arrivals)}


def markdown(settings: ThroughputSettings, runs: list[dict], where: str) -> str:
    head = (f"### Throughput on {where}: {settings.preset} model, {settings.num_users} users (Zipf {settings.zipf}), "
            f"GPU pool for {settings.gpu_users}, {settings.history_len} cached + {settings.append_len} appended, "
            f"{settings.num_candidates} candidates, batches up to {settings.batch_size}, Poisson arrivals at "
            f"{settings.rate:g}/s")
    rows = ["| layerwise | req/s | p50 ms | p99 ms | GPU hits | host hits | mean batch |", "|---" * 7 + "|"]
    for r in runs:
        rows.append(f"| {'on' if r['layerwise'] else 'off'} | {r['throughput']:.1f} | {r['p50_ms']:.2f} | "
                    f"{r['p99_ms']:.2f} | {r['tiers'].get('gpu', 0)} | {r['tiers'].get('host', 0)} | "
                    f"{r['mean_batch']:.2f} |")
    return "\n".join([head, "", *rows])


def run_throughput(settings: ThroughputSettings, device: torch.device) -> list[dict]:
    weights = HSTUWeights.init(PRESETS[settings.preset], seed=settings.seed)
    return [serve(settings, weights, layerwise, device) for layerwise in (False, True)]


def to_dict(settings: ThroughputSettings, runs: list[dict], device: torch.device) -> dict:
    """The results JSON of one throughput run: command line, environment, settings, both runs and the table."""
    return {**results_header(device),
            "settings": asdict(settings) | {"signal": None if settings.signal is None else settings.signal.value},
            "runs": runs, "table": markdown(settings, runs, device_name(device))}


def write_json(settings: ThroughputSettings, runs: list[dict], device: torch.device, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(settings, runs, device), indent=1) + "\n")
