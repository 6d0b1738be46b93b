"""Per-layer signals: ordering against the copies, ring isolation and wrap-around, timeouts, poison."""

import contextlib
import ctypes
import os
import select
import threading
import time

import pytest
import torch

from layerflow.config import SignalMode
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.eventfd import EventfdSignals
from layerflow.transfer.signals import SIGNALS, make_signals
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.faults import FaultyCudaCopyEngine, FaultyThreadCopyEngine

LAYERS, PAGES, PAGE, HEADS, DIM = 4, 16, 4, 2, 8


def tensors(seed, layers=LAYERS, pages=PAGES, device="cpu", page=PAGE, heads=HEADS, dim=DIM, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randn((pages, layers, 2, page, heads, dim), generator=gen).to(dtype)
    if device != "cpu":
        host = host.pin_memory()
    gpu = [torch.full((pages, 2, page, heads, dim), float("nan"), dtype=dtype, device=device) for _ in range(layers)]
    return gpu, host


def landed(gpu, host, layer, pages=PAGES):
    """Layer `layer` of an identity placement holds the host bytes."""
    return torch.equal(gpu[layer][:pages].cpu(), host[:pages, layer])


def slow(seconds):
    return lambda layer: time.sleep(seconds)


@pytest.fixture
def ring():
    signals = EventfdSignals(LAYERS, num_counters=2, timeout_s=5.0)
    yield signals
    signals.close()


def test_layer_never_observed_before_its_copy(ring):
    engine = FaultyThreadCopyEngine(before_layer=slow(0.02))
    try:
        gpu, host = tensors(0)
        handle = ring.acquire()
        seen = []

        def waiter():
            for layer in range(LAYERS):
                handle.wait_layer(layer)
                seen.append(landed(gpu, host, layer))

        thread = threading.Thread(target=waiter)
        thread.start()
        engine.onboard(gpu, host, range(PAGES), range(PAGES), handle).wait(5)
        thread.join(5)
        assert seen == [True] * LAYERS
        handle.release()
    finally:
        engine.close()


def test_back_to_back_onboardings_never_mix(ring):
    engine = FaultyThreadCopyEngine(before_layer=slow(0.01))
    try:
        (gpu_a, host_a), (gpu_b, host_b) = tensors(1), tensors(2)
        first, second = ring.acquire(), ring.acquire()
        assert first.counter_id != second.counter_id
        engine.onboard(gpu_a, host_a, range(PAGES), range(PAGES), first)
        engine.onboard(gpu_b, host_b, range(PAGES), range(PAGES), second)
        for layer in range(LAYERS):
            second.wait_layer(layer)
            assert landed(gpu_b, host_b, layer), f"layer {layer} of the second onboarding released early"
        assert all(landed(gpu_a, host_a, layer) for layer in range(LAYERS))
    finally:
        engine.close()


def test_ring_wraps_around_and_reuses_counters_cleanly(ring):
    engine = ThreadCopyEngine()
    try:
        counters = []
        for seed in range(5):
            gpu, host = tensors(seed)
            handle = ring.acquire()
            counters.append(handle.counter_id)
            engine.onboard(gpu, host, range(PAGES), range(PAGES), handle)
            handle.wait()
            assert all(landed(gpu, host, layer) for layer in range(LAYERS))
            handle.release()
        assert counters == [0, 1, 0, 1, 0]
    finally:
        engine.close()


def test_reacquired_counter_starts_unsignalled(ring):
    handle = ring.acquire()
    for layer in range(LAYERS):
        handle.complete_layer(layer)
    handle.release()
    ring.acquire().release()
    again = ring.acquire()
    assert again.counter_id == handle.counter_id
    for layer in range(LAYERS):
        assert not select.select([again.eventfd(layer)], [], [], 0)[0], "stale count leaked into the next use"
    with pytest.raises(TransferError, match="re-acquired"):
        handle.wait_layer(0)


def test_busy_counter_blocks_acquire_with_an_error(ring):
    ring.acquire()
    ring.acquire()
    with pytest.raises(TransferError, match="counter 0 still in use"):
        ring.acquire(timeout=0.05)


def test_timeout_raises_naming_layer_and_counter(ring):
    handle = ring.acquire()
    with pytest.raises(TransferError, match=r"layer 2 of signal counter 0 not signalled within"):
        handle.wait_layer(2, timeout=0.05)


def test_injected_failure_releases_every_waiter_with_the_error(ring):
    engine = FaultyThreadCopyEngine(fail_at_layer=1, before_layer=slow(0.02))
    try:
        gpu, host = tensors(3)
        handle = ring.acquire()
        outcomes = [None] * LAYERS

        def waiter(layer):
            try:
                handle.wait_layer(layer, timeout=1.0)
                outcomes[layer] = "ok"
            except TransferError as exc:
                outcomes[layer] = str(exc)

        threads = [threading.Thread(target=waiter, args=(layer,)) for layer in range(LAYERS)]
        for thread in threads:
            thread.start()
        transfer = engine.onboard(gpu, host, range(PAGES), range(PAGES), handle)
        for thread in threads:
            thread.join(2)
        assert outcomes[0] == "ok"
        for layer in range(1, LAYERS):
            assert "poisoned" in outcomes[layer] and "injected failure at layer 1" in outcomes[layer], outcomes[layer]
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            transfer.wait(1.0)
        status = ctypes.c_int32.from_address(handle.status_address).value
        assert status != 0
        assert handle.error is transfer.error
    finally:
        engine.close()


def test_raw_eventfd_counts_one_post_per_layer(ring):
    engine = ThreadCopyEngine()
    try:
        gpu, host = tensors(4)
        handle = ring.acquire()
        engine.onboard(gpu, host, range(PAGES), range(PAGES), handle).wait(5)
        for layer in range(LAYERS):
            assert os.eventfd_read(handle.eventfd(layer)) == 1
            assert not select.select([handle.eventfd(layer)], [], [], 0)[0]
        assert ctypes.c_int32.from_address(handle.status_address).value == 0
    finally:
        engine.close()


def test_non_layerwise_releases_all_layers_at_the_end(ring):
    engine = FaultyThreadCopyEngine(before_layer=slow(0.01))
    try:
        gpu, host = tensors(5)
        handle = ring.acquire(layerwise=False)
        engine.onboard(gpu, host, range(PAGES), range(PAGES), handle)
        handle.wait_layer(0)
        assert landed(gpu, host, LAYERS - 1), "a non-layerwise handle released layer 0 before the last layer"
    finally:
        engine.close()


def test_eventfd_mode_has_no_gpu_wait(ring):
    with pytest.raises(TransferError, match="no GPU-side wait"):
        ring.acquire().gpu_wait_layer(0, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("mode", [SignalMode.EVENT, SignalMode.WAITVALUE])
def test_cuda_modes_need_cuda(mode):
    with pytest.raises(TransferError, match="needs a CUDA GPU"):
        make_signals(mode, LAYERS)


# GPU ---------------------------------------------------------------------------------------------------------------

BIG = dict(layers=LAYERS, pages=512, device="cuda", page=32, heads=4, dim=128, dtype=torch.bfloat16)


@contextlib.contextmanager
def gpu_ring(mode: SignalMode, fail_at_layer: int | None = None):
    """A two-counter signal ring and a CUDA copy engine (failing at `fail_at_layer`), both closed afterwards."""
    ring, engine = make_signals(mode, LAYERS, num_counters=2), FaultyCudaCopyEngine(fail_at_layer=fail_at_layer)
    try:
        yield ring, engine
    finally:
        engine.close()
        ring.close()


def assert_snapshot_is_host(snapshot, host, *context) -> None:
    """Every layer the GPU waiter copied after its wait holds that layer's host bytes."""
    for layer in range(LAYERS):
        assert torch.equal(snapshot[layer].cpu(), host[:, layer]), (*context, layer)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(SIGNALS))
@pytest.mark.parametrize("layerwise", [True, False])
def test_gpu_host_wait_every_mode(mode, layerwise):
    with gpu_ring(mode) as (ring, engine):
        for seed in range(3):
            gpu, host = tensors(seed, **BIG)
            handle = ring.acquire(layerwise=layerwise)
            engine.onboard(gpu, host, range(512), range(512), handle)
            for layer in range(LAYERS):
                handle.wait_layer(layer)
                assert landed(gpu, host, layer, 512), (mode, seed, layer)
            handle.release()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [SignalMode.EVENT, SignalMode.WAITVALUE])
