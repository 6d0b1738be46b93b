"""The KV tier below the GPU: one interface, kept in this process or served by a transfer server.

The KV manager owns what is the GPU's (histories, pages, pins, LRU, the batch plan) and asks the tier below for the
rest: where a user's older KV is (`locate`), onboarding a batch's users into their GPU pages on ONE signal counter
(the pipeline has one wait per layer), offloading a user's pages (asynchronous, observable as a `Transfer`), and
forgetting a user. `InProcessTier` is a pinned host pool, SSD store and copy engine in this process;
`RemoteTier` is a `TransferClient` whose server owns them in another process and posts this process's eventfds.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import LayerSignals, SignalHandle


class Tier(enum.Enum):
    GPU = "gpu"
    HOST = "host"
    SSD = "ssd"
    REMOTE = "remote"   # a store shared with other hosts (layerflow.tier.remote_store)
    NONE = "none"


class NotResident(TransferError):
    """An onboarding failed because `users` no longer have (or never had) their KV below the GPU; the engine
    recomputes them from their stored history."""

    def __init__(self, users: Sequence, reason: str) -> None:
        super().__init__(f"users {list(users)} are not resident below the GPU: {reason}")
        self.users = list(users)
        self.reason = reason


@dataclass(frozen=True)
class TierUsage:
    """Occupancy of the tier below the GPU (for metrics and for tests that check nothing leaked)."""

    host_blocks: int
    host_total: int
    host_users: int
    pinned_users: int
    ssd_users: int


@dataclass(frozen=True)
class Load:
    """One user of an onboarding: where `locate` found it, its cached tokens, and the GPU pages that receive its
    cached pages `first_page`, `first_page` + 1, ... (a step under a sliding window reads only its last pages)."""

    user: int
    tier: Tier
    tokens: int
    gpu_pages: tuple[int, ...]
    first_page: int = 0


class Onboarding(ABC):
    """A batch's onboarding: its layers wait on `handle`; `finish` once the block is done with it (or failed).
    `local`: its copies are this process's and end on their own, so a committed one may be finished later
    (runtime/deferred.py)."""

    handle: SignalHandle
    local: bool = False

    @abstractmethod
    def finish(self, wait: bool) -> bool:
        """Release the handle; with `wait`, first wait (bounded by the tier's timeout) for the producer to end. True
        when nothing can write into the onboarding's GPU pages any more (and the tier cleaned up); else the caller must
        keep those pages out of use until `fenced()` says so (a hung producer may still write them)."""

    @abstractmethod
    def fenced(self) -> bool:
        """After a `finish` that returned False: True once the producer is done with the GPU pages."""


class KVTier(ABC):
    """Host memory (and SSD) below the GPU pool. Called from the manager's thread only."""

    signals: LayerSignals
    # Its onboardings can be ordered after offloads on the copy engine (`onboard(after=...)`), without the caller
    # waiting: a GPU page whose offload is still in flight may then be given to another user, and a user may have
    # several offloads in flight (they land in order). False: the KV manager waits for them on the host.
    orders_reuse: bool = False

    @abstractmethod
    def locate(self, user: int, tokens: int) -> Tier:
        """HOST or SSD if the tier holds the K/V of `user`'s first `tokens` tokens, else NONE."""

    @abstractmethod
    def onboard(self, loads: Sequence[Load], layerwise: bool, after: Sequence[Transfer] = ()) -> Onboarding:
        """Copy every load's tokens into its GPU pages, all users on one signal counter; `after` (only where
        `orders_reuse`): offloads still reading some of those pages, which the copies must follow."""

    def adopt(self, user: int) -> tuple[int, list[int]] | None:
        """`(tokens, item history)` of a user this host does not know but a shared tier holds (another host computed
        it), so the KV manager can take it over; None when there is no usable copy (the default: no shared tier)."""
        return None

    @abstractmethod
    def offload(self, user: int, tokens: int, gpu_pages: Sequence[int], valid_from: int = 0,
                history: Sequence[int] | None = None) -> Transfer:
        """Copy the GPU pages holding `user`'s `tokens` tokens down (asynchronously); `locate` counts on it from now on,
        until `reap` sees it failed. Only pages from `valid_from` on hold valid K/V (a windowed onboarding): an
        offload that would need earlier ones fails with ValueError. `history` (item ids, one per token) goes with
        the copy to a shared tier, so another host can adopt the user."""

    def issue_deferred(self) -> None:
        """Issue the copies an onboarding left for after the batch's launch (an in-process tier whose copy engine
        issues a lead of layers first); the default defers nothing."""

    def issue_inline(self, allowed: bool) -> None:
        """Whether the next batch's copies may be issued on the caller's thread: it launches and collects that batch
        right after (`Engine.score`, nothing in flight). The default issues as it always does."""

    @abstractmethod
    def reap(self) -> None:
        """Settle the bookkeeping of offloads that ended (a failed one leaves no copy)."""

    @abstractmethod
    def truncate(self, user: int, tokens: int) -> None:
        """The user's history now ends at `tokens`: the copy's prefix stays valid (positions are absolute)."""

    @abstractmethod
    def evict(self, user: int) -> None:
        """Move the user's host copy down to SSD (or nowhere without an SSD tier), e.g. to serve it from SSD next."""

    @abstractmethod
    def drop(self, user: int) -> None:
        """Forget the user's copies."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """What the tier holds now."""

    def alive(self) -> bool:
        """False when the tier can no longer serve (its server is gone and does not come back)."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Release threads, streams, eventfds, files and connections."""


def settle(transfer: Transfer | None) -> None:
    """Wait for a transfer to end; its failure was already reported (layer waits) or is the reaper's."""
    if transfer is None:
        return
    try:
        transfer.wait()
    except TransferError:
        pass
