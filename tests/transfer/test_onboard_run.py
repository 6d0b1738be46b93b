"""One-run onboarding: a placement that is one run on both sides is checked with plain ints and issued without a job
(on the CPU engine through the default `_onboard_run`, as a job of one run), any other placement takes the job path;
the same errors (byte-exact copies of every placement on both engines and the injected failures of one-run
onboardings: test_copy_engine.py)."""

import numpy as np
import pytest
import torch

from layerflow.transfer.copy_plan import Run, single_run
from layerflow.transfer.signals.eventfd import EventfdSignals
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.transfer.pages import BLOCKS, LAYERS, PAGES, POISON, check_onboarded, make_tensors


@pytest.fixture
def engine():
    eng = ThreadCopyEngine()
    yield eng
    eng.close()


@pytest.mark.parametrize("pages,blocks,run", [
    ([3, 4, 5], (7, 8, 9), Run(3, 7, 3)),
    ((0,), [19], Run(0, 19, 1)),
    ([3, 4, 6], [7, 8, 9], None),          # a break on the GPU side
    ([3, 4], [7, 8, 9], None),             # lengths differ
    (np.arange(3), [0, 1, 2], None),       # numpy takes the job path
    ([], [], None),
])
def test_single_run_finds_only_plain_int_runs(pages, blocks, run):
    assert single_run(pages, blocks) == run


def test_a_run_plans_like_its_pages():
    plan = Run(4, 9, 3).plan()
    assert plan.gpu_pages.tolist() == [4, 5, 6] and plan.host_blocks.tolist() == [9, 10, 11]
    assert (plan.run_gpu.tolist(), plan.run_host.tolist(), plan.run_len.tolist()) == ([4], [9], [3])


def test_a_one_run_onboarding_refuses_a_run_past_either_end_and_a_signal_too_short(engine):
    gpu, host = make_tensors()
    with pytest.raises(ValueError, match=f"gpu_pages: index {PAGES} out of range"):
        engine.onboard(gpu, host, list(range(PAGES - 2, PAGES + 1)), [0, 1, 2])
    with pytest.raises(ValueError, match=f"host_blocks: index {BLOCKS} out of range"):
        engine.onboard(gpu, host, [0, 1], [BLOCKS - 1, BLOCKS])
    signals = EventfdSignals(LAYERS, num_counters=1, timeout_s=5.0)
    try:
        handle = signals.acquire()
        with pytest.raises(ValueError, match=f"first_layer=1: layers 1..{LAYERS}"):
            engine.onboard(gpu, host, [0, 1], [2, 3], signal=handle, first_layer=1)
        handle.release()
    finally:
        signals.close()
    assert bool(all((layer == POISON).all() for layer in gpu))


@pytest.mark.gpu
def test_the_timed_engine_marks_every_layer_of_a_one_run_onboarding():
    from layerflow.bench.copy_timing import Marks, TimedCudaCopyEngine, TimedTransfer

    engine = TimedCudaCopyEngine(Marks.LAYERS)
    issued = []
    engine.on_layer_issued = issued.append
    try:
        gpu, host = make_tensors("cuda")
        transfer = engine.onboard(gpu, host, [0, 1, 2], [5, 6, 7])
        transfer.wait(5)
        assert isinstance(transfer, TimedTransfer) and len(transfer.events) == LAYERS + 1
        assert issued == list(range(LAYERS))
        check_onboarded(gpu, host, [0, 1, 2], [5, 6, 7])
    finally:
        engine.close()
