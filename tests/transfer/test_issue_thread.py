"""The issue-thread copy engine: byte-exact both ways, FIFO issue on its own thread, a call that returns before the
issue, a failed issue failing its transfer alone, close() draining, and (GPU) an offload ordered after the caller's
stream."""

import threading
from dataclasses import replace

import pytest
import torch

from layerflow.config import Config, SignalMode, load_config
from layerflow.runtime.tiers import issues_on_copy_thread
from layerflow.transfer.copy_engine import CopyJob, Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.issue_thread import IssueThreadCopyEngine, _IssueQueue
from layerflow.transfer.signals import make_signals
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.transfer.pages import (LAYERS, PLACEMENTS, check_offload_of_new_contents, check_offloaded, check_onboarded,
                                  make_tensors)

CPU = torch.device("cpu")


class GatedEngine(ThreadCopyEngine):
    """Each issue waits for `gate`, then records (thread name, direction, first GPU page); `refuse` pages raise at
    issue instead of being copied."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.issued: list[tuple[str, str, int]] = []
        self.refuse: set[int] = set()
        self.closed = False

    def _note(self, job: CopyJob, direction: str) -> None:
        self.gate.wait(10)
        first = int(job.plan.gpu_pages[0])
        self.issued.append((threading.current_thread().name, direction, first))
        if first in self.refuse:
            raise OSError(f"refused page {first}")

    def _onboard(self, job: CopyJob) -> Transfer:
        self._note(job, "h2d")
        return super()._onboard(job)

    def _offload(self, job: CopyJob) -> Transfer:
        self._note(job, "d2h")
        return super()._offload(job)

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.fixture
def inner():
    engine = GatedEngine()
    yield engine
    engine.gate.set()
    engine.close()


@pytest.fixture
def engine(inner):
    wrapper = IssueThreadCopyEngine(inner, CPU, owns_inner=False)
    yield wrapper
    inner.gate.set()
    wrapper.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_onboard_and_offload_are_byte_exact(engine, placement):
    pages, blocks = PLACEMENTS[placement]
    gpu, host = make_tensors()
    engine.onboard(gpu, host, pages, blocks).wait(5)
    check_onboarded(gpu, host, pages, blocks)
    check_offload_of_new_contents(engine, gpu, host, pages, blocks)


def test_queued_onboardings_go_before_queued_offloads_each_in_order_on_the_issue_thread_only(engine, inner):
    gpu, host = make_tensors()
    inner.gate.clear()
    transfers = [engine.onboard(gpu, host, [5], [5])]   # taken by the thread at once: it waits at the gate
    transfers += [engine.offload(gpu, host, [4], [1]), engine.onboard(gpu, host, [2], [2]),
                  engine.offload(gpu, host, [7], [3]), engine.onboard(gpu, host, [9], [9])]
    assert not any(t.done() for t in transfers) and inner.issued == []
    inner.gate.set()
    for t in transfers:
        t.wait(5)
    assert inner.issued == [("layerflow-copy-issue", d, p) for d, p in
                            [("h2d", 5), ("h2d", 2), ("h2d", 9), ("d2h", 4), ("d2h", 7)]]


def test_an_onboarding_ordered_after_a_queued_offload_has_that_offload_issued_first(engine, inner):
    """Issue 19: `order_onboards_after` overrides "onboardings first" for the offloads it names (an evicted user's
    pages the next onboarding overwrites), so on a CUDA engine the H2D stream can wait for their event."""
    gpu, host = make_tensors()
    inner.gate.clear()
    first = engine.onboard(gpu, host, [5], [5])   # taken by the thread at once: it waits at the gate
    offload = engine.offload(gpu, host, [4], [1])
    later = engine.offload(gpu, host, [6], [2])
    engine.order_onboards_after([offload])
    onboard = engine.onboard(gpu, host, [4], [4])   # overwrites the page the offload reads
    inner.gate.set()
    for t in (first, offload, later, onboard):
        t.wait(5)
    assert [(d, p) for _, d, p in inner.issued] == [("h2d", 5), ("d2h", 4), ("h2d", 4), ("d2h", 6)]
    assert offload.issued and onboard.issued


def test_a_call_returns_before_its_copies_are_issued(engine, inner):
    gpu, host = make_tensors()
    inner.gate.clear()
    transfer = engine.onboard(gpu, host, [3], [7])
    with pytest.raises(TransferError, match="not issued within 0.05 s"):
        transfer.wait(0.05)
    assert not transfer.done() and transfer.error is None
    inner.gate.set()
    transfer.wait(5)
    assert transfer.done() and torch.equal(gpu[0][3], host[7, 0])


def test_bad_input_raises_in_the_caller_before_anything_is_queued(engine, inner):
    gpu, host = make_tensors()
    with pytest.raises(ValueError, match="gpu_pages: index 99 out of range"):
        engine.onboard(gpu, host, [99], [0])
    with pytest.raises(ValueError, match="host_blocks"):
        engine.offload(gpu, host, [0], [99])
    engine.onboard(gpu, host, [1], [1]).wait(5)
    assert [page for _, _, page in inner.issued] == [1]


def test_a_failed_issue_fails_its_transfer_alone_and_poisons_its_signal(engine, inner):
    ring = make_signals(SignalMode.EVENTFD, LAYERS, num_counters=2)
    try:
        gpu, host = make_tensors()
        inner.refuse = {6}
        refused, kept = ring.acquire(), ring.acquire()
        failing = engine.onboard(gpu, host, [6], [2], refused)
        following = engine.onboard(gpu, host, [8], [3], kept)
        with pytest.raises(TransferError, match="refused page 6"):
            failing.wait(5)
        assert failing.done() and isinstance(failing.error, TransferError)
        with pytest.raises(TransferError, match="refused page 6"):
            refused.wait_layer(0)
        following.wait(5)
        for layer in range(LAYERS):
            kept.wait_layer(layer)
            assert torch.equal(gpu[layer][8], host[3, layer])
        assert following.error is None
        refused.release()
        kept.release()
    finally:
        ring.close()


def test_close_drains_the_queue_closes_an_owned_inner_engine_then_refuses():
    inner = GatedEngine()
    engine = IssueThreadCopyEngine(inner, CPU)
    gpu, host = make_tensors()
    inner.gate.clear()
    transfers = [engine.onboard(gpu, host, [page], [page + 1]) for page in range(4)]
    threading.Timer(0.05, inner.gate.set).start()
    engine.close()
    assert inner.closed and all(t.done() and t.error is None for t in transfers)
    check_onboarded(gpu, host, list(range(4)), list(range(1, 5)))
    with pytest.raises(TransferError, match="closed"):
        engine.onboard(gpu, host, [0], [0])


def test_close_leaves_an_inner_engine_it_does_not_own_open(engine, inner):
    gpu, host = make_tensors()
    transfer = engine.onboard(gpu, host, [2], [4])
    engine.close()
    assert not inner.closed
    transfer.wait(5)
    assert torch.equal(gpu[0][2], host[4, 0])
    inner.onboard(gpu, host, [5], [6]).wait(5)


@pytest.mark.parametrize("text, expected", [("1", True), ("off", False)])
def test_the_config_key_falls_back_to_its_environment_variable(text, expected):
    assert load_config(env={"LAYERFLOW_COPY_THREAD": text}).copy_thread is expected
    with pytest.raises(ValueError, match="LAYERFLOW_COPY_THREAD='sometimes'"):
        load_config(env={"LAYERFLOW_COPY_THREAD": "sometimes"})


def test_a_failed_set_up_of_the_issue_thread_raises_in_the_constructing_thread():
    def broken() -> None:
        raise RuntimeError("no stream for this thread")

    queue = _IssueQueue("layerflow-copy-issue", broken)
    with pytest.raises(RuntimeError, match="no stream for this thread"):
        queue.start()
    with pytest.raises(TransferError, match="closed"):
        queue.submit(lambda: None, onboard=True)


def test_the_copy_thread_is_the_default_and_not_applied_where_a_read_back_could_be_signalled_out_of_order(tmp_path):
    assert Config().copy_thread and load_config(env={}).copy_thread
    config = Config(signal=SignalMode.WAITVALUE, ssd_cache_gb=1.0, ssd_cache_dir=str(tmp_path))
    assert not issues_on_copy_thread(config, SignalMode.WAITVALUE)
    assert not issues_on_copy_thread(replace(config, ssd_cache_gb=0.0, remote_url="redis://localhost:6379/0"),
                                     SignalMode.WAITVALUE)
    assert issues_on_copy_thread(replace(config, ssd_cache_gb=0.0), SignalMode.WAITVALUE)
    assert issues_on_copy_thread(config, SignalMode.EVENTFD)
    assert not issues_on_copy_thread(replace(config, copy_thread=False), SignalMode.EVENTFD)


def test_a_non_engine_is_refused():
    with pytest.raises(ValueError, match="expected a CopyEngine"):
        IssueThreadCopyEngine(object(), CPU)


# GPU ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_offload_waits_for_the_callers_stream_and_onboard_signals_each_layer():
    """Pages written on the caller's stream after a long GPU sleep are offloaded with their new bytes (the fence), and
    an onboarding through the issue thread releases each layer's waitvalue wait after its copies."""
    from layerflow.transfer.cuda_copy import CudaCopyEngine

    engine = IssueThreadCopyEngine(CudaCopyEngine(), torch.device("cuda"))
    ring = make_signals(SignalMode.WAITVALUE, 4, num_counters=2)
    try:
        gpu, host = make_tensors("cuda", pages=64, blocks=64, layers=4, page=32, heads=2, dim=64,
                                 dtype=torch.bfloat16)
        pages, blocks = list(range(3, 40)), list(range(10, 47))
        handle = ring.acquire()
        engine.onboard(gpu, host, pages, blocks, handle).wait(10)
        for layer in range(4):
            handle.wait_layer(layer)
        handle.release()
        check_onboarded(gpu, host, pages, blocks)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            for layer in gpu:
                layer.fill_(3.0)
            before = host.clone()
            transfer = engine.offload(gpu, host, pages, blocks)
        transfer.wait(10)
        check_offloaded([layer.cpu() for layer in gpu], host, before, pages, blocks)
        assert bool((host[blocks] == 3.0).all())
    finally:
        engine.close()
        ring.close()


