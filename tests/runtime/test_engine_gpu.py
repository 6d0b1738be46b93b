"""The engine on the H200: every tier, wait mode and graph/eager choice gives the same scores."""

import time

import pytest
import torch

from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.config import SignalMode, Config
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.native_post import ENV

pytestmark = pytest.mark.gpu

BF16 = HSTUConfig(num_layers=4, num_heads=2, dqk=128, dv=128, embedding_dim=256, max_seq_len=4096,
                  dtype=torch.bfloat16, item_vocab_size=5000, position_table_size=4096)
FP32 = HSTUConfig(**{**BF16.to_dict(), "dtype": "float32"})
HISTORY = {1: 2000, 2: 333, 3: 0}


def _engine(weights, signal=SignalMode.EVENTFD, graph=True, layerwise=True, copy_engine=None,
            kv_cache_dtype="auto"):
    tc = Config(cpu_cache_gb=1.0, gpu_cache_gb=0.5, page_size=32, signal=signal, enable_layerwise=layerwise,
                transfer_timeout_s=5.0, kv_cache_dtype=kv_cache_dtype)
    engine = Engine(weights, tc, use_cuda_graph=graph, token_buckets=(64, 256), batch_buckets=(1, 4),
                    copy_engine=copy_engine)
    engine.warmup()
    return engine


def _requests(visit):
    gen = torch.Generator().manual_seed(visit)
    return [Request(u, torch.randint(0, 5000, (7 + u,), generator=gen).tolist(),
                    torch.randint(0, 5000, (9 * u,), generator=gen).tolist()) for u in HISTORY]


def _serve(weights, tier, **kw):
    """Build histories, move users 1 and 2 to `tier`, score one visit: returns the scores per user."""
    with _engine(weights, **kw) as engine:
        gen = torch.Generator().manual_seed(0)
        engine.score([Request(u, torch.randint(0, 5000, (n,), generator=gen).tolist(), [])
                      for u, n in HISTORY.items() if n])
        if tier is Tier.HOST:
            for u in (1, 2):
                engine.kv.evict_from_gpu(u)
        assert all(engine.kv.tier(u) is tier for u in (1, 2))
        return [s.clone() for s in engine.score(_requests(1))]


@pytest.fixture(scope="module")
def bf16_weights():
    return HSTUWeights.init(BF16, seed=0)


@pytest.fixture(scope="module")
def gpu_hit(bf16_weights):
    return _serve(bf16_weights, Tier.GPU)


@pytest.mark.parametrize("signal", list(SignalMode))
@pytest.mark.parametrize("graph", [True, False])
def test_cpu_hit_equals_gpu_hit_bitwise(bf16_weights, gpu_hit, signal, graph):
    got = _serve(bf16_weights, Tier.HOST, signal=signal, graph=graph)
    for a, b in zip(got, gpu_hit):
        assert torch.equal(a, b)


@pytest.mark.parametrize("graph", [True, False])
def test_cpu_hit_equals_gpu_hit_bitwise_with_native_waitvalue_posts(bf16_weights, gpu_hit, graph, monkeypatch):
    monkeypatch.setenv(ENV, "native")
    got = _serve(bf16_weights, Tier.HOST, signal=SignalMode.WAITVALUE, graph=graph)
    for a, b in zip(got, gpu_hit):
        assert torch.equal(a, b)


def test_non_layerwise_fallback_equals_gpu_hit(bf16_weights, gpu_hit):
    got = _serve(bf16_weights, Tier.HOST, layerwise=False)
    assert all(torch.equal(a, b) for a, b in zip(got, gpu_hit))


def test_gpu_path_matches_full_recompute():
    weights = HSTUWeights.init(FP32, seed=0)
    got = _serve(weights, Tier.HOST)
    gen = torch.Generator().manual_seed(0)
    histories = {u: torch.randint(0, 5000, (n,), generator=gen).tolist() for u, n in HISTORY.items() if n}
    histories[3] = []
    cpu_weights = weights
    for r, scores in zip(_requests(1), got):
        ref = full_forward(cpu_weights, [histories[r.user_id] + r.items], [r.candidates]).scores
        assert torch.allclose(scores, ref, rtol=2e-3, atol=2e-3), r.user_id


def test_graph_replays_across_lengths_like_eager(bf16_weights):
    outs = []
    for graph in (True, False):
        with _engine(bf16_weights, graph=graph) as engine:
            engine.score([Request(u, list(range(n)), []) for u, n in HISTORY.items() if n])
            outs.append([engine.score(_requests(v)) for v in range(1, 4)])
    for a, b in zip(*outs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("signal", list(SignalMode))
def test_failing_transfer_fails_within_a_second_and_next_batch_succeeds(bf16_weights, signal):
    from tests.faults import FaultyCudaCopyEngine

    copier = FaultyCudaCopyEngine()
    with _engine(bf16_weights, signal=signal, copy_engine=copier) as engine:
        engine.score([Request(1, list(range(1500)), [])])
        engine.kv.evict_from_gpu(1)
        copier.fail_at_layer = 2
        start = time.monotonic()
        with pytest.raises(TransferError):
            engine.score([Request(1, [5], [6, 7])])
        assert time.monotonic() - start < 1.0
        copier.fail_at_layer = None
        scores = engine.score([Request(1, [5], [6, 7])])[0]
        assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_warmup_captures_every_bucket_without_host_sync(bf16_weights):
    """Capture fails on any host synchronisation, so captured graphs prove the per-layer loop has none."""
    with _engine(bf16_weights) as engine:
        for bucket in engine.buckets:
            bufs = engine._bufs(bucket)
            assert engine.graphs.captured(bufs, engine.no_wait) and engine.graphs.captured(bufs, engine.layer_wait)
