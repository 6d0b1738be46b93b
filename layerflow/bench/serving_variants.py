"""The serving behaviours the serving benchmark compares in one process, on one engine: the library's and those it
replaced, as one TimedAsyncEngine subclass whose instances switch the library's rules off (on the instances, never
by patching the library's classes).

A variant is three choices:
- `paced`: a queue deeper than a batch goes out in shares of its longest per-user backlog (the library,
  serving/queue.py); False: the oldest requests up to the batch cap (session 15);
- `owe`: a user's offload asked for while its previous one is in flight is owed, issued once that one landed (the
  library, runtime/kv_manager.py); False: the launch waits for the previous one first (session 15);
- `switch_ms`: the interpreter's GIL switch interval while the scheduler runs (None: Python's, 5 ms). A thread
  waiting for the GIL gets it when the holder blocks, or is asked to drop it after this interval: the copy thread
  woken by an onboarding waits for it while the scheduler goes on packing the batch (session 16, round 1: a queued
  onboarding's first copy issued a median ~1 ms, p90 2-7 ms, after the scheduler queued it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import KVManager


@dataclass(frozen=True)
class Variant:
    paced: bool = True
    owe: bool = True
    switch_ms: float | None = None


VARIANTS: dict[str, Variant] = {
    "library": Variant(),
    "s15": Variant(paced=False, owe=False),
    "paced": Variant(owe=False),
    "owe": Variant(paced=False),
    "switch": Variant(switch_ms=0.2),
}


def _wait_for_previous_offload(kv: KVManager):
    """`kv._offload` as session 15 had it: the user's offload in flight (and any owed one) lands first."""
    inner = kv._offload

    def offload(user, entry, pages):
        if entry.offload is not None:
            kv._settle(user)
        return inner(user, entry, pages)
    return offload


class VariantAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine with `variant`'s rules (the KV manager's for as long as this scheduler is open)."""

    def __init__(self, engine: Engine, policy: str | None, variant: Variant) -> None:
        self.variant = variant
        self._kept_switch = sys.getswitchinterval()
        if variant.switch_ms is not None:
            sys.setswitchinterval(variant.switch_ms / 1e3)
        kv = engine.kv
        self._kept_offload = kv.__dict__.get("_offload")   # an instance wrapper already there stays under this one
        if not variant.owe:
            kv._offload = _wait_for_previous_offload(kv)
        super().__init__(engine, policy=policy)
        self.queue.paced = variant.paced

    def close(self) -> None:
        super().close()
        sys.setswitchinterval(self._kept_switch)
        kv = self.engine.kv
        if self._kept_offload is not None:
            kv._offload = self._kept_offload
        elif "_offload" in kv.__dict__:
            del kv._offload


def scheduler(name: str, engine: Engine, policy: str) -> VariantAsyncEngine:
    """The scheduler of variant `name` (one of VARIANTS) on `engine`."""
    if name not in VARIANTS:
        raise ValueError(f"variant={name!r}: expected one of {tuple(VARIANTS)}")
    return VariantAsyncEngine(engine, policy, VARIANTS[name])
