"""The native eventfd wait node: on real eventfds (CPU) and as host nodes of a captured CUDA graph (GPU)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from layerflow.runtime import hostfn
from layerflow.runtime.hostfn import (
    PoisonWord,
    WaitSlots,
    WaitStatus,
    call_eventfd_wait,
    launch_eventfd_wait,
    post_eventfds_at,
)


@pytest.fixture
def efd():
    """A fresh non-blocking semaphore eventfd (non-blocking so tests can count it without hanging)."""
    fd = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK)
    yield fd
    os.close(fd)


def counter(fd: int) -> int:
    """Drain a non-blocking semaphore eventfd and return how many counts it held."""
    n = 0
    while True:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            return n
        n += 1


def wait(slots: WaitSlots, layer: int = 0) -> WaitStatus:
    slots.reset()
    call_eventfd_wait(slots.address(layer))
    return slots.status(layer)


def test_presignalled_consumes_exactly_one(efd):
    os.eventfd_write(efd, 3)
    slots = WaitSlots(1)
    slots.set(0, efd, 1000)
    before = time.monotonic_ns()
    assert wait(slots) is WaitStatus.OK
    assert slots.released_ns(0) >= before
    assert counter(efd) == 2


def test_blocking_fd_presignalled():
    fd = os.eventfd(0, os.EFD_SEMAPHORE)
    try:
        os.eventfd_write(fd, 1)
        slots = WaitSlots(1)
        slots.set(0, fd, 1000)
        assert wait(slots) is WaitStatus.OK
        os.set_blocking(fd, False)
        assert counter(fd) == 0
    finally:
        os.close(fd)


def test_released_after_a_later_write(efd):
    slots = WaitSlots(1)
    slots.set(0, efd, 10_000)
    written = []

    def post() -> None:
        time.sleep(0.05)
        written.append(time.monotonic_ns())
        os.eventfd_write(efd, 1)

    poster = threading.Thread(target=post)
    poster.start()
    assert wait(slots) is WaitStatus.OK
    poster.join()
    assert slots.released_ns(0) >= written[0]
    assert counter(efd) == 0


def test_never_written_times_out(efd):
    slots = WaitSlots(1)
    slots.set(0, efd, 50)
    start = time.monotonic_ns()
    assert wait(slots) is WaitStatus.TIMEOUT
    assert slots.released_ns(0) - start >= 50_000_000
    assert counter(efd) == 0


def test_poisoned_before_the_wait_leaves_the_count(efd):
    os.eventfd_write(efd, 1)
    poison = PoisonWord()
    poison.set()
    slots = WaitSlots(1)
    slots.set(0, efd, 10_000, poison.address)
    assert wait(slots) is WaitStatus.POISONED
    assert counter(efd) == 1


def test_poisoned_during_the_wait(efd):
    poison = PoisonWord()
    slots = WaitSlots(1)
    slots.set(0, efd, 10_000, poison.address)
    poisoner = threading.Timer(0.05, poison.set)
    poisoner.start()
    assert wait(slots) is WaitStatus.POISONED
    poisoner.join()
    assert poison


def test_cleared_poison_word_does_not_fail_the_wait(efd):
    poison = PoisonWord()
    poison.set()
    poison.clear()
    os.eventfd_write(efd, 1)
    slots = WaitSlots(1)
    slots.set(0, efd, 1000, poison.address)
    assert wait(slots) is WaitStatus.OK


def test_negative_fd_means_no_wait():
    slots = WaitSlots(2)
    slots.set(1, -1, 10_000)
    before = time.monotonic_ns()
    assert wait(slots, 1) is WaitStatus.OK
    assert slots.released_ns(1) >= before


def test_closed_fd_is_a_read_error():
    fd = os.eventfd(0)
    os.close(fd)
    slots = WaitSlots(1)
    slots.set(0, fd, 1000)
    assert wait(slots) is WaitStatus.READ_ERROR


def test_gil_is_released_during_the_wait(efd):
    """Only this thread, running Python, can release the wait: had the wait kept the GIL, it would time out."""
    slots = WaitSlots(1)
    slots.set(0, efd, 5_000)
    slots.reset()
    waiter = threading.Thread(target=call_eventfd_wait, args=(slots.address(0),))
    waiter.start()
    spins = 0
    deadline = time.monotonic() + 0.2  # many switch intervals: the waiter is inside the native wait by now
    while time.monotonic() < deadline:
        spins += 1
    assert slots.status(0) is WaitStatus.PENDING
    os.eventfd_write(efd, 1)
    waiter.join()
    assert slots.status(0) is WaitStatus.OK
    assert counter(efd) == 0


def test_slots_have_fixed_distinct_addresses_and_reset():
    slots = WaitSlots(4)
    addresses = [slots.address(layer) for layer in range(4)]
    assert len(set(addresses)) == 4
    slots.set(2, 7, 100)
    assert [slots.address(layer) for layer in range(4)] == addresses
    assert all(slots.status(layer) is WaitStatus.PENDING for layer in range(4))
    assert all(slots.released_ns(layer) == 0 for layer in range(4))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(layer=4, fd=3, timeout_ms=10),
        dict(layer=-1, fd=3, timeout_ms=10),
        dict(layer=0, fd=3, timeout_ms=0),
        dict(layer=0, fd=3, timeout_ms=2**31),
        dict(layer=0, fd=2**40, timeout_ms=10),
        dict(layer=0, fd=3, timeout_ms=10, poison_addr=-8),
    ],
)
def test_set_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        WaitSlots(4).set(**kwargs)


def test_bad_sizes_and_addresses_raise():
    with pytest.raises(ValueError, match="num_layers"):
        WaitSlots(0)
    with pytest.raises(ValueError, match="slot_addr"):
        call_eventfd_wait(0)
    with pytest.raises(ValueError, match="stream"):
        launch_eventfd_wait(-1, WaitSlots(1).address(0))
    with pytest.raises(ValueError, match="len"):
        post_eventfds_at([1, 2], [0])


def test_native_notifier_posts_at_the_given_times(efd):
    at = [time.monotonic_ns() + 2_000_000 * (i + 1) for i in range(3)]
    written = post_eventfds_at([efd] * 3, at)
    assert all(w >= a for w, a in zip(written, at))
    assert counter(efd) == 3


def test_shim_is_built_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERFLOW_CACHE_DIR", str(tmp_path))
    built = hostfn.build_shim()
    assert built.parent == tmp_path and built.suffix == ".so"
    assert hostfn.build_shim() == built


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="C compiler"):
        hostfn.build_shim()


# ---------------------------------------------------------------- GPU: host nodes in a captured graph

LAYERS = 8
WIDTH = 4096


def capture_layer_pipeline(slots: WaitSlots, host: torch.Tensor):
    """One graph: per layer a wait node, then a copy of that layer's pinned host row, then a kernel on it."""
    dev = torch.zeros_like(host, device="cuda")
    out = torch.zeros_like(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        for layer in range(LAYERS):
            launch_eventfd_wait(stream, slots.address(layer))
            dev[layer].copy_(host[layer], non_blocking=True)
            out[layer] = dev[layer] * 2 + 1
    return graph, out


@pytest.mark.gpu
def test_graph_wait_nodes_order_copies_after_posts():
    """Each layer's copy reads data written before its post: without the wait it would read the last replay's."""
    slots = WaitSlots(LAYERS)
    host = torch.zeros(LAYERS, WIDTH, pin_memory=True)
    graph, out = capture_layer_pipeline(slots, host)
    for replay in range(5):
        fds = [os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK) for _ in range(LAYERS)]
        no_wait = replay % LAYERS
        for layer, fd in enumerate(fds):
            slots.set(layer, -1 if layer == no_wait else fd, 2_000)
        host[no_wait].fill_(replay * 100 + no_wait)
        slots.reset()
        written = [0] * LAYERS

        def notify() -> None:
            for layer, fd in enumerate(fds):
                if layer == no_wait:
                    continue
                time.sleep(0.002)
                host[layer].fill_(replay * 100 + layer)
                written[layer] = time.monotonic_ns()
                os.eventfd_write(fd, 1)

        notifier = threading.Thread(target=notify)
        notifier.start()
        graph.replay()
        torch.cuda.synchronize()
        notifier.join()
        expected = torch.tensor([replay * 100 + layer for layer in range(LAYERS)], dtype=torch.float32)
        assert torch.equal(out.cpu(), (expected * 2 + 1)[:, None].expand(LAYERS, WIDTH))
        for layer, fd in enumerate(fds):
            assert slots.status(layer) is WaitStatus.OK
            if layer != no_wait:
                assert slots.released_ns(layer) >= written[layer]
                assert counter(fd) == 0
            os.close(fd)


