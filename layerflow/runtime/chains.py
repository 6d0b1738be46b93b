"""Batches prepared on top of a launched batch's uncommitted history, and what an abort takes with it.

A batch records its users' appended history when it is launched (`KVManager.offload_early`) and commits it when it
is collected. A scheduler may prepare a user's next batch before that collect ("chained": its cached history holds
the first batch's appended tokens, whose KV the GPU writes in the first batch before the second reads it: the engine
runs one batch at a time on one compute stream). Until the first batch commits, the second stands on a history that
may not happen, so aborting the first aborts every batch chained on it first, and so on down the chain: no score is
ever computed from a history that was rolled back. A batch is chained only on launched ones: a batch merely prepared
has recorded nothing to build on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from layerflow.runtime.request import Request


class BatchPlan(Protocol):
    """What a chain needs of a KVManager's BatchPlan (declared here: the manager imports this module)."""

    requests: list[Request]
    aborted: bool


class ChainAborted(RuntimeError):
    """A batch chained on another was aborted with it and must not launch (prepare its requests again)."""


class PlanChains:
    """Per user, the open batches (prepared or launched, neither committed nor aborted) holding it, in preparation
    order; per open batch, the open batches chained on it. Plans are told apart by identity."""

    def __init__(self) -> None:
        self._holders: dict[int, list[BatchPlan]] = {}
        self._dependents: dict[int, list[BatchPlan]] = {}
        self._parents: dict[int, list[BatchPlan]] = {}

    def parents(self, users: Sequence[int], launched: Callable[[BatchPlan], bool], chain: bool) -> list[BatchPlan]:
        """The open batches a new batch of `users` would be chained on (each user's latest). ValueError, before
        anything moves, for a user held by a batch not launched yet, or by any open batch without `chain`."""
        found: list[BatchPlan] = []
        for user in users:
            held = self._holders.get(user)
            if not held:
                continue
            latest = held[-1]
            if not launched(latest):
                raise ValueError(f"user {user} is in a prepared batch not launched yet; prepare it after that launch")
            if not chain:
                raise ValueError(f"user {user} is in a batch not collected yet; prepare it after that collect")
            if all(p is not latest for p in found):
                found.append(latest)
        return found

    def open(self, plan: BatchPlan, parents: list[BatchPlan]) -> None:
        """`plan` was prepared: it holds its users, chained on `parents` (from `parents`, checked just before)."""
        for r in plan.requests:
            self._holders.setdefault(r.user_id, []).append(plan)
        self._dependents[id(plan)] = []
        self._parents[id(plan)] = parents
        for parent in parents:
            self._dependents[id(parent)].append(plan)

    def close(self, plan: BatchPlan) -> list[BatchPlan]:
        """`plan` committed or is being aborted: it holds its users no more. Returns the open batches chained on it,
        latest first (an abort aborts them before itself); a plan never opened returns none."""
        dependents = self._dependents.pop(id(plan), [])
        for dependent in dependents:
            parents = self._parents[id(dependent)]
            parents[:] = [p for p in parents if p is not plan]
        for parent in self._parents.pop(id(plan), []):
            siblings = self._dependents.get(id(parent), [])
            siblings[:] = [p for p in siblings if p is not plan]
        for r in plan.requests:
            held = self._holders.get(r.user_id, [])
            held[:] = [p for p in held if p is not plan]
            if not held:
                self._holders.pop(r.user_id, None)
        return dependents[::-1]

    def check_launch(self, plan: BatchPlan) -> None:
        """ChainAborted for an aborted plan (with the batch it was chained on, or cancelled itself); ValueError for one
        whose parent has not committed yet (the engine launches a batch only after the one in flight was collected)."""
        if plan.aborted:
            raise ChainAborted(f"users {[r.user_id for r in plan.requests]}: this batch was aborted (with the batch it "
                               "was chained on, or cancelled); prepare its requests again")
        if self._parents.get(id(plan)):
            raise ValueError(f"users {[r.user_id for r in plan.requests]}: chained on a batch not committed yet")
