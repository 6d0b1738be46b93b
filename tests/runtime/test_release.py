"""The engine's early release (release="early", runtime/engine.py) on the CPU path: an in-process onboarding given
back before the fetch scores bit for bit like one given back by commit after the block, returns its host pins and
signal counter, and a failed onboarding released early fails its request alone; the mode is chosen by name."""

import random

import pytest
import torch

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
def test_the_early_release_scores_bitwise_like_the_release_after_the_block(weights, layerwise):
    rng = random.Random(6)
    history, visit = items(rng, 200), Request(4, items(rng, 3), items(rng, 6))
    results = {}
    for release in ("early", "after"):
        with make_engine(weights, enable_layerwise=layerwise) as engine:
            engine.release = release
            releases = Releases(engine)
            engine.score([Request(4, history, [])])
            engine.kv.evict_from_gpu(4)
            assert engine.kv.tier(4) is Tier.HOST
            results[release] = engine.score([visit])[0]
            assert releases.in_commit == (0 if release == "early" else 1)
            engine.kv.wait_offloads()
            assert engine.kv.below.usage().pinned_users == 0 and engine.kv.gpu.num_pinned == 0
            assert all(engine.kv.below.signals._released)   # the counter went back with the host pins
    assert torch.equal(results["early"], results["after"])
    assert torch.allclose(results["early"], reference(weights, history + visit.items, visit.candidates), atol=TOL)


def test_a_failed_onboarding_released_early_fails_its_request_alone_then_the_engine_serves(weights):
    copier = FaultyThreadCopyEngine()
    history = list(range(60))
    with make_engine(weights, copy_engine=copier) as engine:
        engine.release = "early"
        engine.score([Request(5, history, []), Request(6, history, [])])
        engine.kv.evict_from_gpu(5)
        copier.fail_at_layer = 1
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            engine.score([Request(5, [1], [2, 3])])
        assert engine.kv.tier(5) is Tier.HOST and engine.kv.gpu.num_pinned == 0
        engine.kv.wait_offloads()
        assert engine.kv.below.usage().pinned_users == 0   # the failed onboarding's host pins went back
        assert engine.kv.users[5].history == history
        copier.fail_at_layer = None
        hit = engine.score([Request(6, [1], [2, 3])])[0]   # a GPU hit between: nothing of the failure is left
        assert torch.allclose(hit, reference(weights, history + [1], [2, 3]), atol=TOL)
        assert torch.equal(engine.score([Request(5, [1], [2, 3])])[0], hit)


def test_the_env_var_picks_the_release_and_a_bad_one_is_named(weights, monkeypatch):
    monkeypatch.setenv("LAYERFLOW_RELEASE", "early")
    with make_engine(weights) as engine:
        assert engine.release == "early"
    monkeypatch.delenv("LAYERFLOW_RELEASE")
    with make_engine(weights) as engine:
        assert engine.release == "after"
    monkeypatch.setenv("LAYERFLOW_RELEASE", "soon")
    with pytest.raises(ValueError, match="release='soon' \\(LAYERFLOW_RELEASE\\)"):
        make_engine(weights)


def test_the_fill_copy_reaches_every_bucket_and_a_bad_one_is_named(weights, monkeypatch):
    with make_engine(weights) as engine:
        assert engine.fill_copy == "cudart"
        engine.score([Request(7, [1, 2], [3])])
        engine.fill_copy = "torch"   # the CPU path copies with torch whatever the mode: the same scores
        assert {b.fill_copy for b in engine._buffers.values()} == {"torch"}
        with pytest.raises(ValueError, match="fill_copy='dma'"):
            engine.fill_copy = "dma"
    monkeypatch.setenv("LAYERFLOW_FILL_COPY", "dma")
    with pytest.raises(ValueError, match="fill_copy='dma' \\(LAYERFLOW_FILL_COPY\\)"):
        make_engine(weights)
