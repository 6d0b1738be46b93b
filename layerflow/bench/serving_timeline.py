"""Where the serving scheduler's time goes: an AsyncEngine whose scheduler steps are timed (host clock), for the
serving benchmark.

Each step's time is exclusive (a step called inside another, e.g. answering requests inside a collect, is counted
once, as itself), so the phases of a run add up to the scheduler thread's busy time; the rest of the run's wall time
is the scheduler outside its steps (loop bookkeeping). Phases:
- `idle`: nothing in flight, waiting for requests to fill a batch (`serve_max_wait_ms`) or to arrive at all;
- `take`: forming a batch while another is in flight;
- `prepare` / `prepare ahead`: `Engine.prepare` (placement, onboarding issue) with nothing in flight / behind a batch
  in flight;
- `launch`: `Engine.launch` (buffer fill, graph replay issue, early offload);
- `poll`: a batch in flight, nothing ready to prepare: paused for an arrival or the next completion poll;
- `collect`: `Engine.collect` (waits for the device when the batch has not computed yet: counted in `collect_waits`);
- `answer`: answering a collected batch's requests (their futures' callbacks run here);
- `retry`: requests retried alone after a failed batch.
`intervals` keeps every step as (phase, start, end) on the host clock (serving_copies attributes the copy engine's
idle time with it), and `batches` every prepared and launched batch as (event, host time, requests, onboarded bytes,
whether it holds `hot_user`, its users). With the in-process tier, each onboarded user's placement (its GPU pages
and host blocks) is kept too, outside the timed steps: `timeline()["user_runs"]` is the histogram of their runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from layerflow.bench.serving_issue import histogram, placement_runs
from layerflow.serving.async_engine import AsyncEngine
from layerflow.runtime.kv_manager import BELOW_GPU
from layerflow.serving.flights import Prepared
from layerflow.serving.queue import Pending


class TimedAsyncEngine(AsyncEngine):
    """An AsyncEngine that accounts its scheduler thread's time per phase; `reset()` starts a run, `timeline()` reads
    it (call both while the engine is idle)."""

    def __init__(self, *args, **kwargs) -> None:
        self._phases: dict[str, list[float]] = {}
        self._children: list[float] = []
        self._sizes: dict[str, list[int]] = {"prepare": [], "prepare ahead": []}
        self._collect_waits = 0
        self._placements: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.intervals: list[tuple[str, float, float]] = []
        self.batches: list[tuple[str, float, int, int, bool, list[int]]] = []
        self.hot_user: int | None = None
        self._since = time.perf_counter()
        super().__init__(*args, **kwargs)

    def reset(self) -> None:
        self._phases = {}
        self._sizes = {"prepare": [], "prepare ahead": []}
        self._collect_waits = 0
        self._placements = []
        self.intervals = []
        self.batches = []
        self._since = time.perf_counter()

    def timeline(self) -> dict:
        """Seconds and calls per phase since `reset`, the wall time, collects that waited for the device, and the
        mean size of the batches prepared with nothing in flight and behind a batch in flight."""
        sizes = {name: sum(s) / len(s) if s else 0.0 for name, s in self._sizes.items()}
        return {"wall_s": time.perf_counter() - self._since, "collect_waits": self._collect_waits,
                "phases": {name: {"s": s, "calls": int(n)} for name, (s, n) in sorted(self._phases.items())},
                "mean_prepared": sizes["prepare"], "mean_prepared_ahead": sizes["prepare ahead"],
                "user_runs": histogram(placement_runs(self._placements))}

    def _timed(self, phase: str, step: Callable, *args):
        self._children.append(0.0)
        start = time.perf_counter()
        try:
            return step(*args)
        finally:
            end = time.perf_counter()
            self.intervals.append((phase, start, end))
            spent = end - max(start, self._since)   # a wait begun before `reset` counts from it
            inner = self._children.pop()
            if self._children:
                self._children[-1] += spent
            totals = self._phases.setdefault(phase, [0.0, 0])
            totals[0] += spent - inner
            totals[1] += start >= self._since   # a step begun before `reset` is that run's call, not this one's

    def _take(self, wait: bool, full_only: bool = False) -> list[Pending] | None:
        return self._timed("idle" if wait else "take", super()._take, wait, full_only)

    def _prepare(self, batch: list[Pending], prefetch: bool) -> Prepared | None:
        phase = "prepare ahead" if prefetch else "prepare"
        if not self._children:   # the outer call of a split, not its halves
            self._sizes[phase].append(len(batch))
        prepared = self._timed(phase, super()._prepare, batch, prefetch)
        if prepared is not None:
            self._keep_placements(prepared)
            self._note("prepared", prepared)
        return prepared

    def _note(self, event: str, prepared: Prepared) -> None:
        users = [p.user for p in prepared.batch]
        self.batches.append((event, time.perf_counter(), len(users), prepared.onboard_bytes, self.hot_user in users,
                             users))

    def _keep_placements(self, prepared: Prepared) -> None:
        """Each onboarded user's GPU pages and host blocks as they are now (the in-process tier's host pool)."""
        host = getattr(getattr(self.engine.kv.below, "cache", None), "host", None)
        if host is None:
            return
        plan = prepared.plan
        for r, tier, pages in zip(plan.requests, plan.tiers, plan.page_rows):
            if tier in BELOW_GPU and r.user_id in host:
                self._placements.append((pages, host.pages(r.user_id)))

    def _launch(self, prepared: Prepared) -> None:
        self._note("launch", prepared)
        return self._timed("launch", super()._launch, prepared)

    def _pause(self) -> None:
        return self._timed("poll", super()._pause)

    def _collect(self) -> None:
        if not self._flight.computed():
            self._collect_waits += 1
        return self._timed("collect", super()._collect)

    def _answer(self, prepared: Prepared, scores: list, seconds: float) -> None:
        return self._timed("answer", super()._answer, prepared, scores, seconds)

    def _retry_alone(self, batch: list[Pending]) -> None:
        return self._timed("retry", super()._retry_alone, batch)


def thread_cpu_s(names: tuple[str, ...]) -> dict[str, float]:
    """CPU seconds so far of each live thread named in `names` (Linux: its pthread CPU clock), summed per name.
    A thread's CPU time includes what it spins without the GIL (the fetch's done-word wait)."""
    found: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.name in names and thread.ident is not None:
            try:
                clock = time.pthread_getcpuclockid(thread.ident)
                found[thread.name] = found.get(thread.name, 0.0) + time.clock_gettime(clock)
            except (OSError, AttributeError):   # the thread ended meanwhile, or no such clock here
                continue
    return found


ENGINE_STEPS = (("engine", "prepare"), ("engine", "launch"), ("engine", "collect"), ("kv", "_allocate"),
                ("kv", "_onboard"), ("kv", "offload_early"), ("kv", "_offload"), ("below", "offload"),
                ("deferred", "release"), ("kv", "commit"))


class EngineIntervals:
    """Every call of the engine methods in ENGINE_STEPS (on one engine's instances, never their classes) as
    (owner.method, start, end) on the host clock, for the serving benchmark's traces; `reset()` starts a run."""

    def __init__(self, engine) -> None:
        self.intervals: list[tuple[str, float, float]] = []
        owners = {"engine": engine, "kv": engine.kv, "below": engine.kv.below, "deferred": engine.kv.deferred}
        for owner, method in ENGINE_STEPS:
            target = owners[owner]
            setattr(target, method, self._timed(f"{owner}.{method}", getattr(target, method)))

    def reset(self) -> None:
        self.intervals = []

    def _timed(self, name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.intervals.append((name, start, time.perf_counter()))
        return call
