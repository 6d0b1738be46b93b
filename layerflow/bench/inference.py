"""The inference benchmark: one returning-user request timed per scenario and history length.

Every timed iteration replays the same request (same appended items, same candidates) on the same cached history:
before it, outside the timed region, the user's history is truncated back to `seq_len` tokens and its KV is put where
the scenario wants it (GPU, host, SSD, nowhere). The timed region is `engine.score`: request in -> scores on the host,
by the wall clock, with CUDA events around it on the GPU. The tier each timed request hit is recorded and checked.

Beside the layerwise figure: the onboarding of the very same pages measured alone (per layer), the per-layer compute
of the GPU hit, the lower bound they give, and a bulk pinned memcpy of the same bytes, all in the same run.
Without a GPU the same code runs a tiny model on the CPU path and says so.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
from abc import ABC
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS, HSTUConfig
from layerflow.bench.eager import EagerBlock
from layerflow.bench.copy_timing import Marks, TimedCudaCopyEngine
from layerflow.bench.probes import (Clock, Timeline, TimelineMarks, TransferTimer, TransferTiming, device_tools,
                                    layer_compute_ms)
from layerflow.bench.recording import BenchCopyEngine
from layerflow.bench.stats import Bound, Summary
from layerflow.runtime.buffers import Bucket
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import KVManager, Tier
from layerflow.runtime.request import Request
from layerflow.config import SignalMode, Config, load_config
from layerflow.tier.layout import KVLayout
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.cuda_copy import CudaCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine

FRESH_USERS = 1 << 40  # ids of the no_cache scenario's one-visit users, far from the workload's


# ---- settings ---------------------------------------------------------------------------------------


def parse_length(text: str) -> int:
    """'2K' -> 2048, '512' -> 512."""
    word = text.strip().upper()
    scale = 1024 if word.endswith("K") else 1
    digits = word[:-1] if word.endswith("K") else word
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"sequence length {text!r}: expected a positive integer, optionally with a K suffix")
    return int(digits) * scale


def parse_lengths(text: str) -> tuple[int, ...]:
    return tuple(parse_length(t) for t in text.split(",") if t.strip())


def check_settings(settings, positive: tuple[str, ...]) -> None:
    """What every benchmark mode's settings need: a known model preset and the named fields > 0."""
    if settings.preset not in PRESETS:
        raise ValueError(f"preset={settings.preset!r}: expected one of {sorted(PRESETS)}")
    for name in positive:
        if getattr(settings, name) <= 0:
            raise ValueError(f"{name}={getattr(settings, name)!r}: must be positive")


