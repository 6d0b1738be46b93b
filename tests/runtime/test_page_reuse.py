"""Issue 19: with the in-process tier a user whose offload is still in flight may be evicted, without the host
waiting for the offload; the batch given its pages is ordered after it (its onboarding on the H2D worker, its block on
the caller), so the evicted user's host copy stays whole; and one user's offloads may overlap, landing in order."""

import threading

import pytest
import torch

from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from tests.faults import FaultyThreadCopyEngine
from tests.runtime.test_engine_faults import TOL, engine_with, reference, weights  # noqa: F401 - a fixture

HISTORY_2 = list(range(60, 120))   # 4 pages of 16
HISTORY_3 = list(range(100))       # 7 pages: in a pool of 10 beside user 2's 4, only by evicting user 2


@pytest.fixture
def held():
    """Offload copies that wait for `release` (set it to let them land); onboardings run freely."""
    release = threading.Event()

    def hold_offloads(layer: int) -> None:
        if threading.current_thread().name == "layerflow-d2h" and not release.wait(20.0):
            raise RuntimeError("the held offload was never released")

    engine = FaultyThreadCopyEngine(before_layer=hold_offloads)
    yield engine, release
    release.set()


def check(scores, weights, history, candidates):
    assert torch.allclose(scores, reference(weights, history, candidates), atol=TOL, rtol=TOL)


def test_a_block_writing_an_evicted_users_pages_runs_after_its_offload(weights, held):
    copy_engine, release = held
    with engine_with(weights, gpu_pages=10, copy_engine=copy_engine) as engine:
        engine.score([Request(2, HISTORY_2, [])])   # its offload is held
        plan = engine.prepare([Request(3, HISTORY_3, [1])])   # a miss given user 2's pages: no wait here
        assert 2 not in engine.kv.gpu and engine.kv.users[2].offloading() and plan.reuse_fences
        threading.Timer(0.2, release.set).start()
        check(engine.collect(engine.launch(plan))[0], weights, HISTORY_3, [1])   # its block waited for the offload
        engine.kv.wait_offloads()
        assert engine.kv.tier(2) is Tier.HOST
        engine.kv.evict_from_gpu(3)
        check(engine.score([Request(2, [7], [8])])[0], weights, HISTORY_2 + [7], [8])   # the host copy is whole


def test_an_onboarding_into_an_evicted_users_pages_runs_after_its_offload(weights, held):
    copy_engine, release = held
    with engine_with(weights, gpu_pages=10, copy_engine=copy_engine) as engine:
        release.set()
        engine.score([Request(3, HISTORY_3, [])])
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(3)
        release.clear()
        engine.score([Request(2, HISTORY_2, [])])   # its offload is held
        plan = engine.prepare([Request(3, [5], [6])])   # a host hit onboarded into user 2's pages
        assert plan.tiers == [Tier.HOST] and plan.reuse_fences and engine.kv.users[2].offloading()
        threading.Timer(0.2, release.set).start()
        check(engine.collect(engine.launch(plan))[0], weights, HISTORY_3 + [5], [6])
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(3)
        check(engine.score([Request(2, [7], [8])])[0], weights, HISTORY_2 + [7], [8])


def test_one_users_offloads_overlap_and_land_in_order(weights, held):
    copy_engine, release = held
    history = list(range(40))   # ends in a partial page, which the second offload rewrites
    with engine_with(weights, gpu_pages=10, copy_engine=copy_engine) as engine:
        engine.score([Request(1, history, [])])
        engine.score([Request(1, [3], [4])])   # offloads again while the first is held: no wait for it
        in_flight = engine.kv.users[1].offload.transfers
        assert len(in_flight) == 2 and not any(t.done() for t in in_flight)
        release.set()
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(1)
        assert engine.kv.tier(1) is Tier.HOST
        check(engine.score([Request(1, [5], [6])])[0], weights, history + [3, 5], [6])
