"""What the benchmark measures beside the requests, built from the engine's public pieces only.

- `BenchCopyEngine` wraps the engine's copy engine: it keeps the last request's onboarding jobs (so the same pages can
  be onboarded again, alone) and can skip offloads (`--only-onboard`).
- `Clock` stamps time on the device the engine runs on: CUDA events on the GPU, perf_counter on the CPU path.
- `LayerClock` is a layer wait that waits for nothing and stamps each layer's start: the per-layer compute times.
- `TransferTimer` onboards recorded jobs alone (per-layer times) and times a bulk memcpy of the same bytes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.engine import Engine
from layerflow.runtime.waits import LayerWait
from layerflow.runtime.request import Request
from layerflow.bench.stats import layer_times
from layerflow.transfer.copy_engine import CopyEngine, CopyJob, Transfer

T = TypeVar("T")
HOLD_CYCLES = 50_000_000  # ~25 ms of GPU sleep: long enough to queue a whole eager block behind it


class _Skipped(Transfer):
    """An offload that was not issued (`--only-onboard`): done at once, with no error."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass


class BenchCopyEngine(CopyEngine):
    """Delegates to `inner`; records every onboarding (job and transfer) since `forget()`, skips offloads while
    asked to, and drops the timing events of offloads (only onboardings are timed)."""

    def __init__(self, inner: CopyEngine) -> None:
        super().__init__()
        self.inner = inner
        self.skip_offloads = False
        self.onboardings: list[CopyJob] = []
        self.transfers: list[Transfer] = []

    def forget(self) -> None:
        self.onboardings, self.transfers = [], []

    def close(self) -> None:
        self.inner.close()

    def _onboard(self, job: CopyJob) -> Transfer:
        self.onboardings.append(job)
        transfer = self.inner._onboard(job)
        self.transfers.append(transfer)
        return transfer

    def _offload(self, job: CopyJob) -> Transfer:
        if self.skip_offloads:
            return _Skipped()
        transfer = self.inner._offload(job)
        for event in getattr(transfer, "timing_events", ()):
            _destroy_event(event)
        return transfer


def _destroy_event(event) -> None:
    """Only CUDA transfers carry timing events; a recorded event may be destroyed before it completes."""
    from layerflow.transfer import cuda_api
    cuda_api.destroy_event(event)


class Clock(ABC):
    """Time stamps in the order work reaches the device; `ms(a, b)` once `sync()` returned."""

    @abstractmethod
    def stamp(self) -> object: ...

    @abstractmethod
    def ms(self, start: object, end: object) -> float: ...

    @abstractmethod
    def sync(self) -> None: ...

    def hold(self) -> None:
        """Keep the device busy for a while so the host queues what follows before the device reaches it."""

    def time(self, fn: Callable[[], T]) -> tuple[float, float | None, T]:
        """(wall ms, device ms or None, result) of `fn()`; the device figure spans the stream around the call."""
        start = self.stamp()
        t0 = time.perf_counter()
        result = fn()
        wall = (time.perf_counter() - t0) * 1e3
        end = self.stamp()
        self.sync()
        return wall, self.device_ms(start, end), result

    def device_ms(self, start: object, end: object) -> float | None:
        return None


class HostClock(Clock):
    """The CPU path: eager and synchronous, so the host's clock is the device's."""

    def stamp(self) -> float:
        return time.perf_counter()

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def sync(self) -> None:
        pass


class CudaClock(Clock):
    """CUDA timing events on the current stream."""

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def sync(self) -> None:
        torch.cuda.current_stream().synchronize()

    def hold(self) -> None:
        torch.cuda._sleep(HOLD_CYCLES)

    def device_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return self.ms(start, end)