@dataclass(frozen=True)
class Settings:
    """One benchmark run: the model, the request shape, the lengths, the scenarios and the transfer config."""

    preset: str
    seq_lens: tuple[int, ...]
    append_len: int
    num_candidates: int
    batch_size: int
    timed_iters: int
    warmup_iters: int
    scenarios: tuple[str, ...]
    use_cuda_graph: bool = True
    only_onboard: bool = False
    timeline: bool = False
    signal: SignalMode | None = None
    config_path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_settings(self, ("append_len", "num_candidates", "batch_size", "timed_iters"))
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ValueError(f"scenarios={list(self.scenarios)!r}: expected some of {list(SCENARIOS)}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters={self.warmup_iters!r}: must be >= 0")
        if self.timeline and (self.batch_size != 1 or "cpu_hit_layerwise" not in self.scenarios):
            raise ValueError(f"timeline=True: needs batch_size=1 (got {self.batch_size}) and cpu_hit_layerwise")
        if not self.seq_lens or min(self.seq_lens) <= 0:
            raise ValueError(f"seq_lens={self.seq_lens!r}: must be positive lengths")
        longest = max(self.seq_lens) + self.append_len + self.num_candidates
        if longest > self.model.max_seq_len:
            raise ValueError(f"seq_len {max(self.seq_lens)} + append {self.append_len} + candidates "
                             f"{self.num_candidates} = {longest} exceeds the {self.preset} model's max_seq_len "
                             f"{self.model.max_seq_len}")

    @property
    def model(self) -> HSTUConfig:
        return PRESETS[self.preset]

    @property
    def query_tokens(self) -> int:
        """The graph bucket of the benchmark's request: appended + candidates of the whole batch, rounded to 64."""
        return -(-self.batch_size * (self.append_len + self.num_candidates) // 64) * 64

    def scenario_list(self) -> list["Scenario"]:
        """The requested scenarios, plus the GPU hit whenever a layerwise bound needs its T_compute."""
        names = list(self.scenarios)
        if any(SCENARIOS[n].bounded for n in names) and "gpu_hit" not in names:
            names.insert(0, "gpu_hit")
        return [SCENARIOS[n] for n in names]


# Defaults per device: the seed's benchmark on a GPU, a small configuration that ends in seconds on the CPU path.
GPU_DEFAULTS = dict(preset="hstu-bench", seq_lens=(2048, 4096, 8192, 16384), append_len=64, num_candidates=256,
                    timed_iters=20, warmup_iters=5)
CPU_DEFAULTS = dict(preset="tiny", seq_lens=(256, 512), append_len=8, num_candidates=16, timed_iters=5,
                    warmup_iters=2)


def transfer_config(settings: Settings, ssd_dir: str | None) -> Config:
    """The YAML config if given (its sizes as they are), else pools sized for the run; the SSD directory (when the
    config has none) and the signal come from the command line. The runner sets `enable_layerwise` per engine."""
    config = load_config(settings.config_path) if settings.config_path is not None else Config()
    layout = KVLayout.for_hstu(settings.model, config.page_size)
    user_gb = layout.pages_for_tokens(max(settings.seq_lens) + settings.append_len) * layout.page_bytes / 2**30
    room = 4 * settings.batch_size * user_gb + 0.25
    if settings.config_path is None:
        config = replace(config, cpu_cache_gb=room, gpu_cache_gb=room)
    if settings.signal is not None:
        config = replace(config, signal=settings.signal)
    if any(s.tier is Tier.SSD for s in settings.scenario_list()) and config.ssd_cache_gb == 0:
        if ssd_dir is None:
            raise ValueError("ssd_hit needs an SSD directory: set ssd_cache_gb and ssd_cache_dir in --config")
        config = replace(config, ssd_cache_gb=room, ssd_cache_dir=ssd_dir)
    return config


# ---- the workload of one length ---------------------------------------------------------------------


@dataclass
class Workload:
    """`batch_size` users with `seq_len` cached tokens each, and the one batch replayed every iteration."""

    seq_len: int
    histories: dict[int, list[int]]
    requests: list[Request]
    fresh: list[int] = field(default_factory=list)  # no_cache users of the previous iteration

    @classmethod
    def build(cls, settings: Settings, seq_len: int, index: int) -> "Workload":
        rng = random.Random(settings.seed * 7919 + seq_len)
        vocab = settings.model.item_vocab_size
        users = [index * settings.batch_size + b for b in range(settings.batch_size)]
        histories = {u: [rng.randrange(vocab) for _ in range(seq_len)] for u in users}
        requests = [Request(u, [rng.randrange(vocab) for _ in range(settings.append_len)],
                            [rng.randrange(vocab) for _ in range(settings.num_candidates)]) for u in users]
        return cls(seq_len, histories, requests)

    def load(self, engine: Engine) -> None:
        """First visit: the histories are computed once and offloaded to host."""
        engine.score([Request(u, h, []) for u, h in self.histories.items()])
        engine.kv.wait_offloads()

    def drop(self, engine: Engine) -> None:
        """Free this length's users from GPU and host so the next length has the pools to itself."""
        for u in list(self.histories) + self.fresh:
            forget(engine.kv, u)
        self.fresh = []


def forget(kv: KVManager, user: int) -> None:
    kv.wait_offloads()
    kv.drop(user)


# ---- scenarios --------------------------------------------------------------------------------------


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

    def timeline(self) -> dict[str, float] | None:
        """Medians of the layerwise requests' timelines (`--timeline`), None without them."""
        rows = self.probes.timelines
        if not rows:
            return None
        return {name: Summary.of([getattr(t, name) for t in rows]).median
                for name in ("issue_ms", "transfer_ms", "tail_ms")}

    def to_dict(self) -> dict:
        out = {"scenario": self.scenario, "seq_len": self.seq_len, "wall_ms": self.wall.to_dict(),
               "device_ms": None if self.device is None else self.device.to_dict(), "tiers": self.tiers,
               "max_abs_diff_vs_gpu_hit": self.max_abs_diff, "max_abs_score_gpu_hit": self.reference_scale}
        if self.probes.timelines:
            out["timeline_ms"] = self.timeline() | {
                "layers": [Summary.of(col).median for col in zip(*(t.layer_ms for t in self.probes.timelines))]}
        return out


@dataclass
class Context:
    """What a scenario needs at one length."""

    settings: Settings
    engine: Engine
    copy: BenchCopyEngine
    clock: Clock
    timer: TransferTimer
    workload: Workload
    progress: tqdm
    reference_scores: list[torch.Tensor]

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
        """Untimed, after each timed request: the scenario's probes."""

    def call(self, ctx: Context, batch: list[Request]) -> Callable[[], list[torch.Tensor]]:
        """What the timed region runs."""
        return lambda: ctx.engine.score(batch)

    def measure(self, ctx: Context) -> Measured:
        settings, engine = ctx.settings, ctx.engine
        walls, devices, tiers, probes, first = [], [], {}, Probes(), None
        for i in range(settings.warmup_iters + settings.timed_iters):
            batch = self.stage(ctx, i)
            hit = [engine.kv.tier(r.user_id) for r in batch]
            if any(t is not self.tier for t in hit):
                raise RuntimeError(f"{self.name}: expected every request to hit {self.tier.value}, got "
                                   f"{[t.value for t in hit]}")
            ctx.copy.forget()
            wall, device, scores = ctx.clock.time(self.call(ctx, batch))
            timed = i >= settings.warmup_iters
            if timed:
                walls.append(wall)
                if device is not None:
                    devices.append(device)
                for t in hit:
                    tiers[t.value] = tiers.get(t.value, 0) + 1
                first = first or scores
            self.after(ctx, probes if timed else Probes())  # warm-up probes are run (warming them) and dropped
            ctx.progress.update()
        diff = max(float((a - b).abs().max()) for a, b in zip(first, ctx.reference_scores))
        return Measured(self.name, ctx.workload.seq_len, Summary.of(walls), Summary.of(devices) if devices else None,
                        tiers, probes, diff, ctx.reference_scale)


class GpuHit(Scenario):
    name, label, tier = "gpu_hit", "GPU hit", Tier.GPU

    def after(self, ctx: Context, probes: Probes) -> None:
        """Per-layer compute of the same batch (the bound's t_last_layer_compute)."""
        bucket = Bucket(ctx.settings.batch_size, ctx.settings.query_tokens)
        ctx.engine.kv.wait_offloads()
        for r in ctx.workload.requests:
            ctx.engine.kv.truncate(r.user_id, ctx.workload.seq_len)
        probes.layer_compute.append(layer_compute_ms(ctx.engine, ctx.clock, ctx.workload.requests, bucket))


class CpuHit(Scenario):
    name, label, tier, layerwise = "cpu_hit", "CPU hit", Tier.HOST, False

    def place(self, kv: KVManager, user: int, seq_len: int) -> None:
        kv.evict_from_gpu(user)


class CpuHitLayerwise(CpuHit):
    name, label, layerwise, bounded = "cpu_hit_layerwise", "CPU hit + layerwise", True, True

    def call(self, ctx: Context, batch: list[Request]) -> Callable[[], list[torch.Tensor]]:
        if not ctx.settings.timeline:
            return super().call(ctx, batch)
        self.marks = TimelineMarks()
        return self.marks.wrap(super().call(ctx, batch))

    def after(self, ctx: Context, probes: Probes) -> None:
        """The request's timeline (`--timeline`); the same pages onboarded again alone, then a bulk pinned copy of
        the same bytes."""
        if ctx.settings.timeline:
            probes.timelines.append(self.marks.read(ctx.copy.transfers[-1]))
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
        batch = [Request(base + b, wl.histories[r.user_id] + r.items, r.candidates)
                 for b, r in enumerate(wl.requests)]
        wl.fresh = [r.user_id for r in batch]
        return batch


class TorchEager(Scenario):
    """The eager PyTorch block on the same shapes and the same cached K/V (already on the device)."""

    name, label, tier = "torch_eager", "eager PyTorch", Tier.GPU

    def measure(self, ctx: Context) -> Measured:
        settings, wl, engine = ctx.settings, ctx.workload, ctx.engine
        engine.score(wl.requests)  # resident on the GPU, whatever the previous scenario left
        for r in wl.requests:
            engine.kv.truncate(r.user_id, wl.seq_len)
        block = EagerBlock(engine.weights, engine.kv, wl.requests, wl.seq_len)
        walls, devices, first = [], [], None
        for i in range(settings.warmup_iters + settings.timed_iters):
            wall, dev, scores = ctx.clock.time(lambda: block.scores().cpu())
            if i >= settings.warmup_iters:
                walls.append(wall)
                if dev is not None:
                    devices.append(dev)
                first = scores if first is None else first
            ctx.progress.update()
        diff = float((first - torch.cat(ctx.reference_scores)).abs().max())
        return Measured(self.name, wl.seq_len, Summary.of(walls), Summary.of(devices) if devices else None,
                        {"gpu": settings.timed_iters * len(wl.requests)}, Probes(), diff, ctx.reference_scale)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (NoCache(), GpuHit(), CpuHit(), CpuHitLayerwise(), SsdHit(),
                                                      SsdHitLayerwise(), TorchEager())}
