"""The scheduler behaviours the serving benchmark compares in one process, on one engine: the library's and those
it is measured against, as TimedAsyncEngine subclasses (never by patching the library's classes).

- "library": the AsyncEngine as it is.
- "no-regrow": a batch of GPU hits prepared ahead never takes requests that arrive before the batch in flight
  computed (the scheduler before session 16).
- "jit": the library, and a partial next batch behind an onboarding one is also due once the copy engine's work
  queued so far is estimated to end within `JIT_LEAD_S` (its onboarded bytes at the calibrated bulk rate), so its
  copies are queued before the copy engine idles instead of after the batch in flight computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.runtime.engine import Engine
from layerflow.serving.flights import InFlight, Prepared
from layerflow.serving.queue import Pending

JIT_LEAD_S = 1.0e-3   # the prepare's time to its first copy issued (~0.5-0.7 ms on the H200), and a margin


class NoRegrowAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine whose batch prepared ahead is never given back for later arrivals."""

    def _may_regrow(self) -> bool:
        return False


class JustInTimeAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine that also prepares a partial next batch once the copy engine's queued work is estimated to
    end within JIT_LEAD_S (`bulk_bytes_per_s`: the rate the estimate assumes)."""

    def __init__(self, engine: Engine, policy: str | None = None, bulk_bytes_per_s: float = 1.0) -> None:
        if not bulk_bytes_per_s > 0:
            raise ValueError(f"bulk_bytes_per_s={bulk_bytes_per_s!r}: must be > 0")
        self._rate = bulk_bytes_per_s
        self._copies_end = 0.0   # time.monotonic() when the onboardings prepared so far are estimated to end
        super().__init__(engine, policy=policy)

    def _prepare(self, batch: list[Pending], prefetch: bool) -> Prepared | None:
        prepared = super()._prepare(batch, prefetch)
        if prepared is not None and prepared.onboard_bytes:
            self._copies_end = max(time.monotonic(), self._copies_end) + prepared.onboard_bytes / self._rate
        return prepared

    def _next_is_due(self, in_flight: InFlight) -> bool:
        return super()._next_is_due(in_flight) or time.monotonic() >= self._copies_end - JIT_LEAD_S


Factory = Callable[[Engine, str, float], TimedAsyncEngine]

VARIANTS: dict[str, Factory] = {
    "library": lambda engine, policy, rate: TimedAsyncEngine(engine, policy=policy),
    "no-regrow": lambda engine, policy, rate: NoRegrowAsyncEngine(engine, policy=policy),
    "jit": lambda engine, policy, rate: JustInTimeAsyncEngine(engine, policy=policy, bulk_bytes_per_s=rate),
}
