"""The engine's host paths on the H200: a host hit, its onboarding kept until the next launch, gives the
GPU hit's scores bit for bit (graph and eager, every signal kind), with the bucket buffers' cudart fill copy on a
stream handle of theirs. Every host pin goes back: an onboarding's by its release, an offload's when it is reaped.
A failed onboarding on them: test_engine_gpu.py's failing-transfer test."""

import pytest
import torch

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


def serve(weights, tier, signal=SignalMode.WAITVALUE, graph=True, copy_thread=True) -> list[torch.Tensor]:
    """Two users scored, moved to `tier`, visited twice (the second visit reads what the first offloaded); a host
    hit's onboarding is kept until the next launch (runtime/deferred.py). Without the copy thread the copies are
    issued on the caller's thread, a lead of layers before the launch and the rest after it (runtime/tiers.py)."""
    gen = torch.Generator().manual_seed(0)
    config = Config(cpu_cache_gb=1.0, gpu_cache_gb=0.5, page_size=32, signal=signal, transfer_timeout_s=5.0,
                    copy_thread=copy_thread)
    with Engine(weights, config, use_cuda_graph=graph, token_buckets=(128,), batch_buckets=(2,)) as engine:
        engine.warmup()
        engine.score([Request(u, torch.randint(0, 5000, (n,), generator=gen).tolist(), []) for u, n in HISTORY.items()])
        out = []
        for _ in range(2):
            if tier is Tier.HOST:
                engine.kv.wait_offloads()
                for u in HISTORY:
                    engine.kv.evict_from_gpu(u)
            visit = [Request(u, torch.randint(0, 5000, (5,), generator=gen).tolist(),
                             torch.randint(0, 5000, (40,), generator=gen).tolist()) for u in HISTORY]
            out += [s.clone() for s in engine.score(visit)]
        engine.kv.wait_offloads()   # the last visit's offloads hold their host pins until reaped
        assert len(engine.kv.deferred) == (tier is Tier.HOST)
        engine.kv.deferred.release()   # a kept onboarding holds its host pins until given back
        assert engine.kv.gpu.num_pinned == 0 and engine.kv.below.usage().pinned_users == 0
        assert all(b._raw_stream is not None for b in engine._buffers.values())
        return out


@pytest.fixture(scope="module")
def gpu_hit(weights):
    return serve(weights, Tier.GPU)


@pytest.mark.parametrize("signal,graph", [(SignalMode.WAITVALUE, True), (SignalMode.EVENTFD, True),
                                          (SignalMode.EVENT, True), (SignalMode.WAITVALUE, False)])
def test_host_hit_equals_the_gpu_hit_bitwise(weights, gpu_hit, signal, graph):
    got = serve(weights, Tier.HOST, signal=signal, graph=graph)
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))


@pytest.mark.parametrize("signal,graph,copy_thread", [
    (SignalMode.WAITVALUE, True, False), (SignalMode.EVENTFD, True, False), (SignalMode.EVENT, True, False),
    (SignalMode.WAITVALUE, False, False),
    (SignalMode.WAITVALUE, True, True),   # the copy-thread engine issuing inline (nothing in flight)
])
def test_a_lead_of_layers_then_the_rest_after_the_launch_gives_the_gpu_hits_scores(weights, gpu_hit, signal, graph,
                                                                                 copy_thread, monkeypatch):
    # One layer leads, the rest after every launch (event signals: all before it, their waits bind at the launch).
    monkeypatch.setattr("layerflow.runtime.tiers.LEAD_BYTES", 1)
    got = serve(weights, Tier.HOST, signal=signal, graph=graph, copy_thread=copy_thread)
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))