DEFAULT_SCENARIOS = tuple(SCENARIOS)


# ---- the run ----------------------------------------------------------------------------------------


def bound_of(gpu: Measured, layerwise: Measured) -> Bound:
    """Medians of every figure of one length, per layer for the per-layer times."""
    def per_layer(rows: list) -> tuple[float, ...]:
        return tuple(Summary.of(col).median for col in zip(*rows))

    transfers = layerwise.probes.transfers
    return Bound(measured=layerwise.wall.median,
                 t_transfer=Summary.of([t.total_ms for t in transfers]).median,
                 t_compute=gpu.wall.median,
                 transfer_layers=per_layer([t.layer_ms for t in transfers]),
                 compute_layers=per_layer(gpu.probes.layer_compute),
                 bulk_memcpy=Summary.of(layerwise.probes.bulk_ms).median,
                 transfer_bytes=transfers[0].nbytes)


@dataclass
class Results:
    settings: Settings
    device: torch.device
    transfer_config: Config
    measured: list[Measured] = field(default_factory=list)
    bounds: dict[int, Bound] = field(default_factory=dict)

    def get(self, scenario: str, seq_len: int) -> Measured | None:
        return next((m for m in self.measured if m.scenario == scenario and m.seq_len == seq_len), None)

    @property
    def cpu_path(self) -> bool:
        return self.device.type != "cuda"


