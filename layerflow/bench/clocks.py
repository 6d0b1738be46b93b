"""Time stamps on the device the engine runs on: CUDA events on the GPU, `perf_counter` on the CPU path."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
HOLD_CYCLES = 50_000_000  # ~25 ms of GPU sleep: long enough to queue a whole eager block behind it


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


def event_times_ms(fn: Callable[[], object], iters: int) -> list[float]:
    """`iters` calls of `fn` on the current stream, each timed by a pair of CUDA events (ms each)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
