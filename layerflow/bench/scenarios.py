"""The inference benchmark's scenarios: where each puts the user's KV before a timed request, which tier the request
must then hit, and what it measures beside it.

Every timed iteration replays the same request (same appended items, same candidates) on the same cached history:
before it, outside the timed region, the user's history is truncated back to `seq_len` tokens and its KV is put where
the scenario wants it (GPU, host, SSD, nowhere). The timed region is `engine.score`: request in -> scores on the host,
by the wall clock, with device clock stamps around it. The tier each timed request hit is recorded and checked.
Probes that need not follow one request (the GPU hit's per-layer compute) run after the last timed one, so GPU hits
are timed back to back as a stream of them would run.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from layerflow.bench.clocks import Clock
from layerflow.bench.eager import EagerBlock
from layerflow.bench.marks import TailMarks
from layerflow.bench.phases import PhaseTimer, rows
from layerflow.bench.probes import Timeline, TimelineMarks, TransferTimer, TransferTiming, layer_compute_ms
from layerflow.bench.recording import BenchCopyEngine
from layerflow.bench.stats import Summary
from layerflow.bench.workload import Workload, as_scores, forget
from layerflow.runtime.buffers import Bucket
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import KVManager, Tier
from layerflow.runtime.request import Request

FRESH_USERS = 1 << 40  # ids of the no_cache scenario's one-visit users, far from the workload's


@dataclass
class Probes:
    """Untimed measurements beside the timed requests, one entry per timed iteration."""

    layer_compute: list[list[float]] = field(default_factory=list)
    transfers: list[TransferTiming] = field(default_factory=list)
    bulk_ms: list[float] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list)


@dataclass
class Measured:
    """One scenario at one length: timings, the tiers the timed requests hit, the probes, and the largest score
    difference from the GPU hit of the same request (0 means bitwise equal)."""

    scenario: str
    seq_len: int
    wall: Summary
    device: Summary | None
    tiers: dict[str, int]
    probes: Probes
    max_abs_diff: float
    reference_scale: float  # the largest |score| of the GPU hit: what max_abs_diff compares with
    phases: dict[str, Summary] | None = None   # host ms per phase row (`--profile`), None without

    def timeline(self) -> dict[str, float] | None:
        """Medians of the layerwise requests' timelines (`--timeline`), None without them."""
        rows = self.probes.timelines
        if not rows:
            return None
        medians = {name: Summary.of([getattr(t, name) for t in rows]).median
                   for name in ("issue_ms", "transfer_ms", "tail_ms")}
        parts = [t.breakdown() for t in rows]
        common = [name for name in parts[0] if all(name in p for p in parts)]
        return medians | {name: Summary.of([p[name] for p in parts]).median for name in common}

    def to_dict(self) -> dict:
        out = {"scenario": self.scenario, "seq_len": self.seq_len, "wall_ms": self.wall.to_dict(),
               "device_ms": None if self.device is None else self.device.to_dict(), "tiers": self.tiers,
               "max_abs_diff_vs_gpu_hit": self.max_abs_diff, "max_abs_score_gpu_hit": self.reference_scale}
        if self.phases is not None:
            out["phases_ms"] = {name: summary.to_dict() for name, summary in self.phases.items()}
        if self.probes.timelines:
            out["timeline_ms"] = self.timeline() | {
                "layers": [Summary.of(col).median for col in zip(*(t.layer_ms for t in self.probes.timelines))],
                "release_lags": [Summary.of(col).median
                                 for col in zip(*(t.release_lags() for t in self.probes.timelines))]}
        return out


@dataclass
class Context:
    """What a scenario needs at one length: the engine (its copy engine wrapped), the clocks, the workload, how many
    iterations to run, the batch's graph bucket and the GPU hit's scores of the same batch."""

    engine: Engine
    copy: BenchCopyEngine
    clock: Clock
    timer: TransferTimer
    workload: Workload
    bucket: Bucket
    warmup_iters: int
    timed_iters: int
    timeline: bool
    progress: tqdm
    reference_scores: list[torch.Tensor]
    phases: PhaseTimer | None = None   # attached to `engine` (`--profile`)
    tail: TailMarks | None = None      # installed on `engine` (`--timeline` on a layerwise engine)

    @property
    def reference_scale(self) -> float:
        return float(torch.cat(self.reference_scores).abs().max())


