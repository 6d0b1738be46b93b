"""The benchmarks' timed copy engines: host stamps per layer on the CPU path, CUDA timing events on the GPU; both
still copy exactly what the production engines copy."""

import pytest
import torch

from layerflow.bench.copy_timing import Marks, StampedThreadCopyEngine, TimedCudaCopyEngine
from tests.transfer.pages import check_offloaded, check_onboarded, make_tensors


def test_thread_engine_stamps_each_layer_start_in_order():
    engine = StampedThreadCopyEngine()
    try:
        gpu, host = make_tensors()
        engine.onboard(gpu, host, [4, 5, 1], [0, 1, 9]).wait(5)
        assert len(engine.stamps) == len(gpu) and engine.stamps == sorted(engine.stamps)
        check_onboarded(gpu, host, [4, 5, 1], [0, 1, 9])
        engine.stamps.clear()
        engine.offload(gpu, host, [], []).wait(5)  # an empty transfer still passes every layer
        assert len(engine.stamps) == len(gpu)
    finally:
        engine.close()


def test_marks_must_be_a_marks():
    with pytest.raises(ValueError, match="marks='layers'"):
        TimedCudaCopyEngine("layers")


@pytest.mark.gpu
@pytest.mark.parametrize("marks,count", [(Marks.TOTAL, 2), (Marks.LAYERS, 5)])
def test_cuda_timing_events_bracket_the_copies(marks, count):
    """TOTAL: a start and an end event; LAYERS: a start and one after each of the 4 layers, in order. Both ways."""
    gpu, host = make_tensors("cuda", pages=64, blocks=64, layers=4, page=32, heads=4, dim=64, dtype=torch.bfloat16)
    pages, blocks = list(range(64)), list(range(63, -1, -1))
    engine = TimedCudaCopyEngine(marks)
    try:
        transfer = engine.onboard(gpu, host, pages, blocks)
        assert len(transfer.events) == count
        marked = transfer.marks_ms()
        assert all(b >= a for a, b in zip(marked, marked[1:])) and marked[-1] > 0, marked
        assert transfer.intervals_ms() == pytest.approx([b - a for a, b in zip([0.0, *marked], marked)], abs=0.01)
        check_onboarded(gpu, host, pages, blocks)
        transfer.release()
        assert transfer.events == [] and transfer.done() and transfer.error is None

        for layer in gpu:
            layer.copy_(torch.randn(layer.shape, device="cuda"))
        before = host.clone()
        offload = engine.offload(gpu, host, pages, blocks)
        assert len(offload.marks_ms()) == count - 1
        check_offloaded(gpu, host, before, pages, blocks)
    finally:
        engine.close()
