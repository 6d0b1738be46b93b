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


def test_copies_of_one_kv_dtype_are_never_read_as_another(redis_url):
    """An fp8 engine on the Redis an exact-cache engine wrote to sees none of its users (another fingerprint: a miss,
    never bytes of another dtype); a second fp8 engine adopts the first's user, whose manifest names the fp8 dtype."""
    weights = HSTUWeights.init(MODEL, seed=4)
    config = dict(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16, transfer_timeout_s=5.0, remote_url=redis_url,
                  remote_namespace="dtypes")
    rng = random.Random(1)
    first = [rng.randrange(500) for _ in range(100)]
    second = Request(1, [rng.randrange(500) for _ in range(10)], [rng.randrange(500) for _ in range(8)])
    with Engine(weights, Config(**config)) as exact, \
            Engine(weights, Config(**config, kv_cache_dtype="fp8_e4m3")) as fp8:
        exact.score([Request(1, first, [])])
        exact.kv.wait_offloads()
        assert exact.kv.below.cache.remote.flush(10)
        assert exact.kv.below.cache.remote.lookup(1).dtypes == ("float32",)
        assert fp8.kv.below.cache.remote.lookup(1) is None
        plan = fp8.prepare([second])
        assert plan.tiers == [Tier.NONE]
        fp8.cancel(plan)
    with Engine(weights, Config(**config, kv_cache_dtype="fp8_e4m3")) as fp8, \
            Engine(weights, Config(**config, kv_cache_dtype="fp8_e4m3")) as other_fp8:
        fp8.score([Request(2, first, [])])
        fp8.kv.wait_offloads()
        assert fp8.kv.below.cache.remote.flush(10)
        assert fp8.kv.below.cache.remote.lookup(2).dtypes == ("float8_e4m3fn",)
        plan = other_fp8.prepare([Request(2, second.items, second.candidates)])
        assert plan.tiers == [Tier.REMOTE]
        adopted = other_fp8.collect(other_fp8.launch(plan))[0]
        own = fp8.score([Request(2, second.items, second.candidates)])[0]
    assert torch.equal(adopted, own)