def engine_groups(scenarios: list[Scenario]) -> list[tuple[bool, list[Scenario]]]:
    """Scenarios grouped by the layerwise setting of the engine they run on (either-engine ones join the first)."""
    kinds = [k for k in (False, True) if any(s.layerwise is k for s in scenarios)] or [False]
    groups = {k: [s for s in scenarios if s.layerwise is k] for k in kinds}
    groups[kinds[0]] = [s for s in scenarios if s.layerwise is None or s.layerwise is kinds[0]]
    return [(k, groups[k]) for k in kinds]


def run(settings: Settings, device: torch.device | None = None) -> Results:
    """Every requested scenario at every length; engines built once per layerwise setting."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    weights = HSTUWeights.init(settings.model, seed=settings.seed)
    scenarios = settings.scenario_list()
    total = len(settings.seq_lens) * len(scenarios) * (settings.warmup_iters + settings.timed_iters)
    with tempfile.TemporaryDirectory(prefix="layerflow-bench-ssd-") as ssd_dir:
        config = transfer_config(settings, ssd_dir)
        results = Results(settings, device, config)
        clock, timer = device_tools(device)
        try:
            with tqdm(total=total, desc="bench", unit="req", file=sys.stderr, mininterval=1.0) as progress:
                for layerwise, group in engine_groups(scenarios):
                    _run_engine(settings, weights, replace(config, enable_layerwise=layerwise), device, group,
                                clock, timer, progress, results)
        finally:
            timer.close()
    for seq_len in settings.seq_lens:
        gpu = results.get("gpu_hit", seq_len)
        for s in scenarios:
            lw = results.get(s.name, seq_len)
            if s.bounded and gpu is not None and lw is not None:
                results.bounds[seq_len] = bound_of(gpu, lw)
    return results


def _run_engine(settings: Settings, weights: HSTUWeights, config: Config, device: torch.device,
                scenarios: list[Scenario], clock: Clock, timer: TransferTimer, progress: tqdm,
                results: Results) -> None:
    copy = BenchCopyEngine(_copy_engine(device, timeline=settings.timeline and config.enable_layerwise))
    with Engine(weights, config, device=device, use_cuda_graph=settings.use_cuda_graph,
                batch_buckets=(settings.batch_size,), token_buckets=(settings.query_tokens,),
                copy_engine=copy) as engine:
        engine.warmup()
        for index, seq_len in enumerate(settings.seq_lens):
            progress.set_postfix_str(f"{seq_len} tokens, layerwise {'on' if config.enable_layerwise else 'off'}")
            workload = Workload.build(settings, seq_len, index)
            copy.skip_offloads = False
            workload.load(engine)
            reference = engine.score(workload.requests)
            copy.skip_offloads = settings.only_onboard
            ctx = Context(settings, engine, copy, clock, timer, workload, progress, reference)
            for scenario in scenarios:
                results.measured.append(scenario.measure(ctx))
            copy.skip_offloads = False
            workload.drop(engine)


def _copy_engine(device: torch.device, timeline: bool) -> CopyEngine:
    """Timelines read each onboarding's per-layer timing events."""
    if device.type != "cuda":
        return ThreadCopyEngine()
    if timeline:
        return TimedCudaCopyEngine(Marks.LAYERS, device=device.index or 0)
    return CudaCopyEngine(device=device.index or 0)