class Scenario(ABC):
    """How the user's KV is placed before each timed request, and which tier the request must then hit."""

    name: str
    label: str
    tier: Tier
    layerwise: bool | None = None  # the engine it needs; None: either
    bounded = False                # the layerwise pipeline figure the lower bound is computed for

    def stage(self, ctx: Context, iteration: int) -> list[Request]:
        """Untimed: restore the constant history, place it, return the batch to time."""
        kv = ctx.engine.kv
        for r in ctx.workload.requests:
            kv.truncate(r.user_id, ctx.workload.seq_len)
            self.place(kv, r.user_id, ctx.workload.seq_len)
        return ctx.workload.requests

    def place(self, kv: KVManager, user: int, seq_len: int) -> None:
        """Put the user's KV (history truncated to `seq_len`) in this scenario's tier; the GPU hit leaves it."""

    def after(self, ctx: Context, probes: Probes) -> None:
        """Untimed, after each timed request: the scenario's probes of that request."""

    def finish(self, ctx: Context, probes: Probes, iterations: int) -> None:
        """Untimed, after the last timed request: probes that need not follow one request, run here so the timed
        requests follow one another as a stream of requests would (staging only between them)."""

    def call(self, ctx: Context, batch: list[Request]) -> Callable[[], list[torch.Tensor]]:
        """What the timed region runs."""
        return lambda: as_scores(ctx.engine.score(batch))

    def measure(self, ctx: Context) -> Measured:
        engine = ctx.engine
        walls, devices, tiers, probes, first, phases = [], [], {}, Probes(), None, []
        for i in range(ctx.warmup_iters + ctx.timed_iters):
            batch = self.stage(ctx, i)
            hit = [engine.kv.tier(r.user_id) for r in batch]
            if any(t is not self.tier for t in hit):
                raise RuntimeError(f"{self.name}: expected every request to hit {self.tier.value}, got "
                                   f"{[t.value for t in hit]}")
            ctx.copy.forget()
            if ctx.phases is not None:
                ctx.phases.start()
            wall, device, scores = ctx.clock.time(self.call(ctx, batch))
            timed = i >= ctx.warmup_iters
            if ctx.phases is not None:
                phase_ms = ctx.phases.stop()
                if timed:
                    phases.append(rows(phase_ms, wall))
            if timed:
                walls.append(wall)
                if device is not None:
                    devices.append(device)
                for t in hit:
                    tiers[t.value] = tiers.get(t.value, 0) + 1
                first = first or scores
            self.after(ctx, probes if timed else Probes())  # warm-up probes are run (warming them) and dropped
            ctx.progress.update()
        self.finish(ctx, probes, ctx.timed_iters)
        diff = max(float((a - b).abs().max()) for a, b in zip(first, ctx.reference_scores))
        return Measured(self.name, ctx.workload.seq_len, Summary.of(walls), Summary.of(devices) if devices else None,
                        tiers, probes, diff, ctx.reference_scale,
                        {name: Summary.of([p[name] for p in phases]) for name in phases[0]} if phases else None)


class GpuHit(Scenario):
    name, label, tier = "gpu_hit", "GPU hit", Tier.GPU

    def finish(self, ctx: Context, probes: Probes, iterations: int) -> None:
        """Per-layer compute of the same batch (the bound's t_last_layer_compute), once per timed request."""
        for _ in range(iterations):
            ctx.engine.kv.wait_offloads()
            for r in ctx.workload.requests:
                ctx.engine.kv.truncate(r.user_id, ctx.workload.seq_len)
            probes.layer_compute.append(layer_compute_ms(ctx.engine, ctx.clock, ctx.workload.requests, ctx.bucket))


