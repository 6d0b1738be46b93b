"""What the inference benchmark measures beside the timed requests, built from the engine's public pieces only.

- `layer_compute_ms`: the per-layer compute of a GPU-hit batch (`LayerClock` stamps each layer's wait point).
- `TimelineMarks`: where a layerwise request's time went, read against its onboarding's per-layer timing events.
- `TransferTimer`: the recorded onboardings of a request issued again, alone (per-layer times), and a bulk memcpy of
  the same bytes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from layerflow.bench.clocks import Clock
from layerflow.bench.copy_timing import Marks, StampedThreadCopyEngine, TimedCudaCopyEngine, TimedTransfer
from layerflow.bench.marks import HOST_STAMPS, TailMarks, TailTimes
from layerflow.bench.recording import Onboarding
from layerflow.bench.stats import layer_times
from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.runtime.waits import LayerWait
from layerflow.transfer import cuda_api

T = TypeVar("T")


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
        bufs = BatchBuffers(bucket, engine.max_pages, engine.device, engine.weights.config)
        bufs.fill(plan.batch, plan.page_rows)
        waits = LayerClock(clock)
        clock.hold()
        engine.pipeline.forward(bufs, waits)
        end = clock.stamp()
        clock.sync()
    finally:
        engine.cancel(plan)   # kv.abort, and a staged batch's slab back to its bucket
    base = waits.stamps[0]
    return layer_times([clock.ms(base, s) for s in waits.stamps], clock.ms(base, end))


@dataclass(frozen=True)
class Timeline:
    """Where one layerwise request's time went (ms, one device clock): score entry -> first copy issued, first
    copy -> last layer landed (in the pipelined run), last layer landed -> scores returned; with `TailMarks`
    installed, `tail_marks` has each layer's wait release, the replay and fetch marks and the host stamps."""

    issue_ms: float
    transfer_ms: float
    tail_ms: float
    layer_ms: tuple[float, ...]
    tail_marks: TailTimes | None = None

    def breakdown(self) -> dict[str, float]:
        """The tail split at its marks (ms): last copy landed -> its wait released (`signal_lag`) -> graph done
        (`last_compute`: the last layer and the scores) -> the host at the fetch (`host_late`, 0 when it was there
        first) -> the host back from the fetch (`wake`) -> the timed call returned (`post`); `first_wait`: the first
        layer's release after its copy landed (large: the compute is behind the copies); `replay_call`: when the
        replay could start (device clock, from entry); the host stamps (`host.*`, host clock, from entry); across
        the clocks (both from entry; the entry event's own lag biases them up by a few us): the graph's end -> the
        host entering the fetch (`host_at_fetch`, < 0: it was waiting) and -> its wait returning (`host_wake`)."""
        if self.tail_marks is None:
            return {}
        t, lags = self.tail_marks, self.release_lags()
        dev, end = t.device, self.issue_ms + self.transfer_ms + self.tail_ms
        at_fetch = max(dev["fetch_call"], dev["graph_end"])
        out = {"signal_lag": lags[-1], "last_compute": dev["graph_end"] - t.released[-1],
               "host_late": at_fetch - dev["graph_end"], "wake": dev["woke"] - at_fetch, "post": end - dev["woke"],
               "first_wait": lags[0], "replay_call": dev["replay_call"]}
        for key, stamp in (("host_at_fetch", "fetch_call"), ("host_wake", "fetch_waited")):
            if stamp in t.host:
                out[key] = t.host[stamp] - dev["graph_end"]
        return out | {f"host.{name}": t.host[name] for name in HOST_STAMPS if name in t.host}

    def release_lags(self) -> tuple[float, ...]:
        """Per layer: its wait released (compute could go on) less its copy landed, ms; empty without TailMarks."""
        if self.tail_marks is None:
            return ()
        landed = [self.issue_ms + sum(self.layer_ms[:layer + 1]) for layer in range(len(self.layer_ms))]
        return tuple(r - a for r, a in zip(self.tail_marks.released, landed))


class TimelineMarks:
    """CUDA events at score entry and exit on the compute stream, read against the onboarding's timing events (the
    engine's copy engine is then a `TimedCudaCopyEngine` with `Marks.LAYERS`) and, given, the engine's `TailMarks`."""

    def __init__(self, tail: TailMarks | None = None) -> None:
        self.entry, self.exit = cuda_api.create_event(timing=True), cuda_api.create_event(timing=True)
        self.tail = tail

    def wrap(self, fn: Callable[[], T]) -> Callable[[], T]:
        def timed() -> T:
            cuda_api.record(self.entry, torch.cuda.current_stream().cuda_stream)
            if self.tail is not None:
                self.tail.host.open()
            result = fn()
            cuda_api.record(self.exit, torch.cuda.current_stream().cuda_stream)
            return result
        return timed

    def read(self, transfer: TimedTransfer) -> Timeline:
        """The timeline of the request just timed; destroys the events it made (the tail's are reused)."""
        ev = transfer.events
        cuda_api.synchronize(self.exit)
        ms = cuda_api.elapsed_ms
        timeline = Timeline(ms(self.entry, ev[0]), ms(ev[0], ev[-1]), ms(ev[-1], self.exit),
                            tuple(transfer.intervals_ms()), None if self.tail is None else self.tail.read(self.entry))
        transfer.release()
        for event in (self.entry, self.exit):
            cuda_api.destroy_event(event)
        return timeline


@dataclass(frozen=True)
class TransferTiming:
    total_ms: float
    layer_ms: tuple[float, ...]
    nbytes: int


class TransferTimer(ABC):
    """Onboards recorded onboardings again, alone, and times a bulk copy of the same bytes."""

    @abstractmethod
    def onboarding(self, onboardings: list[Onboarding]) -> TransferTiming: ...

    @abstractmethod
    def bulk_ms(self, nbytes: int) -> float: ...

    @abstractmethod
    def close(self) -> None: ...


class CudaTransferTimer(TransferTimer):
    """Copy-engine timing events (start, then after each layer); the bulk copy is one pinned-host -> device copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.engine = TimedCudaCopyEngine(Marks.LAYERS, device=device.index or 0)
        self._src = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._dst = torch.empty(0, dtype=torch.uint8, device=device)

    def onboarding(self, onboardings: list[Onboarding]) -> TransferTiming:
        transfers: list[TimedTransfer] = [o.issue(self.engine) for o in onboardings]
        layer_ms = tuple(ms for t in transfers for ms in t.intervals_ms())
        total = cuda_api.elapsed_ms(transfers[0].events[0], transfers[-1].events[-1])
        for t in transfers:
            t.release()
        return TransferTiming(total, layer_ms, sum(o.nbytes for o in onboardings))

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
    """The CPU path: the copy thread stamps each layer's start; the bulk copy is one host tensor copy."""

    def __init__(self) -> None:
        self.engine = StampedThreadCopyEngine()

    def onboarding(self, onboardings: list[Onboarding]) -> TransferTiming:
        self.engine.stamps.clear()
        start = time.perf_counter()
        for t in [o.issue(self.engine) for o in onboardings]:
            t.wait()
        end = time.perf_counter()
        layer_ms = layer_times([(s - start) * 1e3 for s in self.engine.stamps], (end - start) * 1e3)
        return TransferTiming((end - start) * 1e3, tuple(layer_ms), sum(o.nbytes for o in onboardings))

    def bulk_ms(self, nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        start = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        self.engine.close()
