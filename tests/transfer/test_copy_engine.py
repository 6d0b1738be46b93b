"""Copy engines: byte-exact onboarding/offload for contiguous and fragmented placements, run planning, failures."""

import threading

import numpy as np
import pytest
import torch

from layerflow.transfer.copy_plan import plan_runs, ramp_bounds
from layerflow.transfer.errors import TransferError
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.faults import FaultyCudaCopyEngine, FaultyThreadCopyEngine
from tests.transfer.pages import (BLOCKS, LAYERS, PAGES, PLACEMENTS, POISON, check_offload_of_new_contents,
                                  check_offloaded, check_onboarded, make_tensors)


@pytest.fixture
def engine():
    eng = ThreadCopyEngine()
    yield eng
    eng.close()


def test_plan_runs_splits_where_either_side_breaks():
    plan = plan_runs([4, 5, 6, 9, 10, 11, 2], [0, 1, 2, 3, 7, 8, 9])
    assert plan.run_gpu.tolist() == [4, 9, 10, 2]
    assert plan.run_host.tolist() == [0, 3, 7, 9]
    assert plan.run_len.tolist() == [3, 1, 2, 1]
    assert plan_runs(range(100, 164), range(64)).num_runs == 1
    assert plan_runs((5, 7, 6, 8), [0, 1, 2, 3]).run_len.tolist() == [1, 1, 1, 1]   # its ends span a run, it is not one
    assert plan_runs([], []).num_runs == 0


@pytest.mark.parametrize("pages,blocks", [((7, 8, 9), [3, 4, 5]), ([0], (0,)), (tuple(range(64)), range(64)),
                                          (tuple(range(65)), tuple(range(1, 66))), ((7, 8, 10), (3, 4, 5)),
                                          (tuple(range(9, 521)), list(range(512))), ([3, 4], (0, 2))])
def test_a_short_run_of_ints_plans_like_its_arrays(pages, blocks):
    """Short tuples and lists that are one run are recognised on the Python ints: the same plan as numpy's path."""
    plan, arrays = plan_runs(pages, blocks), plan_runs(np.array(pages), np.array(blocks))
    for name in ("gpu_pages", "host_blocks", "run_gpu", "run_host", "run_len"):
        got, want = getattr(plan, name), getattr(arrays, name)
        assert got.dtype == np.int64 and got.tolist() == want.tolist(), name


@pytest.mark.parametrize("pages,match", [((-1, 0), "gpu_pages: negative index -1"),
                                         ((True, False), "gpu_pages: expected a 1-D sequence of ints"),
                                         ((2.0, 3.0), "gpu_pages: expected a 1-D sequence of ints")])
def test_a_run_of_bad_indices_is_refused(pages, match):
    with pytest.raises(ValueError, match=match):
        plan_runs(pages, (0, 1))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_thread_onboard_byte_exact(engine, placement):
    pages, blocks = PLACEMENTS[placement]
    gpu, host = make_tensors()
    engine.onboard(gpu, host, pages, blocks).wait(5)
    check_onboarded(gpu, host, pages, blocks)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_thread_offload_byte_exact(engine, placement):
    pages, blocks = PLACEMENTS[placement]
    gpu, host = make_tensors(seed=1)
    for layer in gpu:
        layer.copy_(torch.randn(layer.shape))
    before = host.clone()
    transfer = engine.offload(gpu, host, pages, blocks)
    transfer.wait(5)
    assert transfer.done() and transfer.error is None
    check_offloaded(gpu, host, before, pages, blocks)


def test_bad_inputs_raise_value_error(engine):
    gpu, host = make_tensors()
    with pytest.raises(ValueError, match="gpu_pages"):
        engine.onboard(gpu, host, [PAGES], [0])
    with pytest.raises(ValueError, match="host_blocks"):
        engine.onboard(gpu, host, [0], [BLOCKS])
    with pytest.raises(ValueError, match="twice"):
        engine.onboard(gpu, host, [1, 1], [0, 2])
    with pytest.raises(ValueError, match="entries"):
        engine.onboard(gpu, host, [1, 2], [0])
    with pytest.raises(ValueError, match="host"):
        engine.onboard(gpu[:2], host, [1], [0])
    # The layout of a tensor set is checked once per engine; another set is checked again.
    with pytest.raises(ValueError, match=r"gpu_layers\[1\]"):
        engine.onboard([gpu[0], gpu[1].double(), *gpu[2:]], host, [1], [0])


