"""Slab staging with the native packer and the reap after the launch (the engine's defaults) on the H200: graph
replays score bitwise like the JaggedBatch staging with the reap before, for GPU and host hits."""

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request

pytestmark = pytest.mark.gpu

BF16 = HSTUConfig(num_layers=2, num_heads=2, dqk=128, dv=128, embedding_dim=256, max_seq_len=4096,
                  dtype=torch.bfloat16, item_vocab_size=5000, position_table_size=4096)
HISTORY = {1: 1500, 2: 333, 3: 0}


def _visit(seed):
    gen = torch.Generator().manual_seed(seed)
    return [Request(u, torch.randint(0, 5000, (5 + u,), generator=gen).tolist(),
                    torch.randint(0, 5000, (11 * u,), generator=gen).tolist()) for u in HISTORY]


def _scores(weights, staging, reap):
    config = Config(cpu_cache_gb=1.0, gpu_cache_gb=0.5, page_size=32, transfer_timeout_s=5.0)
    with Engine(weights, config, staging=staging, reap=reap, token_buckets=(64, 256), batch_buckets=(1, 4)) \
            as engine:
        assert engine.pack == "native"
        engine.warmup()
        gen = torch.Generator().manual_seed(0)
        engine.score([Request(u, torch.randint(0, 5000, (n,), generator=gen).tolist(), [])
                      for u, n in HISTORY.items() if n])
        out = [s.clone() for s in engine.score(_visit(1))]          # GPU hits
        out += [s.clone() for s in engine.score(_visit(2)[:1])]     # a smaller batch in another bucket
        for u in (1, 2):
            engine.kv.evict_from_gpu(u)
        assert engine.kv.tier(1) is Tier.HOST
        out += [s.clone() for s in engine.score(_visit(3))]         # host hits, layerwise
        assert engine.graphs is not None
        return out


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(BF16, seed=0)


@pytest.fixture(scope="module")
def proven(weights):
    return _scores(weights, "batch", "before")


def test_the_defaults_score_bitwise_like_batch_staging_with_reap_before(weights, proven):
    new = _scores(weights, "slab", "after")   # both defaults at once (each alone: the CPU tests)
    assert len(proven) == len(new) == 7
    for a, b in zip(proven, new):
        assert a.device.type == "cpu" and torch.equal(a, b)