@pytest.mark.gpu
@pytest.mark.parametrize("threaded", [False, True], ids=["cuda", "issue-thread"])
def test_gpu_an_onboarding_and_a_block_ordered_after_an_offload_wait_for_it_on_the_device(threaded):
    """Issue 19: an offload held behind ~tens of ms of work on a side stream still reads the old pages, although the
    onboarding into them and a kernel writing them were issued right after it (ordered, not host-waited)."""
    from layerflow.transfer.cuda_copy import CudaCopyEngine

    cuda = CudaCopyEngine()
    engine = IssueThreadCopyEngine(cuda, torch.device("cuda"), owns_inner=False) if threaded else cuda
    try:
        gpu, host = make_tensors("cuda", pages=16, blocks=16, layers=3, page=32, heads=2, dim=64)
        for layer in gpu:
            layer.copy_(torch.randn_like(layer))
        old = [layer.cpu() for layer in gpu]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            offload = engine.offload(gpu, host, [1, 2, 5], [0, 1, 2])
        engine.order_onboards_after([offload])
        onboard = engine.onboard(gpu, host, [1, 2], [8, 9])   # overwrites two of the pages the offload reads
        offload.order_before(torch.cuda.current_stream().cuda_stream)
        gpu[0][5].fill_(-1.0)   # a kernel on the caller's stream writing the third
        onboard.wait(10)
        offload.wait(10)
        for layer in range(3):
            for page, block in [(1, 0), (2, 1), (5, 2)]:
                assert torch.equal(host[block, layer], old[layer][page]), (layer, page)
            for page, block in [(1, 8), (2, 9)]:
                assert torch.equal(gpu[layer][page].cpu(), host[block, layer]), (layer, page)
        assert bool((gpu[0][5] == -1.0).all())
    finally:
        engine.close()
        if threaded:
            cuda.close()