def test_injected_failure_keeps_earlier_layers_and_reports():
    engine = FaultyThreadCopyEngine(fail_at_layer=1)
    try:
        gpu, host = make_tensors()
        transfer = engine.onboard(gpu, host, [0, 1], [2, 3])
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            transfer.wait(5)
        assert transfer.done() and isinstance(transfer.error, TransferError)
        assert torch.equal(gpu[0][0], host[2, 0])
        assert bool((gpu[1] == POISON).all())
    finally:
        engine.close()


def test_injected_offload_failure_keeps_earlier_layers_and_reports():
    engine = FaultyThreadCopyEngine()
    try:
        gpu, host = make_tensors(seed=2)
        for layer in gpu:
            layer.copy_(torch.randn(layer.shape))
        before = host.clone()
        engine.fail_at_layer = 1  # set between transfers, as the runtime tests do
        transfer = engine.offload(gpu, host, [4, 5], [0, 1])
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            transfer.wait(5)
        assert torch.equal(host[[0, 1], 0], gpu[0][[4, 5]])
        assert torch.equal(host[:, 1:], before[:, 1:])
        engine.fail_at_layer = None
        engine.offload(gpu, host, [4, 5], [0, 1]).wait(5)
        check_offloaded(gpu, host, before, [4, 5], [0, 1])
    finally:
        engine.close()


def test_before_layer_runs_on_the_worker_before_each_layer_copy():
    gpu, host = make_tensors()
    seen = []

    def before(layer):
        copied = [bool(torch.equal(gpu[l][3], host[7, l])) for l in range(LAYERS)]
        seen.append((threading.current_thread().name, layer, copied))

    engine = FaultyThreadCopyEngine()
    try:
        engine.before_layer = before
        engine.onboard(gpu, host, [3], [7]).wait(5)
        engine.offload(gpu, host, [3], [7]).wait(5)
    finally:
        engine.close()
    onboard = [("layerflow-h2d", l, [i < l for i in range(LAYERS)]) for l in range(LAYERS)]
    offload = [("layerflow-d2h", l, [True] * LAYERS) for l in range(LAYERS)]
    assert seen == onboard + offload


def test_copy_error_becomes_transfer_error():
    def broken(layer):
        if layer == 2:
            raise OSError("disk on fire")

    engine = FaultyThreadCopyEngine(before_layer=broken)
    try:
        gpu, host = make_tensors()
        transfer = engine.offload(gpu, host, [0], [0])
        with pytest.raises(TransferError, match="disk on fire"):
            transfer.wait(5)
    finally:
        engine.close()


# GPU ---------------------------------------------------------------------------------------------------------------

