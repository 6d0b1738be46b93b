"""The scheduler behaviours the serving benchmark compares in one process, on one engine: the library's and those it
is measured against, as one TimedAsyncEngine subclass whose instances switch the library's rules off (never by
patching the library's classes).

A variant is three choices:
- `regrow`: a batch of GPU hits prepared ahead is given back and prepared again with requests that arrive before the
  batch in flight computed (the library; False: session 15's scheduler);
- `paced`: a queue deeper than a batch goes out in shares of its longest per-user backlog (the library,
  serving/queue.py; False: the oldest requests up to the batch cap);
- `jit`: a partial next batch behind an onboarding one is also due once the copy engine's queued work is estimated
  to end within JIT_LEAD_S (its onboarded bytes at the calibrated bulk rate), so its copies are queued before the
  copy engine idles rather than after the batch in flight computed (not in the library).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.runtime.engine import Engine
from layerflow.serving.flights import InFlight, Prepared
from layerflow.serving.queue import Pending

JIT_LEAD_S = 1.0e-3   # the prepare's time to its first copy issued (~0.5-0.7 ms on the H200), and a margin


@dataclass(frozen=True)
class Variant:
    regrow: bool = True
    paced: bool = True
    jit: bool = False


VARIANTS: dict[str, Variant] = {
    "library": Variant(),
    "s15": Variant(regrow=False, paced=False),
    "regrow": Variant(paced=False),
    "paced": Variant(regrow=False),
    "jit": Variant(jit=True),
}


class VariantAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine with `variant`'s rules; `bulk_bytes_per_s`: the copy rate the `jit` estimate assumes."""

    def __init__(self, engine: Engine, policy: str | None, variant: Variant, bulk_bytes_per_s: float) -> None:
        if not bulk_bytes_per_s > 0:
            raise ValueError(f"bulk_bytes_per_s={bulk_bytes_per_s!r}: must be > 0")
        self.variant, self._rate = variant, bulk_bytes_per_s
        self._copies_end = 0.0   # time.monotonic() when the onboardings prepared so far are estimated to end
        super().__init__(engine, policy=policy)
        self.queue.paced = variant.paced

    def _may_regrow(self) -> bool:
        return self.variant.regrow and super()._may_regrow()

    def _prepare(self, batch: list[Pending], prefetch: bool) -> Prepared | None:
        prepared = super()._prepare(batch, prefetch)
        if prepared is not None and prepared.onboard_bytes:
            self._copies_end = max(time.monotonic(), self._copies_end) + prepared.onboard_bytes / self._rate
        return prepared

    def _next_is_due(self, in_flight: InFlight) -> bool:
        return super()._next_is_due(in_flight) or (self.variant.jit and
                                                   time.monotonic() >= self._copies_end - JIT_LEAD_S)


def scheduler(name: str, engine: Engine, policy: str, bulk_bytes_per_s: float) -> VariantAsyncEngine:
    """The scheduler of variant `name` (one of VARIANTS) on `engine`."""
    if name not in VARIANTS:
        raise ValueError(f"variant={name!r}: expected one of {tuple(VARIANTS)}")
    return VariantAsyncEngine(engine, policy, VARIANTS[name], bulk_bytes_per_s)
