"""Where a request's host time goes: per-phase wall time of Engine.score on the seed model (gpu hit, cpu hit +
layerwise), then a cProfile of the slowest path. A development tool: `PYTHONPATH=. python3 tools/profile_score.py`."""

import cProfile
import functools
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.model.batch import JaggedBatch
from layerflow.runtime import buffers, graphs, kv_manager, waits
from layerflow.tier import in_process as tiers
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.tier import gpu_pool
from layerflow.transfer import copy_engine, cuda_copy
from layerflow.transfer.signals import base as signal_base
from layerflow.config import Config

PHASES = defaultdict(list)


def timed(cls, name, label):
    real = getattr(cls, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            PHASES[label].append((time.perf_counter() - start) * 1e3)

    setattr(cls, name, wrapper)


for cls, name in ((kv_manager.KVManager, "prepare"), (buffers.BatchBuffers, "fill"), (graphs.GraphRunner, "replay"),
                  (buffers.BatchBuffers, "fetch"), (kv_manager.KVManager, "commit"), (Engine, "score"),
                  (kv_manager.KVManager, "offload_early"), (JaggedBatch, "from_lists"),
                  (gpu_pool.GpuKVPool, "allocate"), (tiers.InProcessTier, "onboard"),
                  (tiers.InProcessTier, "offload"), (cuda_copy.CudaCopyEngine, "_issue"),
                  (cuda_copy.CudaCopyEngine, "_layer_copier"), (signal_base.LayerSignals, "acquire"),
                  (signal_base.SignalHandle, "complete_layer"), (waits.LayerWait, "bind"),
                  (waits.EventfdNodeWait, "bind"), (waits.EventfdNodeWait, "check")):
    timed(cls, name, f"{cls.__name__}.{name}")
timed(copy_engine, "make_job", "make_job")

history_len = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
signal = sys.argv[2] if len(sys.argv) > 2 else "eventfd"
weights = HSTUWeights.init(PRESETS["hstu-bench"], seed=0)
engine = Engine(weights, Config(cpu_cache_gb=2.5, gpu_cache_gb=2.5, signal=signal),
                token_buckets=(320,), batch_buckets=(1,))
engine.warmup()
engine.score([Request(1, list(range(history_len)), [])])
request = Request(1, list(range(64)), list(range(256)))


def run(host_hit: bool, iters: int, profile: cProfile.Profile | None = None):
    PHASES.clear()
    for _ in range(iters):
        engine.kv.truncate(1, history_len)
        if host_hit:
            engine.kv.evict_from_gpu(1)
        torch.cuda.synchronize()
        if profile:
            profile.enable()
        engine.score([request])
        if profile:
            profile.disable()
    return {k: round(statistics.median(v), 3) for k, v in PHASES.items()}


for host_hit in (False, True):
    run(host_hit, 5)
    print(f"{'cpu hit + layerwise' if host_hit else 'gpu hit'} @ {history_len}, {signal}: median ms per phase",
          run(host_hit, 20))
profile = cProfile.Profile()
run(True, 20, profile)
pstats.Stats(profile).sort_stats("cumulative").print_stats(40)  # every thread (Python 3.12 monitoring)
engine.close()
