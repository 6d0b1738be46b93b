"""The CPU path's transfer probe: the recorded onboardings of a request issued again alone, timed per layer."""

from layerflow.bench.probes import HostTransferTimer
from layerflow.bench.recording import BenchCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.transfer.pages import LAYERS, check_onboarded, make_tensors


def test_host_timer_onboards_the_recorded_pages_again_with_a_time_per_layer():
    copy, timer = BenchCopyEngine(ThreadCopyEngine()), HostTransferTimer()
    try:
        gpu, host = make_tensors()
        copy.onboard(gpu, host, [2, 3], [9, 10]).wait(5)
        copy.onboard(gpu, host, [7], [0]).wait(5)
        fresh, _ = make_tensors()
        for layer, poisoned in zip(gpu, fresh):
            layer.copy_(poisoned)
        timing = timer.onboarding(copy.onboardings)
        check_onboarded(gpu, host, [2, 3, 7], [9, 10, 0])
        assert len(timing.layer_ms) == 2 * LAYERS and min(timing.layer_ms) >= 0
        assert sum(timing.layer_ms) <= timing.total_ms + 1e-9  # from the first layer's start to the end
        assert timing.nbytes == 3 * LAYERS * gpu[0][0].numel() * gpu[0].element_size()
        assert timer.bulk_ms(timing.nbytes) >= 0
    finally:
        copy.close()
        timer.close()
