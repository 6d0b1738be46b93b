"""The engine's host paths on the H200: the early release of the onboarding (the default) and the collect's native
spin give the scores of a GPU hit bit for bit (host hit, graph and eager, every signal kind), as does the release
after the block. A failed onboarding on them: test_engine_gpu.py's failing-transfer test."""

import pytest
import torch

from layerflow.bench.paths import ReleaseAfterBlock
from layerflow.config import Config, SignalMode
from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request

pytestmark = pytest.mark.gpu

MODEL = HSTUConfig(num_layers=4, num_heads=2, dqk=128, dv=128, embedding_dim=256, max_seq_len=4096,
                   dtype=torch.bfloat16, item_vocab_size=5000, position_table_size=4096)
HISTORY = {1: 2000, 2: 333}


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(MODEL, seed=3)


def engine_for(weights, signal=SignalMode.WAITVALUE, graph=True, fetch="sync", release="early") -> Engine:
    config = Config(cpu_cache_gb=1.0, gpu_cache_gb=0.5, page_size=32, signal=signal, transfer_timeout_s=5.0)
    engine = Engine(weights, config, use_cuda_graph=graph, token_buckets=(128,), batch_buckets=(2,), fetch=fetch)
    if release == "after":
        engine.paths.close()
        engine.paths = ReleaseAfterBlock(engine.kv, engine.device, config.transfer_timeout_s, fetch)
    engine.warmup()
    return engine


def serve(weights, tier, **kw) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    with engine_for(weights, **kw) as engine:
        assert engine.paths.fetch == kw.get("fetch", "sync")
        engine.score([Request(u, torch.randint(0, 5000, (n,), generator=gen).tolist(), []) for u, n in HISTORY.items()])
        if tier is Tier.HOST:
            for u in HISTORY:
                engine.kv.evict_from_gpu(u)
        visit = [Request(u, torch.randint(0, 5000, (5,), generator=gen).tolist(),
                         torch.randint(0, 5000, (40,), generator=gen).tolist()) for u in HISTORY]
        return [s.clone() for s in engine.score(visit)]


@pytest.fixture(scope="module")
def gpu_hit(weights):
    return serve(weights, Tier.GPU)


@pytest.mark.parametrize("fetch,release,signal,graph", [
    ("sync", "early", SignalMode.WAITVALUE, True), ("spin", "early", SignalMode.WAITVALUE, True),
    ("sync", "after", SignalMode.WAITVALUE, True), ("spin", "early", SignalMode.EVENTFD, True),
    ("spin", "early", SignalMode.EVENT, True), ("spin", "early", SignalMode.WAITVALUE, False)])
def test_host_hit_on_the_host_paths_equals_the_gpu_hit_bitwise(weights, gpu_hit, fetch, release, signal, graph):
    got = serve(weights, Tier.HOST, signal=signal, graph=graph, fetch=fetch, release=release)
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))


def test_gpu_hit_with_the_spin_fetch_equals_the_sync_fetch(weights, gpu_hit):
    got = serve(weights, Tier.GPU, fetch="spin")
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))
