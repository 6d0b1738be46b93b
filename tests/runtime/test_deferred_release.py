"""The release of an in-process onboarding after the next launch (runtime/deferred.py) on the CPU path: a committed host
hit keeps its onboarding (signal counter, host pins) until the next batch's launch, scores bit for bit like the same
visit served as a GPU hit, never blocks the signal ring, gives its pins back before anything that needs them (drop,
eviction to SSD, a read-back, the engine's close), and a failed onboarding is never kept: it fails its request alone."""

import random

import pytest
import torch

from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.transfer.errors import TransferError
from tests.faults import FaultyThreadCopyEngine
from tests.runtime.test_engine import TOL, items, make_engine, reference, weights  # noqa: F401 - weights: a fixture


def counters_released(engine) -> bool:
    return all(engine.kv.below.signals._released)


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_host_hit_is_kept_until_the_next_launch_and_scores_bitwise_like_a_gpu_hit(weights, layerwise):
    rng = random.Random(8)
    history, visit, other = items(rng, 150), Request(4, items(rng, 3), items(rng, 6)), Request(5, [7], [8, 9])
    results = {}
    for tier in (Tier.HOST, Tier.GPU):
        with make_engine(weights, enable_layerwise=layerwise) as engine:
            engine.score([Request(4, history, []), Request(5, history, [])])
            if tier is Tier.HOST:
                engine.kv.evict_from_gpu(4)
            assert engine.kv.tier(4) is tier
            results[tier] = engine.score([visit])[0]
            engine.kv.wait_offloads()   # the offloads' pins go back, a kept onboarding's stay
            kept = tier is Tier.HOST
            assert len(engine.kv.deferred) == kept and counters_released(engine) is not kept
            assert engine.kv.below.usage().pinned_users == kept and engine.kv.gpu.num_pinned == 0
            engine.score([other])   # a GPU hit: its launch gives the kept onboarding back
            engine.kv.wait_offloads()
            assert len(engine.kv.deferred) == 0 and counters_released(engine)
            assert engine.kv.below.usage().pinned_users == 0 and engine.kv.gpu.num_pinned == 0
    assert torch.equal(results[Tier.HOST], results[Tier.GPU])
    with make_engine(weights) as engine:   # closing gives a kept onboarding back before the tier closes
        engine.score([Request(4, history, [])])
        engine.kv.evict_from_gpu(4)
        engine.score([visit])
        signals = engine.kv.below.signals
    assert all(signals._released)
    assert torch.allclose(results[Tier.HOST], reference(weights, history + visit.items, visit.candidates), atol=TOL)


def test_host_hits_back_to_back_on_a_single_counter_never_wait_for_a_kept_one(weights):
    rng = random.Random(9)
    history = items(rng, 100)
    with make_engine(weights, num_counters=1) as engine:
        engine.score([Request(3, history, [])])
        for step in range(3):
            engine.kv.evict_from_gpu(3)   # waits for the user's offload, not for the kept onboarding
            visit = Request(3, items(rng, 2), items(rng, 4))
            got = engine.score([visit])[0]   # the ring's one counter is the kept one's: given back first
            history += visit.items
            assert torch.allclose(got, reference(weights, history, visit.candidates), atol=TOL)
            assert len(engine.kv.deferred) == 1


def test_dropping_or_evicting_a_kept_user_frees_its_host_blocks(weights, tmp_path):
    history = list(range(80))
    with make_engine(weights, tmp_path) as engine:
        for user in (1, 2):
            engine.score([Request(user, history, [])])
            engine.kv.wait_offloads()
            engine.kv.evict_from_gpu(user)
            engine.score([Request(user, [5], [6])])
            assert len(engine.kv.deferred) == 1
            if user == 1:
                engine.kv.drop(1)
            else:
                engine.kv.evict_from_host(2)
            assert len(engine.kv.deferred) == 0
        engine.kv.wait_offloads()
        usage = engine.kv.below.usage()
        # user 2's host copy went to SSD whole; user 1 left no block behind
        assert (usage.host_users, usage.host_blocks, usage.pinned_users) == (0, 0, 0)
        assert engine.kv.tier(1) is Tier.NONE and engine.kv.below.cache.lookup(2)[0] is Tier.SSD


def test_a_read_back_from_ssd_gives_the_kept_onboardings_back_first(weights, tmp_path):
    history = list(range(70))
    with make_engine(weights, tmp_path) as engine:
        engine.score([Request(1, history, []), Request(2, history, [])])
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(1)
        engine.score([Request(1, [3], [4])])
        assert len(engine.kv.deferred) == 1
        engine.kv.evict_from_gpu(2)
        engine.kv.below.cache.evict(2)   # below the manager: its kept onboarding (user 1's) stays
        assert engine.kv.tier(2) is Tier.SSD and len(engine.kv.deferred) == 1
        plan = engine.prepare([Request(2, [3], [4])])
        assert len(engine.kv.deferred) == 0
        got = engine.collect(engine.launch(plan))[0]
        assert torch.allclose(got, reference(weights, history + [3], [4]), atol=TOL)



def test_a_failed_onboarding_fails_its_request_alone_then_the_engine_serves(weights):
    """A failed onboarding is never kept: its pins go back with the failure."""
    copier = FaultyThreadCopyEngine()
    history = list(range(60))
    with make_engine(weights, copy_engine=copier) as engine:
        engine.score([Request(5, history, []), Request(6, history, [])])
        engine.kv.evict_from_gpu(5)
        copier.fail_at_layer = 1
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            engine.score([Request(5, [1], [2, 3])])
        assert engine.kv.tier(5) is Tier.HOST and engine.kv.gpu.num_pinned == 0 and len(engine.kv.deferred) == 0
        engine.kv.wait_offloads()
        assert engine.kv.below.usage().pinned_users == 0   # the failed onboarding's host pins went back
        assert engine.kv.users[5].history == history
        copier.fail_at_layer = None
        hit = engine.score([Request(6, [1], [2, 3])])[0]   # a GPU hit between: nothing of the failure is left
        assert torch.allclose(hit, reference(weights, history + [1], [2, 3]), atol=TOL)
        assert torch.equal(engine.score([Request(5, [1], [2, 3])])[0], hit)