@pytest.mark.gpu
def test_graph_poisoned_wait_completes_and_reports():
    slots = WaitSlots(LAYERS)
    host = torch.ones(LAYERS, WIDTH, pin_memory=True)
    graph, out = capture_layer_pipeline(slots, host)
    poison = PoisonWord()
    fds = [os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK) for _ in range(LAYERS)]
    for layer, fd in enumerate(fds):
        os.eventfd_write(fd, 1)
        slots.set(layer, fd, 2_000, poison.address if layer == 3 else 0)
    poison.set()
    slots.reset()
    graph.replay()
    torch.cuda.synchronize()
    statuses = [slots.status(layer) for layer in range(LAYERS)]
    assert statuses == [WaitStatus.POISONED if layer == 3 else WaitStatus.OK for layer in range(LAYERS)]
    assert [counter(fd) for fd in fds] == [1 if layer == 3 else 0 for layer in range(LAYERS)]
    for fd in fds:
        os.close(fd)


@pytest.mark.gpu
def test_eager_launch_runs_on_the_stream(efd):
    slots = WaitSlots(1)
    slots.set(0, efd, 10_000)
    slots.reset()
    os.eventfd_write(efd, 1)
    launch_eventfd_wait(torch.cuda.current_stream().cuda_stream, slots.address(0))
    torch.cuda.synchronize()
    assert slots.status(0) is WaitStatus.OK
    assert counter(efd) == 0
