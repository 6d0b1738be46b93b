"""The serving behaviours the serving benchmark compares in one process: the library's and those it replaced, put back
by wrappers on one engine's instances (never their classes), so every variant runs on the same engine and histories.

A variant is two choices:
- `offload_wait`: what a user's offload does about the user's previous one. None: nothing (the library: the tier
  orders them, runtime/kv_manager.py); "plain": waits until it was issued and has landed, issued in its turn on the
  copy thread (onboardings first; session 14's KV manager); "expedited": waits, asking the copy thread to issue it
  next (`IssuedTransfer.wait`).
- `due`: when the scheduler prepares a partial batch behind the one in flight. "landed": once the batch in flight's
  onboarding has landed, or it has computed (the library); "computed": only once it has computed, or at once when it
  onboards nothing (session 14's scheduler); "always": at once (whatever is queued).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.serving.flights import InFlight
from layerflow.tier.base import KVTier, settle
from layerflow.tier.copies import AllOf
from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.issue_thread import IssuedTransfer

OFFLOAD_WAITS = (None, "plain", "expedited")
DUE_RULES = ("landed", "computed", "always")


@dataclass(frozen=True)
class Variant:
    offload_wait: str | None
    due: str


VARIANTS: dict[str, Variant] = {
    "wait": Variant("plain", "computed"),         # session 14
    "promote": Variant("expedited", "computed"),
    "queued": Variant(None, "computed"),
    "landed": Variant(None, "landed"),            # the library
    "eager": Variant(None, "always"),
}


class VariantAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine preparing partial batches by the `due` rule (DUE_RULES)."""

    def __init__(self, *args, due: str = "landed", **kwargs) -> None:
        if due not in DUE_RULES:
            raise ValueError(f"due={due!r}: expected one of {DUE_RULES}")
        self._due = due   # set before the scheduler thread starts
        super().__init__(*args, **kwargs)

    def _next_is_due(self, in_flight: InFlight) -> bool:
        if self._due == "computed":
            return not in_flight.prepared.onboards() or in_flight.computed()
        if self._due == "always":
            return True
        return super()._next_is_due(in_flight)


def _leaves(transfer: Transfer) -> Iterator[Transfer]:
    if isinstance(transfer, AllOf):
        for part in transfer.transfers:
            yield from _leaves(part)
    else:
        yield transfer


def _wait_unexpedited(transfer: Transfer) -> None:
    """Wait for `transfer` as `settle` does, but without asking the copy thread to issue it next."""
    for leaf in _leaves(transfer):
        if isinstance(leaf, IssuedTransfer):
            leaf._issued.wait()
    settle(transfer)


@contextlib.contextmanager
def offload_waits(tier: KVTier, how: str | None) -> Iterator[None]:
    """Inside: each `tier.offload` of a user first waits for the user's previous one, as `how` says (OFFLOAD_WAITS)."""
    if how not in OFFLOAD_WAITS:
        raise ValueError(f"offload_wait={how!r}: expected one of {OFFLOAD_WAITS}")
    if how is None:
        yield
        return
    own = "offload" in vars(tier)   # an instance wrapper already there (the phase timer's) stays under this one
    inner = tier.offload
    last: dict[int, Transfer] = {}

    def offload(user: int, *args, **kwargs) -> Transfer:
        previous = last.pop(user, None)
        if previous is not None:
            (settle if how == "expedited" else _wait_unexpedited)(previous)
        transfer = last[user] = inner(user, *args, **kwargs)
        return transfer

    tier.offload = offload
    try:
        yield
    finally:
        if own:
            tier.offload = inner
        else:
            del tier.offload
