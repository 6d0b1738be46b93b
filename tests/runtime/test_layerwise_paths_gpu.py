"""The engine's host paths on the H200: copies issued by the issue thread, the collect's native spin and the early
finish give the scores of the default paths bit for bit (GPU hit and host hit, graph and eager). A failed onboarding
on them: test_engine_gpu.py's failing-transfer test."""

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
PATHS = [("thread", "sync", "after"), ("inline", "spin", "after"), ("inline", "sync", "early"),
         ("thread", "spin", "early")]


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(MODEL, seed=3)


def engine_for(weights, signal=SignalMode.WAITVALUE, graph=True, copy_engine=None, **paths) -> Engine:
    config = Config(cpu_cache_gb=1.0, gpu_cache_gb=0.5, page_size=32, signal=signal, transfer_timeout_s=5.0)
    engine = Engine(weights, config, use_cuda_graph=graph, token_buckets=(128,), batch_buckets=(2,),
                    copy_engine=copy_engine, **paths)
    engine.warmup()
    return engine


def serve(weights, tier, **kw) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    with engine_for(weights, **kw) as engine:
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


@pytest.mark.parametrize("paths,signal,graph", [
    *[(paths, SignalMode.WAITVALUE, True) for paths in PATHS],
    (PATHS[0], SignalMode.EVENTFD, True), (PATHS[-1], SignalMode.EVENTFD, True),
    (PATHS[-1], SignalMode.WAITVALUE, False)])
def test_host_hit_on_the_new_paths_equals_the_gpu_hit_bitwise(weights, gpu_hit, paths, signal, graph):
    issue, fetch, finish = paths
    got = serve(weights, Tier.HOST, signal=signal, graph=graph, issue=issue, fetch=fetch, finish=finish)
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))


def test_gpu_hit_with_the_spin_fetch_equals_the_sync_fetch(weights, gpu_hit):
    got = serve(weights, Tier.GPU, fetch="spin")
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))


def test_thread_issue_with_event_signals_is_refused(weights):
    with pytest.raises(ValueError, match="issue='thread' with signal 'event'"):
        engine_for(weights, signal=SignalMode.EVENT, issue="thread")