class CpuHit(Scenario):
    name, label, tier, layerwise = "cpu_hit", "CPU hit", Tier.HOST, False

    def place(self, kv: KVManager, user: int, seq_len: int) -> None:
        kv.evict_from_gpu(user)


class CpuHitLayerwise(CpuHit):
    name, label, layerwise, bounded = "cpu_hit_layerwise", "CPU hit + layerwise", True, True

    def call(self, ctx: Context, batch: list[Request]) -> Callable[[], list[torch.Tensor]]:
        if not ctx.timeline:
            return super().call(ctx, batch)
        self.marks = TimelineMarks(ctx.tail)
        return self.marks.wrap(super().call(ctx, batch))

    def after(self, ctx: Context, probes: Probes) -> None:
        """The request's timeline (`--timeline`); the same pages onboarded again alone, then a bulk pinned copy of
        the same bytes."""
        if ctx.timeline:   # the timed engine's own transfer (a copy thread in front of it returns another object)
            probes.timelines.append(self.marks.read(ctx.tail.copy_engine.last_onboard))
        onboardings = list(ctx.copy.onboardings)
        ctx.engine.kv.wait_offloads()
        timing = ctx.timer.onboarding(onboardings)
        probes.transfers.append(timing)
        probes.bulk_ms.append(ctx.timer.bulk_ms(timing.nbytes))


class SsdHit(Scenario):
    name, label, tier, layerwise = "ssd_hit", "SSD hit", Tier.SSD, False

    def place(self, kv: KVManager, user: int, seq_len: int) -> None:
        kv.evict_from_gpu(user)
        kv.evict_from_host(user)


class SsdHitLayerwise(SsdHit):
    name, label, layerwise = "ssd_hit_layerwise", "SSD hit + layerwise", True


class NoCache(Scenario):
    """Full recompute: a user never seen, whose whole history arrives as appended items (run eagerly)."""

    name, label, tier = "no_cache", "no cache", Tier.NONE

    def stage(self, ctx: Context, iteration: int) -> list[Request]:
        kv, wl = ctx.engine.kv, ctx.workload
        for u in wl.fresh:
            forget(kv, u)
        base = FRESH_USERS + (wl.seq_len * 4096 + iteration) * len(wl.requests)
        batch = [wl.whole(base + b, r) for b, r in enumerate(wl.requests)]
        wl.fresh = [r.user_id for r in batch]
        return batch


class TorchEager(Scenario):
    """The eager PyTorch block on the same shapes and the same cached K/V (already on the device)."""

    name, label, tier = "torch_eager", "eager PyTorch", Tier.GPU

    def measure(self, ctx: Context) -> Measured:
        wl, engine = ctx.workload, ctx.engine
        if engine.weights.config.family != "hstu" or not engine.weights.config.embedding_tables:
            raise ValueError(f"torch_eager is the hstu item-id block only; this model is "
                             f"{engine.weights.config.family} (leave it out of --scenarios)")
        engine.score(wl.requests)  # resident on the GPU, whatever the previous scenario left
        for r in wl.requests:
            engine.kv.truncate(r.user_id, wl.seq_len)
        block = EagerBlock(engine.weights, engine.kv, wl.requests, wl.seq_len)
        walls, devices, first = [], [], None
        for i in range(ctx.warmup_iters + ctx.timed_iters):
            wall, dev, scores = ctx.clock.time(lambda: block.scores().cpu())
            if i >= ctx.warmup_iters:
                walls.append(wall)
                if dev is not None:
                    devices.append(dev)
                first = scores if first is None else first
            ctx.progress.update()
        diff = float((first - torch.cat(ctx.reference_scores)).abs().max())
        return Measured(self.name, wl.seq_len, Summary.of(walls), Summary.of(devices) if devices else None,
                        {"gpu": ctx.timed_iters * len(wl.requests)}, Probes(), diff, ctx.reference_scale)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (NoCache(), GpuHit(), CpuHit(), CpuHitLayerwise(), SsdHit(),
                                                      SsdHitLayerwise(), TorchEager())}
DEFAULT_SCENARIOS = tuple(SCENARIOS)