def test_gpu_stream_wait(mode):
    with gpu_ring(mode) as (ring, engine):
        stream = torch.cuda.Stream()
        for seed in range(3):
            gpu, host = tensors(seed, **BIG)
            snapshot = [torch.empty_like(layer) for layer in gpu]
            torch.cuda.synchronize()
            handle = ring.acquire()
            engine.onboard(gpu, host, range(512), range(512), handle)
            with torch.cuda.stream(stream):
                for layer in range(LAYERS):
                    handle.gpu_wait_layer(layer, stream.cuda_stream)
                    snapshot[layer].copy_(gpu[layer])
            stream.synchronize()
            assert_snapshot_is_host(snapshot, host, mode, seed)
            handle.wait()
            handle.release()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [SignalMode.EVENT, SignalMode.WAITVALUE])
def test_captured_graph_replays_for_two_onboardings(mode):
    with gpu_ring(mode) as (ring, engine):
        gpu, _ = tensors(0, **BIG)
        snapshot = [torch.empty_like(layer) for layer in gpu]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            capture_stream = torch.cuda.current_stream().cuda_stream
            for layer in range(LAYERS):
                ring.capture_gpu_wait(layer, capture_stream)
                snapshot[layer].copy_(gpu[layer])
        for seed in (11, 12):
            _, host = tensors(seed, **BIG)
            for layer in gpu:
                layer.fill_(float("nan"))
            # An onboarding does not wait for the current stream (its pages belong to no queued kernel), so the
            # NaN fill must be done before the copies start, or it may overwrite pages that already landed.
            torch.cuda.synchronize()
            handle = ring.acquire()
            engine.onboard(gpu, host, range(512), range(512), handle)
            stream = torch.cuda.current_stream()
            ring.prepare_replay(handle, stream.cuda_stream)
            graph.replay()
            stream.synchronize()
            assert_snapshot_is_host(snapshot, host, mode, seed)
            handle.wait()
            handle.release()


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True])
def test_a_replay_waiting_on_layers_posted_from_the_host_completes(native, monkeypatch):
    """An onboarding whose users were all read back from SSD posts its layers from the host (no copy stream): the
    captured waits (which spin on the capture words, not the counter words) must see those posts too."""
    monkeypatch.setenv("LAYERFLOW_WAITVALUE_POST", "native" if native else "bindings")
    ring = make_signals(SignalMode.WAITVALUE, LAYERS, num_counters=2)
    try:
        marks = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            capture_stream = torch.cuda.current_stream().cuda_stream
            for layer in range(LAYERS):
                ring.capture_gpu_wait(layer, capture_stream)
                marks[layer].add_(1)
        for replay in range(1, 3):
            handle = ring.acquire()
            for layer in range(LAYERS):
                handle.complete_layer(layer)
            stream = torch.cuda.current_stream()
            ring.prepare_replay(handle, stream.cuda_stream)
            graph.replay()
            done = torch.cuda.Event()
            done.record(stream)
            deadline = time.monotonic() + 10
            while not done.query():
                assert time.monotonic() < deadline, f"replay {replay} still waits on host-posted layers"
                time.sleep(0.001)
            assert marks.tolist() == [replay] * LAYERS
            handle.wait()
            handle.release()
    finally:
        ring.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(SIGNALS))
def test_gpu_injected_failure_poisons_every_mode(mode):
    with gpu_ring(mode, fail_at_layer=2) as (ring, engine):
        gpu, host = tensors(0, **BIG)
        handle = ring.acquire()
        transfer = engine.onboard(gpu, host, range(512), range(512), handle)
        for layer in (2, 3):
            with pytest.raises(TransferError, match="poisoned.*injected failure at layer 2"):
                handle.wait_layer(layer, timeout=1.0)
        with pytest.raises(TransferError, match="layer 2"):
            transfer.wait(5)
        assert landed(gpu, host, 1, 512), "layers before the failure must still land"
