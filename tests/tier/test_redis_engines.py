"""Two engines standing for two hosts (separate Engine objects and host pools, one real redis-server) share users: a
user computed by A and then routed to B is a remote hit on B with A's scores."""

import random

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.tier.base import Tier

MODEL = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                   dtype=torch.float32, item_vocab_size=500, position_table_size=1024)


def test_a_user_computed_on_one_engine_is_a_remote_hit_with_the_same_scores_on_another(redis_url):
    weights = HSTUWeights.init(MODEL, seed=3)
    config = Config(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16, transfer_timeout_s=5.0,
                    remote_url=redis_url, remote_namespace="engines")
    rng = random.Random(0)
    first = [rng.randrange(500) for _ in range(100)]
    second = Request(1, [rng.randrange(500) for _ in range(10)], [rng.randrange(500) for _ in range(8)])
    with Engine(weights, config) as a, Engine(weights, config) as b:
        a.score([Request(1, first, [1, 2, 3])])
        a.kv.wait_offloads()
        assert a.kv.below.cache.remote.flush(10)
        plan = b.prepare([second])
        assert plan.tiers == [Tier.REMOTE]
        on_b = b.collect(b.launch(plan))[0]
        on_a = a.score([second])[0]
    expected = full_forward(weights, [first + list(second.items)], [list(second.candidates)]).scores
    torch.testing.assert_close(on_b, on_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(on_b, expected.reshape(on_b.shape), rtol=1e-5, atol=1e-5)
