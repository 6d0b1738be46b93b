"""When the copy engine idles while serving, and what the scheduler thread was doing then, for the serving benchmark.

A CudaCopyEngine that brackets each onboarding on its H2D stream with timing events (one before its first copy, one
after its completion event), so a run yields each onboarding's host issue span and device span on one clock (the
device's, anchored to the host clock by an event recorded on the idle stream right after a synchronize). Between two
consecutive onboardings the copy engine is idle; `idle_attribution` splits that idle time by the scheduler phase
(serving_timeline's intervals) that ran on the host at each instant of it, and by whether the next onboarding had
already been issued (then the device waited on something else) or not yet (the host was late).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from layerflow.transfer.copy_engine import CopyJob
from layerflow.transfer.cuda_copy import CudaCopyEngine, CudaTransfer

SAMPLE_S = 20e-6   # idle time is attributed at this resolution
OUTSIDE = "between steps"   # the scheduler thread outside every timed step (its loop's bookkeeping)
LOOK_BACK = 8   # steps nest at most this deep: an enclosing step started within the last few


@dataclass(frozen=True)
class CopySpan:
    """One onboarding on the host clock (seconds): its issue call's start and end, its copies' start and end on the
    device."""

    issued: float
    issue_end: float
    start: float
    end: float


class TimelineCopyEngine(CudaCopyEngine):
    """Records each onboarding's host and device span; `begin()` starts a run (the device idle), `spans()` ends it
    (it synchronizes the H2D stream)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stream = torch.cuda.ExternalStream(self.h2d_stream, device=self.device)
        self._marks: list[tuple[float, float, torch.cuda.Event, torch.cuda.Event]] = []
        self._base: tuple[float, torch.cuda.Event] | None = None

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self._marks = []
        base = torch.cuda.Event(enable_timing=True)
        base.record(self._stream)
        self._base = (time.perf_counter(), base)

    def spans(self) -> list[CopySpan]:
        if self._base is None:
            raise ValueError("spans() before begin(): no run was started")
        self._stream.synchronize()
        host0, base = self._base
        return [CopySpan(issued, issue_end, host0 + base.elapsed_time(start) / 1e3,
                         host0 + base.elapsed_time(end) / 1e3) for issued, issue_end, start, end in self._marks]

    def _issue(self, job: CopyJob, stream: int, to_gpu: bool) -> CudaTransfer:
        if not to_gpu or self._base is None:
            return super()._issue(job, stream, to_gpu)
        issued = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        transfer = super()._issue(job, stream, to_gpu)
        end.record(self._stream)
        self._marks.append((issued, time.perf_counter(), start, end))
        return transfer


def _phase_at(instant: float, starts: list[float], intervals: list[tuple[str, float, float]]) -> str:
    """The innermost timed step running at `instant` (the latest-started interval that contains it)."""
    last = bisect.bisect_right(starts, instant) - 1
    for i in range(last, max(-1, last - LOOK_BACK), -1):
        name, _, ended = intervals[i]
        if ended >= instant:
            return name
    return OUTSIDE


def idle_attribution(spans: list[CopySpan], intervals: list[tuple[str, float, float]]) -> dict:
    """The copy engine's busy and idle seconds from the first onboarding's start to the last one's end, the idle
    seconds per scheduler phase (`intervals`: (phase, start, end), host clock, any order), and of the idle time how
    much came before the next onboarding was issued (`host_late_s`) or after (`device_late_s`)."""
    if len(spans) < 2:
        return {"onboardings": len(spans), "busy_s": 0.0, "idle_s": 0.0, "host_late_s": 0.0, "device_late_s": 0.0,
                "idle_by_phase_s": {}}
    spans = sorted(spans, key=lambda s: s.start)
    intervals = sorted(intervals, key=lambda iv: iv[1])
    starts = [iv[1] for iv in intervals]
    by_phase: dict[str, float] = {}
    busy = host_late = device_late = 0.0
    reach = spans[0].start
    for span in spans:
        if span.start > reach:
            host_late += max(0.0, min(span.issued, span.start) - reach)
            device_late += span.start - max(reach, min(span.issued, span.start))
            t = reach
            while t < span.start:
                step = min(SAMPLE_S, span.start - t)
                name = _phase_at(t + step / 2, starts, intervals)
                by_phase[name] = by_phase.get(name, 0.0) + step
                t += step
        busy += max(0.0, span.end - max(span.start, reach))
        reach = max(reach, span.end)
    idle = sum(by_phase.values())
    return {"onboardings": len(spans), "busy_s": busy, "idle_s": idle, "host_late_s": host_late,
            "device_late_s": device_late, "idle_by_phase_s": dict(sorted(by_phase.items(), key=lambda kv: -kv[1]))}
