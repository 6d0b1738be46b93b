"""An onboarding issued as a lead of layers and the rest later (transfer/layer_issue.py): how many layers lead, the
order of copies and posts across the two parts, a failure in either; on the H200 the CUDA engine's split: the rest
waits for issue_deferred (or the next transfer, or the transfer's own done), every layer lands byte-exact and is
signalled in order, a timed engine still marks every layer."""

import pytest
import torch

from layerflow.transfer.errors import TransferError
from layerflow.transfer.layer_issue import LayerIssue, lead_layers
from tests.transfer.pages import LAYERS, check_onboarded, make_tensors


@pytest.mark.parametrize("num_layers,layer_bytes,lead,expected", [
    (8, 4 << 20, 16 << 20, 4),    # fp8 2K-like layers: four hold the lead
    (8, 9 << 20, 16 << 20, 2),
    (8, 64 << 20, 16 << 20, 1),   # one long layer is lead enough
    (8, 1 << 10, 16 << 20, 8),    # never more than the layers there are
    (8, 4 << 20, None, 8),        # off: all at once
    (3, 0, 16 << 20, 3),          # nothing to size by: all at once
])
def test_the_lead_holds_the_bytes_asked_for(num_layers, layer_bytes, lead, expected):
    assert lead_layers(num_layers, layer_bytes, lead) == expected


class Posts:
    """A signal that records its posts and its poison next to the copies, in one log."""

    layerwise = True

    def __init__(self, log):
        self.log = log

    def complete_layer(self, layer, stream=None):
        self.log.append(("post", layer, stream))

    def fail(self, error, stream=None):
        self.log.append(("fail", str(error), stream))


def test_layers_are_copied_then_posted_in_order_across_the_two_parts():
    log, ends = [], []
    issue = LayerIssue(lambda layer: log.append(("copy", layer)), 4, Posts(log), 4, 9, ends.append)
    issue.issue(2)
    assert log == [("copy", 0), ("post", 4, 9), ("copy", 1), ("post", 5, 9)] and not issue.done and ends == []
    issue.issue(10)
    assert log[4:] == [("copy", 2), ("post", 6, 9), ("copy", 3), ("post", 7, 9)]
    assert issue.done and ends == [None]
    issue.issue(10)   # nothing left: no copy, no second finish
    assert len(log) == 8 and ends == [None]


def test_a_failure_in_the_rest_poisons_from_that_layer_and_finishes_with_it():
    log, ends = [], []

    def copy(layer):
        if layer == 2:
            raise RuntimeError("copy engine fault")
        log.append(("copy", layer))

    issue = LayerIssue(copy, 4, Posts(log), 0, 1, ends.append)
    issue.issue(2)
    issue.issue(4)
    assert log[-1][0] == "fail" and "issuing layer 2 failed" in log[-1][1]
    assert [e for e in log if e[0] == "post"] == [("post", 0, 1), ("post", 1, 1)]
    assert issue.done and len(ends) == 1 and isinstance(ends[0], TransferError)


@pytest.mark.gpu
def test_the_cuda_engine_leaves_the_rest_for_issue_deferred_and_the_next_transfer():
    from layerflow.transfer.cuda_copy import CudaCopyEngine
    from layerflow.transfer.signals.waitvalue import WaitValueSignals

    gpu, host = make_tensors("cuda")
    layer_bytes = gpu[0][0].numel() * gpu[0].element_size()
    engine = CudaCopyEngine(lead_bytes=layer_bytes * 3)   # three pages a layer below: one layer leads
    signals = WaitValueSignals(LAYERS, num_counters=3, timeout_s=5.0)   # three onboardings hold a counter each
    try:
        first = signals.acquire()
        transfer = engine.onboard(gpu, host, [0, 1, 2], [5, 6, 7], signal=first)
        assert signals._posted[first.counter_id] == [True] + [False] * (LAYERS - 1)
        engine.issue_deferred()
        assert signals._posted[first.counter_id] == [True] * LAYERS
        first.wait(5)
        transfer.wait(5)
        check_onboarded(gpu, host, [0, 1, 2], [5, 6, 7])
        # A second onboarding issues the first's rest before its own copies; its own rest waits for its done().
        third = signals.acquire()
        a = engine.onboard(gpu, host, [3, 4, 5], [8, 9, 10], signal=third)
        fourth = signals.acquire()
        b = engine.onboard(gpu, host, [6, 7, 8], [11, 12, 13], signal=fourth)
        assert signals._posted[third.counter_id] == [True] * LAYERS
        assert signals._posted[fourth.counter_id] == [True] + [False] * (LAYERS - 1)
        b.wait(5)
        a.wait(5)
        assert signals._posted[fourth.counter_id] == [True] * LAYERS and b.error is None
        check_onboarded(gpu, host, list(range(9)), list(range(5, 14)))
        for handle in (first, third, fourth):
            handle.release()
    finally:
        signals.close()
        engine.close()


@pytest.mark.gpu
def test_a_timed_engine_marks_every_layer_of_a_split_onboarding():
    from layerflow.bench.copy_timing import Marks, TimedCudaCopyEngine
    from layerflow.transfer.signals.waitvalue import WaitValueSignals

    engine = TimedCudaCopyEngine(Marks.LAYERS)
    engine.lead_bytes = 1
    issued = []
    engine.on_layer_issued = issued.append
    signals = WaitValueSignals(LAYERS, num_counters=1, timeout_s=5.0)
    try:
        gpu, host = make_tensors("cuda")
        handle = signals.acquire()
        engine.onboard(gpu, host, [0, 1, 2], [5, 6, 7], signal=handle)
        assert issued == [0]
        engine.issue_deferred()
        timed = engine.last_onboard
        timed.wait(5)
        assert issued == list(range(LAYERS)) and len(timed.events) == LAYERS + 1
        assert all(ms >= 0 for ms in timed.intervals_ms())
        check_onboarded(gpu, host, [0, 1, 2], [5, 6, 7])
        handle.release()
    finally:
        signals.close()
        engine.close()
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_event_signals_are_never_split():
    from layerflow.transfer.cuda_copy import CudaCopyEngine
    from layerflow.transfer.signals.event import EventSignals

    gpu, host = make_tensors("cuda")
    engine = CudaCopyEngine(lead_bytes=1)
    signals = EventSignals(LAYERS, num_counters=1, timeout_s=5.0)
    try:
        handle = signals.acquire()
        transfer = engine.onboard(gpu, host, [0, 1, 2], [5, 6, 7], signal=handle)
        assert signals._posted[handle.counter_id] == [True] * LAYERS and engine._deferred is None
        transfer.wait(5)
        check_onboarded(gpu, host, [0, 1, 2], [5, 6, 7])
        handle.release()
    finally:
        signals.close()
        engine.close()
