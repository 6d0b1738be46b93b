"""The early release of an in-process onboarding (Engine._release_early) on the CPU path: a host hit gives its
onboarding (host pins, signal counter) back in collect, before the fetch, so the KV manager's commit no longer finishes
it; the host hit scores bit for bit like the same visit served as a GPU hit, and a failed onboarding (under either release,
runtime/deferred.py) fails its request alone."""

import random

import pytest
import torch

from layerflow.runtime.deferred import RELEASE_ENV, RELEASES
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.transfer.errors import TransferError
from tests.faults import FaultyThreadCopyEngine
from tests.runtime.test_engine import TOL, items, make_engine, reference, weights  # noqa: F401 - weights: a fixture


class Releases:
    """Counts the onboardings the KV manager's commit still finishes."""

    def __init__(self, engine: Engine) -> None:
        self.in_commit = 0
        commit = engine.kv.commit

        def counted(plan):
            self.in_commit += plan.onboarding is not None
            commit(plan)
        engine.kv.commit = counted


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_host_hit_is_released_before_commit_and_scores_bitwise_like_a_gpu_hit(weights, layerwise):
    rng = random.Random(6)
    history, visit = items(rng, 200), Request(4, items(rng, 3), items(rng, 6))
    results = {}
    for tier in (Tier.HOST, Tier.GPU):
        with make_engine(weights, enable_layerwise=layerwise) as engine:
            releases = Releases(engine)
            engine.score([Request(4, history, [])])
            if tier is Tier.HOST:
                engine.kv.evict_from_gpu(4)
            assert engine.kv.tier(4) is tier
            results[tier] = engine.score([visit])[0]
            assert releases.in_commit == 0
            engine.kv.wait_offloads()
            assert engine.kv.below.usage().pinned_users == 0 and engine.kv.gpu.num_pinned == 0
            assert all(engine.kv.below.signals._released)   # the counter went back with the host pins
    assert torch.equal(results[Tier.HOST], results[Tier.GPU])
    assert torch.allclose(results[Tier.HOST], reference(weights, history + visit.items, visit.candidates), atol=TOL)


@pytest.mark.parametrize("release", RELEASES)
def test_a_failed_onboarding_fails_its_request_alone_then_the_engine_serves(weights, monkeypatch, release):
    """Under either release (runtime/deferred.py): a failed onboarding is never kept."""
    monkeypatch.setenv(RELEASE_ENV, release)
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
