"""Copy engines that time their own transfers, for the benchmarks: the production engines, wrapped at their per-layer
seam, so what is timed is exactly what the runtime issues.

- `TimedCudaCopyEngine` records CUDA timing events on the copy stream (`Marks`); each transfer it returns is a
  `TimedTransfer` holding them.
- `StampedThreadCopyEngine` (the CPU path) stamps the host clock as each layer's copy starts.
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from typing import Callable

from cuda.bindings import runtime as rt

from layerflow.transfer import cuda_api
from layerflow.transfer.copy_engine import CopyJob, LayerAddresses, Transfer
from layerflow.transfer.copy_plan import Run
from layerflow.transfer.cuda_copy import CopyPath, CudaCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine


class Marks(enum.Enum):
    """Where a `TimedCudaCopyEngine` records timing events on the copy stream, besides a start event after the copy
    stream's wait for the current stream and before the first copy.

    TOTAL: one more event after the last layer's copies, nothing between layers, which costs the copy engine nothing
    measurable (bandwidth is timed with it). LAYERS: one after each layer's copies, before that layer's signal; each
    costs the copy engine about 1-2 us on the H200 (a timestamp between copies).
    """

    TOTAL = enum.auto()
    LAYERS = enum.auto()


def _destroy_events(events: list[rt.cudaEvent_t]) -> None:
    """A recorded event may be destroyed before it completes: CUDA releases it once it has."""
    while events:
        cuda_api.destroy_event(events.pop())


class TimedTransfer(Transfer):
    """A transfer of a `TimedCudaCopyEngine` and its timing events, in stream order: start, then each mark.

    The events are destroyed by `release()`, or when the transfer is garbage collected, whichever comes first.
    """

    def __init__(self, transfer: Transfer, events: list[rt.cudaEvent_t]) -> None:
        self.transfer = transfer
        self.events = events
        self._release = weakref.finalize(self, _destroy_events, events)

    @property
    def error(self) -> BaseException | None:
        return self.transfer.error

    def done(self) -> bool:
        return self.transfer.done()

    def wait(self, timeout: float | None = None) -> None:
        self.transfer.wait(timeout)

    def marks_ms(self) -> list[float]:
        """Milliseconds from the start event to each mark; waits for the transfer (TransferError if it failed)."""
        self.wait()
        start, *marks = self.events
        return [cuda_api.elapsed_ms(start, mark) for mark in marks]

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive events (LAYERS: per layer); waits for the transfer."""
        self.wait()
        return [cuda_api.elapsed_ms(a, b) for a, b in zip(self.events, self.events[1:])]

    def release(self) -> None:
        self._release()


class TimedCudaCopyEngine(CudaCopyEngine):
    """A CudaCopyEngine whose onboardings and offloads come back as `TimedTransfer`s with the `marks` events."""

    def __init__(self, marks: Marks, path: CopyPath | None = None, device: int | None = None) -> None:
        if not isinstance(marks, Marks):
            raise ValueError(f"marks={marks!r}: expected a Marks")
        super().__init__(path=path, device=device)
        self.marks = marks
        self._issuing = threading.local()  # the event list of the transfer this thread is issuing
        self.on_layer_issued: Callable[[int], None] | None = None   # called after each layer's copies (host stamps)
        # The last onboarding issued, as this engine timed it (a copy thread in front of it hands back its own
        # transfer object, not this one).
        self.last_onboard: TimedTransfer | None = None

    def _onboard(self, job: CopyJob) -> TimedTransfer:
        self.last_onboard = self._timed(super()._onboard, job)
        return self.last_onboard

    def _offload(self, job: CopyJob) -> TimedTransfer:
        return self._timed(super()._offload, job)

    def _onboard_run(self, *args) -> TimedTransfer:
        self.last_onboard = self._timed(super()._onboard_run, *args)
        return self.last_onboard

    def _timed(self, issue: Callable[..., Transfer], *args) -> TimedTransfer:
        """`issue(*args)` as a TimedTransfer (as it is where a one-run onboarding fell back to a job, timed by `_onboard`)."""
        self._issuing.events = events = []
        transfer = issue(*args)
        return transfer if isinstance(transfer, TimedTransfer) else TimedTransfer(transfer, events)

    def _layer_copier(self, job: CopyJob, stream: int, to_gpu: bool) -> Callable[[int], None]:
        return self._marked(super()._layer_copier(job, stream, to_gpu), stream, job.num_layers - 1)

    def _run_copier(self, addresses: LayerAddresses, run: Run, stream: int) -> Callable[[int], None]:
        return self._marked(super()._run_copier(addresses, run, stream), stream, len(addresses.gpu_bases) - 1)

    def _marked(self, copy_layer: Callable[[int], None], stream: int, last: int) -> Callable[[int], None]:
        """`copy_layer` followed by the host callback and the events of `marks` (a transfer's first event before it)."""
        events = self._issuing.events
        events.append(_recorded(stream))  # after an offload's wait for the current stream, before the first copy

        def copy_and_mark(layer: int) -> None:
            copy_layer(layer)
            if self.on_layer_issued is not None:
                self.on_layer_issued(layer)
            if self.marks is Marks.LAYERS or layer == last:
                events.append(_recorded(stream))

        return copy_and_mark


def _recorded(stream: int) -> rt.cudaEvent_t:
    event = cuda_api.create_event(timing=True)
    cuda_api.record(event, stream)
    return event


class StampedThreadCopyEngine(ThreadCopyEngine):
    """A ThreadCopyEngine that appends `time.perf_counter()` to `stamps` as each layer's copy starts (on the copy
    worker, both directions, in order); clear `stamps` between measurements."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[float] = []

    def _copy_layer(self, job: CopyJob, layer: int, to_gpu: bool) -> None:
        self.stamps.append(time.perf_counter())
        super()._copy_layer(job, layer, to_gpu)
