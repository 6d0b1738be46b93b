"""A user's offloads queued behind each other: a batch's offload of a user does not wait for that user's previous one
(still queued on the copy thread), the pages stay unevictable until both have landed, the tier reaps them in order,
and the host copy they leave is the one offloads waited for leave; a failed earlier offload leaves no host copy."""

import threading

import pytest
import torch

from layerflow.model import HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.tier.base import Tier
from layerflow.transfer.copy_engine import CopyJob, Transfer
from layerflow.transfer.issue_thread import IssueThreadCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.serving.helpers import MODEL, WAIT_S, config, sequential_scores

CPU = torch.device("cpu")


class GatedOffloads(ThreadCopyEngine):
    """Offloads wait for `gate` before they are issued; those of `refused` users' first page fail to issue."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.refuse: set[int] = set()

    def _offload(self, job: CopyJob) -> Transfer:
        if not self.gate.wait(WAIT_S):
            raise RuntimeError("the test's gate was never opened")
        if int(job.plan.gpu_pages[0]) in self.refuse:
            raise OSError("refused offload")
        return super()._offload(job)


@pytest.fixture(scope="module")
def weights() -> HSTUWeights:
    return HSTUWeights.init(MODEL, seed=0)


@pytest.fixture
def copies():
    inner = GatedOffloads()
    outer = IssueThreadCopyEngine(inner, CPU, owns_inner=False)
    yield inner, outer
    inner.gate.set()
    outer.close()
    inner.close()


def _requests(rounds: int) -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, MODEL.item_vocab_size, (n,), generator=gen).tolist()
    return [Request(0, ids(40 if k == 0 else 3), ids(4)) for k in range(rounds)]


def test_a_users_next_offload_is_issued_without_waiting_and_the_pages_stay_until_both_landed(weights, copies):
    inner, outer = copies
    requests = _requests(4)
    with Engine(weights, config(), copy_engine=outer) as engine:
        got = [engine.score([requests[0]])[0]]
        inner.gate.clear()   # the next batches' offloads stay queued on the copy thread
        got += [engine.score([r])[0] for r in requests[1:3]]
        entry = engine.kv.users[0]
        assert entry.offloading() and not engine.kv._gpu_can_drop(0)
        assert len(engine.kv.below._offloads[0]) == 2
        inner.gate.set()
        engine.kv.wait_offloads()
        assert not entry.offloading() and engine.kv._gpu_can_drop(0) and 0 not in engine.kv.below._offloads
        engine.kv.evict_from_gpu(0)
        assert engine.kv.tier(0) is Tier.HOST
        got.append(engine.score([requests[3]])[0])
    for a, b in zip(got, sequential_scores(weights, requests)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_a_failed_earlier_offload_leaves_no_host_copy_though_the_later_one_landed(weights, copies):
    inner, outer = copies
    requests = _requests(3)
    with Engine(weights, config(), copy_engine=outer) as engine:
        engine.score([requests[0]])
        engine.kv.wait_offloads()
        inner.gate.clear()
        engine.score([requests[1]])
        pages = engine.kv.gpu.pages(0)
        inner.refuse = {int(p) for p in pages}   # every page of user 0: its queued offloads fail to issue
        engine.score([requests[2]])
        assert len(engine.kv.below._offloads[0]) == 2
        inner.gate.set()
        engine.kv.wait_offloads()
        assert 0 not in engine.kv.below._offloads
        engine.kv.evict_from_gpu(0)
        assert engine.kv.tier(0) is Tier.NONE   # recomputed from its stored history at its next visit
