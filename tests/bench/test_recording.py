"""BenchCopyEngine over a real ThreadCopyEngine: what it records replays the same copies; skipped offloads copy
nothing."""

import torch

from layerflow.bench.recording import BenchCopyEngine
from layerflow.transfer.signals.eventfd import EventfdSignals
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.transfer.pages import LAYERS, POISON, check_onboarded, make_tensors


def test_onboardings_are_recorded_and_replay_the_same_copies():
    copy = BenchCopyEngine(ThreadCopyEngine())
    signals = EventfdSignals(LAYERS, num_counters=1, timeout_s=5.0)
    try:
        gpu, host = make_tensors()
        handle = signals.acquire()
        transfer = copy.onboard(gpu, host, [5, 2, 3], [0, 7, 8], handle)
        handle.wait()
        transfer.wait(5)
        handle.release()
        assert copy.transfers == [transfer] and len(copy.onboardings) == 1
        onboarding = copy.onboardings[0]
        assert onboarding.nbytes == 3 * LAYERS * gpu[0][0].numel() * 4
        for layer in gpu:
            layer.fill_(POISON)
        onboarding.issue(copy.inner).wait(5)  # again, alone: no signal
        check_onboarded(gpu, host, [5, 2, 3], [0, 7, 8])
        copy.forget()
        assert copy.onboardings == [] and copy.transfers == []
    finally:
        copy.close()
        signals.close()


def test_offloads_pass_through_unless_skipped():
    copy = BenchCopyEngine(ThreadCopyEngine())
    try:
        gpu, host = make_tensors(seed=1)
        for layer in gpu:
            layer.copy_(torch.randn(layer.shape))
        before = host.clone()
        copy.skip_offloads = True
        skipped = copy.offload(gpu, host, [0, 1], [4, 5])
        assert skipped.done() and skipped.error is None
        skipped.wait()
        assert torch.equal(host, before)
        copy.skip_offloads = False
        copy.offload(gpu, host, [0, 1], [4, 5]).wait(5)
        assert torch.equal(host[[4, 5], 2], gpu[2][[0, 1]])
        assert copy.onboardings == []  # offloads are not recorded
    finally:
        copy.close()
