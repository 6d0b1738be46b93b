"""Batches chained on the one in flight (KVManager.prepare(chain=True)): they see the history it recorded, score as
if prepared after its collect, and a failure of the batch in flight aborts them, leaving no trace of either batch."""

import pytest
import torch

from layerflow.model import HSTUWeights
from layerflow.runtime.buffers import Bucket
from layerflow.runtime.chains import ChainAborted
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.tier.base import Tier
from layerflow.transfer.errors import TransferError
from tests.serving.helpers import MODEL, TOL, FailingCollect, config, sequential_scores


def history(user: int, n: int) -> Request:
    return Request(user, [(user * 31 + i) % MODEL.item_vocab_size for i in range(n)], [])


SETUP = [history(1, 40), history(2, 30)]
FIRST = [Request(1, [5, 6], [7, 8]), Request(2, [9], [10, 11])]
SECOND = [Request(1, [12], [13, 14]), Request(3, [15] * 20, [16])]


@pytest.fixture(scope="module")
def weights() -> HSTUWeights:
    return HSTUWeights.init(MODEL, seed=3)


def set_up(engine: Engine) -> None:
    """Users 1 and 2 with a history; user 2 evicted to the host (FIRST onboards it)."""
    engine.score(SETUP)
    engine.kv.wait_offloads()
    engine.kv.evict_from_gpu(2)


def test_a_batch_chained_on_the_one_in_flight_scores_as_if_prepared_after_its_collect(weights):
    with Engine(weights, config()) as chained, Engine(weights, config()) as after:
        set_up(chained)
        set_up(after)
        flight = chained.launch(chained.prepare(FIRST))
        plan = chained.prepare(SECOND, chain=True)
        assert plan.tiers == [Tier.GPU, Tier.NONE]
        assert plan.batch.cached_lens == [42, 0]           # user 1's history as FIRST recorded it at its launch
        got = chained.collect(flight) + chained.collect(chained.launch(plan))
        assert chained.kv.gpu.num_pinned == 0
        want = after.score(FIRST) + after.score(SECOND)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    expected = sequential_scores(weights, SETUP + FIRST + SECOND)[2:]
    assert all(torch.allclose(g, e, atol=TOL, rtol=TOL) for g, e in zip(got, expected))


def test_a_user_of_a_batch_not_collected_is_refused_unless_chained_on_it_once_launched(weights):
    with Engine(weights, config()) as engine:
        set_up(engine)
        plan = engine.prepare(FIRST)
        with pytest.raises(ValueError, match="user 1 is in a prepared batch not launched yet"):
            engine.prepare(SECOND, chain=True)
        flight = engine.launch(plan)
        with pytest.raises(ValueError, match="user 1 is in a batch not collected yet"):
            engine.prepare(SECOND)
        assert engine.kv.gpu.pin_count(1) == 1 and 3 not in engine.kv.gpu   # the refusals placed nothing
        engine.collect(flight)
        engine.score(SECOND)
        assert engine.kv.gpu.num_pinned == 0


def test_a_failed_batch_in_flight_aborts_the_batch_chained_on_it_and_leaves_no_trace_of_either(weights):
    with FailingCollect(weights, config()) as engine:
        set_up(engine)
        engine.failing = {2}                                # FIRST (user 2 onboarded) fails at its collect
        flight = engine.launch(engine.prepare(FIRST))
        plan = engine.prepare(SECOND, chain=True)
        assert engine.kv.gpu.pin_count(1) == 2
        with pytest.raises(TransferError, match="injected failure found at the collect"):
            engine.collect(flight)
        assert plan.aborted
        with pytest.raises(ChainAborted, match=r"users \[1, 3\]"):
            engine.launch(plan)
        kv = engine.kv
        assert kv.gpu.num_pinned == 0
        assert len(kv.users[1].history) == 40 and len(kv.users[2].history) == 30 and 3 not in kv.users
        assert 2 not in kv.gpu and 3 not in kv.gpu and kv.tier(2) is Tier.NONE   # its copy below may be stale
        assert kv.gpu.num_free == kv.gpu.total - sum(len(kv.gpu.pages(u)) for u in kv.gpu.users())
        assert len(engine._buffers[Bucket(2, 64)]._spare) == 2   # both batches' slabs given back
        engine.failing = set()
        got = engine.score(FIRST) + engine.score(SECOND)
    expected = sequential_scores(weights, SETUP + FIRST + SECOND)[2:]
    assert all(torch.allclose(g, e, atol=TOL, rtol=TOL) for g, e in zip(got, expected))
