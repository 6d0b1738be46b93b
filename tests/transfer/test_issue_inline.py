"""The copy-thread engine's inline onboardings: issued by the inner engine on the caller's thread when the caller
launches right after and the queue is idle, handed to the thread otherwise; the thread never leaves a lead's rest
behind; issue_deferred reaches the inner engine, at once or queued behind what runs."""

import threading

import torch

from layerflow.transfer.issue_thread import IssuedTransfer, IssueThreadCopyEngine
from layerflow.transfer.signals import make_signals
from layerflow.config import SignalMode
from tests.transfer.pages import LAYERS, check_onboarded, make_tensors
from tests.transfer.test_issue_thread import GatedEngine

CPU = torch.device("cpu")


class Deferring(GatedEngine):
    """Counts issue_deferred calls and the threads they came from."""

    def __init__(self) -> None:
        super().__init__()
        self.deferred: list[str] = []

    def issue_deferred(self) -> None:
        self.deferred.append(threading.current_thread().name)


def test_an_inline_onboarding_is_the_inner_engines_on_the_callers_thread():
    inner = Deferring()
    engine = IssueThreadCopyEngine(inner, CPU)
    try:
        gpu, host = make_tensors()
        engine.inline = True
        transfer = engine.onboard(gpu, host, [0, 1, 2], [4, 5, 6])
        assert not isinstance(transfer, IssuedTransfer)
        transfer.wait(5)
        assert inner.issued == [(threading.current_thread().name, "h2d", 0)]
        check_onboarded(gpu, host, [0, 1, 2], [4, 5, 6])
        engine.issue_deferred()   # the queue is idle: at once, on this thread
        assert inner.deferred == [threading.current_thread().name]
    finally:
        engine.close()


def test_beside_queued_work_or_without_the_hint_the_thread_issues_it_whole():
    inner = Deferring()
    engine = IssueThreadCopyEngine(inner, CPU)
    signals = make_signals(SignalMode.EVENTFD, LAYERS, 2, 5.0)
    try:
        gpu, host = make_tensors()
        inner.gate.clear()   # the thread's first job blocks: the queue is busy
        first = engine.onboard(gpu, host, [0, 1], [4, 5])
        engine.inline = True
        handle = signals.acquire()
        second = engine.onboard(gpu, host, [2, 3], [6, 7], signal=handle)
        assert isinstance(first, IssuedTransfer) and isinstance(second, IssuedTransfer)
        engine.issue_deferred()   # no inline onboarding: nothing to issue, nothing queued
        inner.gate.set()
        first.wait(5)
        second.wait(5)
        handle.wait(5)
        handle.release()
        engine.close()
        names = {name for name, _, _ in inner.issued}
        assert names == {"layerflow-copy-issue"}
        assert inner.deferred == ["layerflow-copy-issue"] * 2   # each thread job leaves nothing deferred
        check_onboarded(gpu, host, [0, 1, 2, 3], [4, 5, 6, 7])
    finally:
        inner.gate.set()
        engine.close()
        signals.close()


def test_an_inline_offload_is_issued_on_the_callers_thread():
    inner = Deferring()
    engine = IssueThreadCopyEngine(inner, CPU)
    try:
        gpu, host = make_tensors()
        for layer in gpu:
            layer.copy_(torch.randn(layer.shape))
        engine.inline = True
        transfer = engine.offload(gpu, host, [0, 1], [3, 4])
        assert not isinstance(transfer, IssuedTransfer)
        transfer.wait(5)
        assert inner.issued == [(threading.current_thread().name, "d2h", 0)]
        assert all(torch.equal(host[3 + i, layer], gpu[layer][i]) for layer in range(LAYERS) for i in range(2))
    finally:
        engine.close()
