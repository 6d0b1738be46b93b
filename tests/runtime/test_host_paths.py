"""The engine's collect-side host paths (runtime/host_paths.py) on the CPU path: an in-process onboarding released
before the fetch (the default) gives the scores of one released after the block bit for bit, gives its pins and
counter back, and a failure on it fails its request alone; the fetch mode is chosen by name."""

import random

import pytest
import torch

from layerflow.bench.paths import ReleaseAfterBlock
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.transfer.errors import TransferError
from tests.faults import FaultyThreadCopyEngine
from tests.runtime.test_engine import TOL, items, make_engine, reference, weights  # noqa: F401 - weights: a fixture


class Releases:
    """Counts the onboardings the KV manager's commit finishes."""

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
    for early in (True, False):
        with make_engine(weights, enable_layerwise=layerwise) as engine:
            if not early:
                engine.paths = ReleaseAfterBlock(engine.kv, engine.device, engine.config.transfer_timeout_s)
            releases = Releases(engine)
            engine.score([Request(4, history, [])])
            engine.kv.evict_from_gpu(4)
            assert engine.kv.tier(4) is Tier.HOST
            results[early] = engine.score([visit])[0]
            assert releases.in_commit == (0 if early else 1)
            engine.kv.wait_offloads()
            assert engine.kv.below.usage().pinned_users == 0 and engine.kv.gpu.num_pinned == 0
            assert all(engine.kv.below.signals._released)   # the counter went back with the host pins
    assert torch.equal(results[True], results[False])
    assert torch.allclose(results[True], reference(weights, history + visit.items, visit.candidates), atol=TOL)


def test_a_failed_onboarding_released_early_fails_its_request_alone_then_the_engine_serves(weights):
    copier = FaultyThreadCopyEngine()
    history = list(range(60))
    with make_engine(weights, copy_engine=copier) as engine:
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
        scores = engine.score([Request(5, [1], [2, 3])])[0]
        assert torch.equal(scores, hit)


def test_an_unknown_fetch_mode_is_refused_by_name(weights, monkeypatch):
    monkeypatch.setenv("LAYERFLOW_FETCH", "poll")
    with pytest.raises(ValueError, match="fetch='poll' \\(LAYERFLOW_FETCH\\)"):
        make_engine(weights)


def test_the_env_var_picks_the_fetch_mode(weights, monkeypatch):
    monkeypatch.setenv("LAYERFLOW_FETCH", "spin")
    with make_engine(weights) as engine:
        assert engine.paths.fetch == "spin"
    monkeypatch.delenv("LAYERFLOW_FETCH")
    with make_engine(weights) as engine:
        assert engine.paths.fetch == "sync"
