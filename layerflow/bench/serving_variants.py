"""The serving behaviours the serving benchmark compares in one process: the library's and those it replaced, put back
by wrappers on one engine's instances (never their classes), so every variant runs on the same engine and histories.

A variant is three choices:
- `offload_wait`: what a user's offload does about the user's previous one. None: nothing (the library: the tier
  orders them, runtime/kv_manager.py); "plain": waits until it was issued and has landed, issued in its turn on the
  copy thread (session 14's KV manager); "expedited": waits, asking the copy thread to issue it next
  (`IssuedTransfer.wait`).
- `offloads_first`: the copy thread issues every queued offload before any queued onboarding (False: onboardings
  first, the library's order, transfer/issue_thread.py).
- `behind`: a second batch is prepared behind a prepared one that onboards nothing (the library,
  serving/async_engine.py); False: at most one batch is prepared ahead (session 14).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.tier.base import KVTier, settle
from layerflow.tier.copies import AllOf
from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.issue_thread import IssuedTransfer, IssueThreadCopyEngine

OFFLOAD_WAITS = (None, "plain", "expedited")


@dataclass(frozen=True)
class Variant:
    offload_wait: str | None
    offloads_first: bool = False
    behind: bool = True


VARIANTS: dict[str, Variant] = {
    "wait": Variant("plain", behind=False),           # session 14
    "promote": Variant("expedited", behind=False),
    "queued": Variant(None, behind=False),
    "first": Variant(None, True, behind=False),
    "wait-first": Variant("plain", True, behind=False),
    "wait-behind": Variant("plain"),
    "queued-behind": Variant(None),                   # the library
    "first-behind": Variant(None, True),
}


class OneAheadAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine that never prepares a second batch ahead (session 14's scheduler)."""

    def _may_prepare_behind(self) -> bool:
        return False


def scheduler_class(variant: Variant) -> type[TimedAsyncEngine]:
    return TimedAsyncEngine if variant.behind else OneAheadAsyncEngine


@contextlib.contextmanager
def offloads_first(tier: KVTier, first: bool) -> Iterator[None]:
    """Inside (with `first`): the tier's copy thread, if it has one, issues queued offloads before queued onboardings
    (its count of offloads to issue first held at its maximum)."""
    engine = getattr(tier, "engine", None)
    queue = engine._queue if isinstance(engine, IssueThreadCopyEngine) else None
    if not first or queue is None:
        yield
        return
    queue._urgent = sys.maxsize
    try:
        yield
    finally:
        queue._urgent = 0


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
