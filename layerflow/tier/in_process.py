"""The tier below the GPU kept in this process: the host cache (pinned host pool, optional SSD) and a copy engine.

The copies write this process's signal ring directly. An onboarding's bookkeeping runs on the calling thread (an SSD
read-back blocks it, group by group, each group copied on as it lands); its copies are issued there too, or on the copy
engine's own thread when it is one (`transfer/issue_thread.py`); offloads are asynchronous and settled by `reap`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from layerflow.tier.base import KVTier, Load, NotResident, Onboarding, Tier, TierUsage, settle
from layerflow.tier.copies import AllOf, GroupCopier, OnboardCopies
from layerflow.tier.host_cache import HostCache, Pinned
from layerflow.tier.layout import KVLayout
from layerflow.transfer.copy_engine import CopyEngine, Transfer
from layerflow.transfer.signals.base import LayerSignals, SignalHandle

log = logging.getLogger(__name__)


class _LocalOnboarding(Onboarding):
    local = True

    def __init__(self, handle: SignalHandle, copies: OnboardCopies, cache: HostCache, pinned: list[Pinned]):
        self.handle, self.copies, self.cache, self.pinned = handle, copies, cache, pinned
        self._released = False

    def finish(self, wait: bool) -> bool:
        """Copies in this process always end (or fail) on their own, so they are waited for even when `wait` is
        False: the host blocks they read stay pinned until then."""
        self.copies.settle()
        self.handle.release()
        return self.fenced()

    def fenced(self) -> bool:
        if not self._released:
            if not self.copies.done():
                return False
            self.cache.release_onboarded(self.pinned, failed=not self.copies.succeeded())
            self._released = True
        return True


class InProcessTier(KVTier):
    """`cache` holds the KV, `engine` copies between `gpu_kv` (the GPU pool's layers) and the cache's host blocks;
    `close()` closes the engine only if the tier `owns_engine`.

    Its copies are all this process's engine's, so it `orders_reuse`: an onboarding waits on the copy engine for the
    offloads it is ordered after and for its own users' offloads still in flight (a user evicted from the GPU right
    after its batch), and a user's offloads may overlap (one D2H order: the later one, which rewrites the last
    partial page, lands last). With a remote store written through, a user's offloads still go one at a time: the
    remote write at an offload's end sends the host copy of the newest history."""

    orders_reuse = True

    def __init__(self, cache: HostCache, layout: KVLayout, gpu_kv: Sequence[torch.Tensor], engine: CopyEngine,
                 signals: LayerSignals, timeout_s: float, owns_engine: bool = True) -> None:
        self.cache, self.engine, self.signals, self.owns_engine = cache, engine, signals, owns_engine
        self.copier = GroupCopier(engine, layout, gpu_kv, cache.host.blocks, timeout_s)
        self._offloads: dict[int, list[Transfer]] = {}   # per user, in the order they were issued

    def locate(self, user: int, tokens: int) -> Tier:
        tier, held = self.cache.lookup(user)
        return tier if tokens > 0 and held >= tokens else Tier.NONE

    def onboard(self, loads: Sequence[Load], layerwise: bool, after: Sequence[Transfer] = ()) -> Onboarding:
        waited = [t for t in after if not t.done()]
        waited += [t for load in loads for t in self._offloads.get(load.user, ()) if not t.done()]
        if waited:
            self.engine.order_onboards_after(waited)
        try:
            pinned = self.cache.pin_for_onboard([(load.user, load.first_page, len(load.gpu_pages)) for load in loads])
        except LookupError as e:
            raise NotResident([load.user for load in loads], str(e)) from e
        try:
            handle = self.signals.acquire(layerwise=layerwise)
        except BaseException:
            self.cache.release_onboarded(pinned, failed=True)
            raise
        copies = OnboardCopies(self.cache, self.copier, pinned, [load.gpu_pages for load in loads], handle)
        onboarding = _LocalOnboarding(handle, copies, self.cache, pinned)
        try:
            copies.run()
        except BaseException:
            onboarding.finish(wait=True)
            raise
        return onboarding

    def issue_deferred(self) -> None:
        self.engine.issue_deferred()

    def issue_inline(self, allowed: bool) -> None:
        self.engine.inline = allowed

    def adopt(self, user: int) -> tuple[int, list[int]] | None:
        return self.cache.adopt(user)

    def offload(self, user: int, tokens: int, gpu_pages: Sequence[int], valid_from: int = 0,
                history: Sequence[int] | None = None) -> Transfer:
        """Copies only the pages from the first one the host copy does not hold yet."""
        if self.cache.remote is not None and user in self._offloads:
            self._settle_user(user)
        slot = self.cache.begin_offload(user, tokens, valid_from, history)
        n = -(-tokens // self.cache.page_size)
        try:
            transfer = AllOf(self.copier.copy(gpu_pages[slot.first:n], slot.blocks[slot.first:n], to_gpu=False))
        except BaseException:
            self.cache.end_offload(user, ok=False)
            raise
        self._offloads.setdefault(user, []).append(transfer)
        return transfer

    def reap(self) -> None:
        """Unpin the host blocks of finished offloads, each user's in order; a failed one leaves no host copy."""
        for user, transfers in list(self._offloads.items()):
            while transfers and transfers[0].done():
                self.cache.end_offload(user, ok=transfers.pop(0).error is None)
            if not transfers:
                del self._offloads[user]

    def _settle_user(self, user: int) -> None:
        for transfer in self._offloads.get(user, ()):
            settle(transfer)
        self.reap()

    def truncate(self, user: int, tokens: int) -> None:
        self.cache.truncate(user, tokens)

    def evict(self, user: int) -> None:
        self._settle_user(user)
        self.cache.evict(user)

    def drop(self, user: int) -> None:
        self._settle_user(user)
        self.cache.drop(user)

    def usage(self) -> TierUsage:
        return self.cache.usage()

    def close(self) -> None:
        for transfers in self._offloads.values():
            for transfer in transfers:
                settle(transfer)
        self.reap()
        if self.owns_engine:
            self.engine.close()
        self.signals.close()
        self.cache.close()