GPU_PLACEMENTS = {
    "contiguous": (np.arange(10, 200), np.arange(40, 230)),
    "fragmented": (np.random.default_rng(0).permutation(256)[:190], np.random.default_rng(1).permutation(240)[:190]),
    "runs": (np.r_[0:50, 100:150, 60:90], np.r_[200:250, 0:50, 120:150]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["AUTO", "RUNS", "PAGES", "RUN_BATCH"])
@pytest.mark.parametrize("placement", GPU_PLACEMENTS)
def test_cuda_onboard_offload_byte_exact(placement, path):
    from layerflow.transfer.cuda_copy import CopyPath, CudaCopyEngine

    pages, blocks = (a.tolist() for a in GPU_PLACEMENTS[placement])
    engine = CudaCopyEngine(path=CopyPath[path])
    try:
        gpu, host = make_tensors("cuda", pages=256, blocks=256, layers=4, page=32, heads=4, dim=64,
                                 dtype=torch.bfloat16)
        engine.onboard(gpu, host, pages, blocks).wait(10)
        check_onboarded(gpu, host, pages, blocks)
        check_offload_of_new_contents(engine, gpu, host, pages, blocks)
    finally:
        engine.close()


@pytest.mark.gpu
def test_cuda_injected_failure_reports():
    engine = FaultyCudaCopyEngine(fail_at_layer=2)
    try:
        gpu, host = make_tensors("cuda")
        transfer = engine.onboard(gpu, host, [0, 1], [2, 3])
        with pytest.raises(TransferError, match="injected failure at layer 2"):
            transfer.wait(5)
        assert torch.equal(gpu[1][1].cpu(), host[3, 1])
        assert bool((gpu[2] == POISON).all())

        before = host.clone()
        engine.fail_at_layer = 1
        transfer = engine.offload(gpu, host, [0, 1], [5, 6])
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            transfer.wait(5)
        assert torch.equal(host[[5, 6], 0], gpu[0][[0, 1]].cpu())
        assert torch.equal(host[:, 1:], before[:, 1:])
    finally:
        engine.close()


@pytest.mark.parametrize("destinations,sources,duplicate", [
    ([0, 1, 2, 3], [4, 5, 6, 7], False),                 # one run
    ([9, 10, 0, 1, 5], [0, 1, 2, 3, 4], False),          # disjoint runs out of order
    ([0, 1, 2, 3, 4, 5, 1], [0, 1, 2, 3, 4, 5, 9], True),  # a later run inside the first one
    ([0, 1, 2, 3, 4, 9, 3], [0, 1, 2, 3, 4, 5, 6], True),  # overlap with a run that is not the next by start
    ([6, 2, 6], [0, 1, 2], True),
])
def test_duplicate_destinations_are_refused_in_either_direction(engine, destinations, sources, duplicate):
    """The first list holds the destinations: GPU pages when onboarding, host blocks when offloading."""
    gpu, host = make_tensors()
    for call, pages, blocks in ((engine.onboard, destinations, sources), (engine.offload, sources, destinations)):
        if duplicate:
            with pytest.raises(ValueError, match="appears twice"):
                call(gpu, host, pages, blocks)
        else:
            call(gpu, host, pages, blocks).wait(5)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 11, 12, 64, 512, 1000])
def test_ramp_bounds_cover_the_batch_in_doubling_chunks_without_a_short_tail(n):
    bounds = ramp_bounds(n)
    sizes = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == n
    assert (sizes > 0).all()
    assert n == 0 or sizes[0] == min(8, n) or len(sizes) == 1
    assert (sizes[1:-1] == 2 * sizes[:-2]).all()  # every chunk but the last doubles the one before
    if len(sizes) > 1:
        assert 2 * sizes[-2] <= sizes[-1] < 6 * sizes[-2]  # the tail is folded into the last chunk


def test_auto_path_copies_runs_only_for_a_single_run():
    from layerflow.transfer.cuda_copy import CopyPath, resolved_path

    assert [resolved_path(CopyPath.AUTO, n) for n in (0, 1, 2, 55)] == [CopyPath.RUNS, CopyPath.RUNS,
                                                                        CopyPath.PAGES, CopyPath.PAGES]
    assert resolved_path(CopyPath.RUNS, 55) is CopyPath.RUNS
    assert resolved_path(CopyPath.PAGES, 1) is CopyPath.PAGES


def test_a_layouts_addresses_are_taken_with_its_check_and_renewed_for_new_tensors(engine):
    gpu, host = make_tensors()
    layers, addresses = engine._layout(gpu, host)
    assert layers == tuple(gpu)
    assert addresses.gpu_bases == tuple(t.data_ptr() for t in gpu)
    assert addresses.host_layers == tuple(host[0, layer].data_ptr() for layer in range(LAYERS))
    assert addresses.page_bytes == gpu[0][0].nbytes and addresses.block_pitch == host[0].nbytes
    assert engine._layout(gpu, host)[1] is addresses   # the same pool tensors: the memo's addresses
    other_gpu, other_host = make_tensors()
    renewed = engine._layout(other_gpu, other_host)[1]
    assert renewed.gpu_bases == tuple(t.data_ptr() for t in other_gpu)
    assert renewed.host_layers[0] == other_host.data_ptr()
