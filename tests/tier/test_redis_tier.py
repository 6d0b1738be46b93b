"""The host cache with a Redis store below it, through the KV tier's onboarding path: two tiers built from the config
stand for two hosts sharing one real redis-server.

Offloads go through the host cache with the user's history and the tier's own copy engine (what the tier's `offload`
does once it passes the history on: see docs/redis.md)."""

import pytest
import torch

from layerflow.config import Config
from layerflow.runtime.tiers import build_kv
from layerflow.tier.base import Tier
from layerflow.tier.copies import AllOf
from tests.tier.test_tier_suite import LAYOUT, PAGE, failure_of, fill, gb, not_resident_users, onboard, same


@pytest.fixture
def hosts():
    """`hosts(url, **config)` -> (gpu pool, tier) of one more host; all closed after the test."""
    made = []

    def make(url, **overrides):
        values = dict(cpu_cache_gb=gb(10), gpu_cache_gb=gb(32), transfer_timeout_s=10.0, num_counters=2,
                      remote_url=url, remote_namespace="tier", remote_timeout_s=2.0)
        values.update(overrides)
        gpu, tier = build_kv(Config(**values), LAYOUT, torch.device("cpu"), model_key="model-a")
        made.append(tier)
        return gpu, tier

    yield make
    for tier in reversed(made):
        tier.close()
        tier.cache.close()


def offload(tier, user: int, history, gpu_pages) -> None:
    """The user's first len(history) tokens from `gpu_pages` into the host copy, naming their history."""
    cache, n = tier.cache, -(-len(history) // PAGE)
    slot = cache.begin_offload(user, len(history), history=list(history))
    copies = AllOf(tier.copier.copy(list(gpu_pages)[slot.first:n], slot.blocks[slot.first:n], to_gpu=False))
    copies.wait(10)
    cache.end_offload(user, ok=True)


def flushed(tier) -> None:
    assert tier.cache.remote.flush(10)


def test_a_user_written_through_on_one_host_is_a_remote_hit_on_another(redis_url, hosts):
    gpu_a, a = hosts(redis_url)
    gpu_b, b = hosts(redis_url)
    expected = fill(gpu_a, range(4), seed=1)
    history = list(range(300, 314))
    offload(a, 7, history, range(4))
    flushed(a)
    assert a.usage().pinned_users == 0              # the writer gave the offload's pin back
    assert b.cache.adopt(7) == (14, history)
    assert b.locate(7, 14) is Tier.REMOTE and b.locate(7, 15) is Tier.NONE
    onboard(b, gpu_b, [(7, 14, [10, 11, 12, 13])])
    assert all(torch.equal(t[[10, 11, 12, 13]], e[[0, 1, 2, 3]]) for t, e in zip(gpu_b.kv, expected))
    assert b.locate(7, 14) is Tier.HOST             # read back into B's host, served from there next time
    assert b.usage().pinned_users == 0


def test_on_evict_writes_a_user_only_when_the_host_drops_it(redis_url, hosts):
    gpu_a, a = hosts(redis_url, remote_write="on_evict")
    gpu_b, b = hosts(redis_url)
    expected = fill(gpu_a, range(3), seed=2)
    offload(a, 4, range(11), range(3))
    flushed(a)
    assert b.cache.adopt(4) is None
    a.evict(4)
    flushed(a)
    assert b.cache.adopt(4) == (11, list(range(11)))
    onboard(b, gpu_b, [(4, 11, [5, 6, 7])])
    assert same(gpu_b, [5, 6, 7], expected, [0, 1, 2])


def test_a_copy_computed_from_another_history_is_never_served(redis_url, hosts):
    gpu_a, a = hosts(redis_url)
    gpu_b, b = hosts(redis_url)
    fill(gpu_a, range(2), seed=3)
    fill(gpu_b, range(2), seed=4)
    offload(b, 5, [1] * 8, range(2))                # B's own user 5 ...
    flushed(b)
    b.evict(5)                                      # ... leaves its host (no SSD)
    offload(a, 5, [2] * 8, range(2))                # A then writes user 5 from another history
    flushed(a)
    assert b.locate(5, 8) is Tier.NONE
    assert a.locate(5, 8) is Tier.HOST


def test_truncate_and_drop_reach_the_remote_copy(redis_url, hosts):
    gpu_a, a = hosts(redis_url)
    _, b = hosts(redis_url)
    fill(gpu_a, range(3), seed=5)
    offload(a, 6, range(12), range(3))
    flushed(a)
    a.truncate(6, 5)
    flushed(a)
    assert b.cache.adopt(6) == (5, list(range(5)))
    a.drop(6)
    flushed(a)
    assert b.cache.adopt(6) is None


def test_redis_gone_under_an_onboarding_is_not_resident_and_leaves_nothing_pinned(redis_process, hosts):
    server = redis_process()
    gpu_a, a = hosts(server.url)
    gpu_b, b = hosts(server.url)
    fill(gpu_a, range(3), seed=6)
    offload(a, 8, range(12), range(3))
    flushed(a)
    assert b.cache.adopt(8) is not None and b.locate(8, 12) is Tier.REMOTE
    server.kill()
    assert not_resident_users(failure_of(b, gpu_b, [(8, 12, [0, 1, 2])])) == [8]
    usage = b.usage()
    assert (usage.host_users, usage.pinned_users) == (0, 0)
    assert b.locate(8, 12) is Tier.NONE              # backing off: a miss at once
    assert b.cache.remote.outage.active