# ---- command line -----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by `layerflow bench` and benchmarks/inference_benchmark.py).

    Unset flags take the device's defaults: the seed benchmark on a GPU, a small run on the CPU path."""
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model shape (GPU: seed, CPU: tiny)")
    parser.add_argument("--seq-lens", type=parse_lengths, help="cached history lengths, e.g. 2K,4K,8K,16K")
    parser.add_argument("--history-len", type=parse_length, help="one cached history length (same as --seq-lens N)")
    parser.add_argument("--append-len", "--append-history-len", dest="append_len", type=int,
                        help="items appended to the history per request (GPU: 64)")
    parser.add_argument("--num-candidates", type=int, help="candidates scored per request (GPU: 256)")
    parser.add_argument("--batch-size", type=int, default=1, help="users per batch")
    parser.add_argument("--timed-iters", type=int, help="timed iterations per scenario and length (GPU: 20)")
    parser.add_argument("--warmup-iters", type=int, help="untimed iterations before them (GPU: 5)")
    parser.add_argument("--scenarios", type=lambda t: tuple(s.strip() for s in t.split(",") if s.strip()),
                        default=DEFAULT_SCENARIOS, help=f"comma-separated, of {','.join(SCENARIOS)}")
    parser.add_argument("--disable-cudagraph", action="store_true", help="run the per-layer pipeline eagerly")
    parser.add_argument("--config", help="transfer YAML config (default: pools sized for the run)")
    parser.add_argument("--only-onboard", action="store_true",
                        help="skip the offload after each timed request: onboarding + block only")
    parser.add_argument("--timeline", action="store_true",
                        help="GPU only: split each layerwise request into issue / transfer / tail on the device clock")
    parser.add_argument("--signal", choices=[m.value for m in SignalMode], help="per-layer signal (default: config)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    parser.add_argument("--out", help="write every figure as JSON here")
    parser.add_argument("--plot", help="write latency vs seq_len (PNG) here")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--throughput", action="store_true",
                        help="throughput mode: Zipf returning users beyond the GPU pool, open-loop arrivals")
    from layerflow.bench.throughput import add_throughput_arguments
    add_throughput_arguments(parser)


def settings_from_args(args: argparse.Namespace, device: torch.device) -> Settings:
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    seq_lens = args.seq_lens or ((args.history_len,) if args.history_len else defaults["seq_lens"])

    def pick(name: str):
        value = getattr(args, name)
        return defaults[name] if value is None else value

    return Settings(preset=pick("preset"), seq_lens=tuple(seq_lens), append_len=pick("append_len"),
                    num_candidates=pick("num_candidates"), batch_size=args.batch_size,
                    timed_iters=pick("timed_iters"), warmup_iters=pick("warmup_iters"), scenarios=args.scenarios,
                    use_cuda_graph=not args.disable_cudagraph, only_onboard=args.only_onboard,
                    timeline=args.timeline,
                    signal=None if args.signal is None else SignalMode(args.signal), config_path=args.config,
                    seed=args.seed)


CPU_NOTE = ("NOTE: no CUDA GPU: this ran the CPU path (tiny model, short histories, eager torch kernels, a copy "
            "thread instead of the GPU's copy engines). Its figures check the benchmark, not the runtime's speed.")


def main(args: argparse.Namespace) -> None:
    from layerflow.bench import report as bench_report

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    command = " ".join(shlex.quote(a) for a in sys.argv)
    if args.throughput:
        from layerflow.bench.throughput import run_throughput_from_args
        run_throughput_from_args(args, device, command)
        return
    settings = settings_from_args(args, device)
    if settings.timeline and device.type != "cuda":
        raise ValueError("--timeline reads CUDA events: it needs a GPU")
    if device.type != "cuda":
        print(CPU_NOTE, flush=True)
    results = run(settings, device)
    print(bench_report.markdown(results))
    if device.type != "cuda":
        print(CPU_NOTE)
    if args.out:
        bench_report.write_json(results, Path(args.out), command)
    if args.plot:
        bench_report.plot(results, Path(args.plot))