class LayerClock(LayerWait):
    """A wait that waits for nothing: it stamps the moment each layer would wait for its KV."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.stamps: list[object] = []

    def layer(self, layer: int) -> None:
        self.stamps.append(self.clock.stamp())


def layer_compute_ms(engine: Engine, clock: Clock, requests: list[Request], bucket: Bucket) -> list[float]:
    """Per-layer compute of a GPU-hit batch (wait point of layer l to that of l+1; the last runs to the scores).

    The block runs eagerly behind a device hold, so launch gaps do not count; the batch is then aborted, which leaves
    the users' histories (and their GPU residency) as they were.
    """
    plan = engine.kv.prepare(requests)
    try:
        bufs = BatchBuffers(bucket, engine.max_pages, engine.device)
        bufs.fill(plan.batch, plan.page_rows)
        waits = LayerClock(clock)
        clock.hold()
        engine.pipeline.forward(bufs, waits)
        end = clock.stamp()
        clock.sync()
    finally:
        engine.kv.abort(plan)
    base = waits.stamps[0]
    return layer_times([clock.ms(base, s) for s in waits.stamps], clock.ms(base, end))


@dataclass(frozen=True)
class Timeline:
    """Where one layerwise request's time went (ms, one device clock): score entry -> first copy issued, first
    copy -> last layer landed (in the pipelined run), last layer landed -> scores returned."""

    issue_ms: float
    transfer_ms: float
    tail_ms: float
    layer_ms: tuple[float, ...]


class TimelineMarks:
    """CUDA events at score entry and exit on the compute stream, read against the onboarding's timing events."""

    def __init__(self) -> None:
        from layerflow.transfer import cuda_api

        self._ev = cuda_api
        self.entry, self.exit = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)

    def wrap(self, fn: Callable[[], T]) -> Callable[[], T]:
        def timed() -> T:
            self._ev.record(self.entry, torch.cuda.current_stream().cuda_stream)
            result = fn()
            self._ev.record(self.exit, torch.cuda.current_stream().cuda_stream)
            return result
        return timed

    def read(self, transfer: Transfer) -> Timeline:
        """The timeline of the request just timed; destroys every event it read."""
        ev = transfer.timing_events
        self._ev.synchronize(self.exit)
        ms = self._ev.elapsed_ms
        timeline = Timeline(ms(self.entry, ev[0]), ms(ev[0], ev[-1]), ms(ev[-1], self.exit),
                            tuple(ms(a, b) for a, b in zip(ev, ev[1:])))
        for event in (*ev, self.entry, self.exit):
            self._ev.destroy_event(event)
        return timeline


@dataclass(frozen=True)
class TransferTiming:
    total_ms: float
    layer_ms: tuple[float, ...]
    nbytes: int


def job_bytes(job: CopyJob) -> int:
    return job.plan.num_pages * job.num_layers * job.layer_page_bytes


class TransferTimer(ABC):
    """Onboards recorded jobs again, alone, and times a bulk copy of the same bytes."""

    @abstractmethod
    def onboarding(self, jobs: list[CopyJob]) -> TransferTiming: ...

    @abstractmethod
    def bulk_ms(self, nbytes: int) -> float: ...

    @abstractmethod
    def close(self) -> None: ...

    @staticmethod
    def _issue(engine: CopyEngine, jobs: list[CopyJob]) -> list[Transfer]:
        return [engine.onboard(j.gpu_layers, j.host, j.plan.gpu_pages, j.plan.host_blocks, first_layer=j.first_layer)
                for j in jobs]


class CudaTransferTimer(TransferTimer):
    """Copy-engine timing events (start, then after each layer); the bulk copy is one pinned-host -> device copy."""

    def __init__(self, device: torch.device) -> None:
        from layerflow.transfer import cuda_api
        from layerflow.transfer.cuda_copy import CudaCopyEngine, Timing

        self._events = cuda_api
        self.device = device
        self.engine = CudaCopyEngine(timing=Timing.LAYERS, device=device.index or 0)
        self._src = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._dst = torch.empty(0, dtype=torch.uint8, device=device)

    def onboarding(self, jobs: list[CopyJob]) -> TransferTiming:
        transfers = self._issue(self.engine, jobs)
        for t in transfers:
            t.wait()
        events = [t.timing_events for t in transfers]
        layer_ms = tuple(self._events.elapsed_ms(a, b) for ev in events for a, b in zip(ev, ev[1:]))
        total = self._events.elapsed_ms(events[0][0], events[-1][-1])
        for event in (e for ev in events for e in ev):
            self._events.destroy_event(event)
        return TransferTiming(total, layer_ms, sum(job_bytes(j) for j in jobs))

    def bulk_ms(self, nbytes: int) -> float:
        if self._src.numel() < nbytes:
            self._src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._dst[:nbytes].copy_(self._src[:nbytes], non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def close(self) -> None:
        self.engine.close()


class HostTransferTimer(TransferTimer):
    """The CPU path: the transfer thread stamps each layer's start; the bulk copy is one host tensor copy."""

    def __init__(self) -> None:
        from layerflow.transfer.thread_copy import ThreadCopyEngine

        self._stamps: list[float] = []
        self.engine = ThreadCopyEngine(layer_hook=lambda layer: self._stamps.append(time.perf_counter()))

    def onboarding(self, jobs: list[CopyJob]) -> TransferTiming:
        self._stamps = []
        start = time.perf_counter()
        for t in self._issue(self.engine, jobs):
            t.wait()
        end = time.perf_counter()
        layer_ms = layer_times([(s - start) * 1e3 for s in self._stamps], (end - start) * 1e3)
        return TransferTiming((end - start) * 1e3, tuple(layer_ms), sum(job_bytes(j) for j in jobs))

    def bulk_ms(self, nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        start = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        self.engine.close()


def device_tools(device: torch.device) -> tuple[Clock, TransferTimer]:
    """The clock and transfer timer of the engine's device."""
    if device.type == "cuda":
        return CudaClock(), CudaTransferTimer(device)
    return HostClock(), HostTransferTimer()
