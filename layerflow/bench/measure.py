"""The inference benchmark's run: every requested scenario at every history length, on engines built for them, and
the lower bound of each length's layerwise figure from the probes of the same run.

Engines are built once per layerwise setting (scenarios that work on either join the first); each gets its copy
engine wrapped in a `BenchCopyEngine`. Without a GPU the same code runs the CPU path.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from layerflow.bench.clocks import Clock, CudaClock, HostClock
from layerflow.bench.copy_timing import Marks, TimedCudaCopyEngine
from layerflow.bench.marks import TailMarks
from layerflow.bench.phases import PhaseTimer
from layerflow.bench.probes import CudaTransferTimer, HostTransferTimer, TransferTimer
from layerflow.bench.recording import BenchCopyEngine
from layerflow.bench.scenarios import Context, Measured, Scenario
from layerflow.bench.settings import Settings
from layerflow.bench.stats import Bound, Summary
from layerflow.bench.workload import Workload, as_scores
from layerflow.config import CONFIG_ENV, Config, load_config
from layerflow.model import HSTUWeights
from layerflow.runtime.buffers import Bucket
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.tiers import issue_path
from layerflow.tier.layout import KVLayout
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.cuda_copy import CudaCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine


def transfer_config(settings: Settings, ssd_dir: str | None) -> Config:
    """The YAML config if given (its sizes as they are), else the defaults with the environment's fallbacks (e.g.
    LAYERFLOW_COPY_THREAD) and pools sized for the run; the SSD directory (when the config has none) and the signal
    come from the command line. The runner sets `enable_layerwise` per engine."""
    if settings.config_path is not None:
        config = load_config(settings.config_path)
    else:   # a LAYERFLOW_CONFIG file is not read here: only --config names one
        config = load_config(env={k: v for k, v in os.environ.items() if k != CONFIG_ENV})
    if settings.kv_cache_dtype is not None:
        config = replace(config, kv_cache_dtype=settings.kv_cache_dtype)
    layout = KVLayout.for_hstu(settings.model, config.page_size, config.kv_cache_dtype)
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


def device_tools(device: torch.device) -> tuple[Clock, TransferTimer]:
    """The clock and transfer timer of the engine's device."""
    if device.type == "cuda":
        return CudaClock(), CudaTransferTimer(device)
    return HostClock(), HostTransferTimer()


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


def phase_timer(engine: Engine, settings: Settings) -> PhaseTimer | None:
    """A PhaseTimer on `engine` when the settings ask for host phases (`--profile`), else None."""
    if not settings.profile:
        return None
    phases = PhaseTimer()
    phases.attach(engine)
    return phases


def workload_of(settings: Settings, index: int, seq_len: int) -> Workload:
    """The users (ids of their own) and the replayed batch of the `index`-th history length."""
    users = [index * settings.batch_size + b for b in range(settings.batch_size)]
    return Workload.build(users, seq_len, settings.append_len, settings.num_candidates, settings.model, settings.seed)


def _run_engine(settings: Settings, weights: HSTUWeights, config: Config, device: torch.device,
                scenarios: list[Scenario], clock: Clock, timer: TransferTimer, progress: tqdm,
                results: Results) -> None:
    timeline = settings.timeline and config.enable_layerwise
    inner = _copy_engine(device, timeline)
    copy = BenchCopyEngine(issue_path(inner, config, device))   # as the tier issues its own engine
    bucket = Bucket(settings.batch_size, settings.query_tokens)
    with Engine(weights, config, device=device, use_cuda_graph=settings.use_cuda_graph,
                batch_buckets=(bucket.max_batch,), token_buckets=(bucket.max_tokens,), copy_engine=copy) as engine:
        tail = TailMarks(engine, inner) if timeline else None   # before warmup: a graph variant of its own
        engine.warmup()
        phases = phase_timer(engine, settings)
        for index, seq_len in enumerate(settings.seq_lens):
            progress.set_postfix_str(f"{seq_len} tokens, layerwise {'on' if config.enable_layerwise else 'off'}")
            workload = workload_of(settings, index, seq_len)
            copy.skip_offloads = False
            workload.load(engine)
            reference = as_scores(engine.score(workload.requests))
            copy.skip_offloads = settings.only_onboard
            ctx = Context(engine, copy, clock, timer, workload, bucket, settings.warmup_iters, settings.timed_iters,
                          timeline, progress, reference, phases, tail)
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
