"""The tier below the GPU kept in this process: a pinned host pool, an optional SSD store and a copy engine."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from layerflow.tier.base import KVTier, Load, Onboarding, Tier, settle
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.layout import KVLayout
from layerflow.tier.ssd import Miss, SsdStore, tensor_block_views
from layerflow.transfer.copy_engine import CopyEngine, Transfer
from layerflow.transfer.signals.base import LayerSignals, SignalHandle

log = logging.getLogger(__name__)


class _LocalOnboarding(Onboarding):
    def __init__(self, handle: SignalHandle, transfers: list[Transfer], host: HostKVPool, users: list[int]):
        self.handle, self.transfers, self.host, self.users = handle, transfers, host, users

    def finish(self) -> None:
        for t in self.transfers:
            settle(t)
        for user in self.users:
            if user in self.host and self.host.pin_count(user):
                self.host.unpin(user)
        self.handle.release()


class InProcessTier(KVTier):
    """A host pool, an optional SSD store and a copy engine in this process; the copies write `signals` directly.

    The host evicts LRU unpinned users, spilling complete copies to SSD first."""

    def __init__(self, gpu_kv: Sequence[torch.Tensor], layout: KVLayout, host: HostKVPool, engine: CopyEngine,
                 signals: LayerSignals, ssd: SsdStore | None = None):
        self.gpu_kv, self.layout, self.host, self.engine = list(gpu_kv), layout, host, engine
        self.signals, self.ssd = signals, ssd
        self.on_host: dict[int, int] = {}  # tokens the host copy holds once its offload is done
        self.on_ssd: dict[int, int] = {}   # tokens of the SSD copy that are a valid prefix of the history
        self._offloads: dict[int, Transfer] = {}

    def locate(self, user: int, tokens: int) -> Tier:
        if user in self.host and self.on_host.get(user, 0) == tokens:
            return Tier.HOST
        if self.ssd is not None and tokens > 0 and self.on_ssd.get(user, 0) >= tokens and self.ssd.contains(user):
            return Tier.SSD
        return Tier.NONE

    def onboard(self, loads: Sequence[Load], layerwise: bool) -> Onboarding:
        """Host hits are pinned first, so reading an SSD hit back can never spill another user of the batch."""
        pinned = []
        try:
            for load in sorted(loads, key=lambda load: load.tier is Tier.SSD):
                if load.tier is Tier.SSD:
                    self._load_from_ssd(load.user, load.tokens)
                self.host.pin(load.user)
                pinned.append(load.user)
            handle = self.signals.acquire(layerwise=layerwise)
        except BaseException:
            for user in pinned:
                self.host.unpin(user)
            raise
        gpu_pages, host_blocks = [], []
        for load in loads:
            gpu_pages += load.gpu_pages
            host_blocks += self.host.pages(load.user)[:len(load.gpu_pages)]
        transfers = [self.engine.onboard(self.gpu_kv[r.start:r.stop], self.host.blocks[g], gpu_pages, host_blocks,
                                         handle, first_layer=r.start)
                     for g, r in enumerate(self.layout.group_ranges)]
        return _LocalOnboarding(handle, transfers, self.host, pinned)

    def _load_from_ssd(self, user: int, tokens: int) -> None:
        """Read the first `tokens` tokens' blocks back; a damaged copy is a miss and is forgotten."""
        blocks = self._host_allocate(user, tokens).pages
        try:
            self.ssd.load(user, tensor_block_views(self.host.blocks), blocks)
        except BaseException as e:
            self.host.free(user)
            if isinstance(e, Miss):
                self.on_ssd.pop(user, None)
            raise
        self.on_host[user] = tokens

    def _host_allocate(self, user: int, tokens: int):
        """Host blocks for `tokens` tokens of `user`; LRU unpinned users are evicted (spilled to SSD) only if that
        makes room."""
        return self.host.allocate(user, tokens, on_evict=self._spill)

    def _spill(self, victim: int) -> None:
        """Write an evicted user's complete host copy to SSD (when there is one) before its blocks are reused."""
        tokens = self.on_host.pop(victim, 0)
        if self.ssd is None or tokens == 0:
            return
        blocks = self.host.pages(victim)[:-(-tokens // self.host.page_size)]
        try:
            dropped = self.ssd.store(victim, tensor_block_views(self.host.blocks), blocks)
        except (OSError, ValueError) as e:
            log.warning("could not spill user %s to SSD: %s", victim, e)
            self.on_ssd.pop(victim, None)
            return
        self.on_ssd[victim] = tokens
        for user in dropped:
            self.on_ssd.pop(int(user), None)

    def offload(self, user: int, tokens: int, gpu_pages: Sequence[int]) -> Transfer:
        """Copies only from the first page the host copy does not hold yet."""
        if user in self._offloads:  # one offload per user at a time, each reaped (and unpinned) once
            settle(self._offloads[user])
            self.reap()
        blocks = self._host_allocate(user, tokens).pages
        ps = self.host.page_size
        first = self.on_host.get(user, 0) // ps if user in self.host else 0
        n = -(-tokens // ps)
        self.host.pin(user)
        transfers = [self.engine.offload(self.gpu_kv[r.start:r.stop], self.host.blocks[g], gpu_pages[first:n],
                                         blocks[first:n])
                     for g, r in enumerate(self.layout.group_ranges)]
        transfer = transfers[-1] if len(transfers) == 1 else _AllOf(transfers)
        self._offloads[user] = transfer
        self.on_host[user] = tokens
        return transfer

    def reap(self) -> None:
        """Unpin the host blocks of finished offloads; a failed offload leaves no host copy."""
        for user, transfer in list(self._offloads.items()):
            if not transfer.done():
                continue
            del self._offloads[user]
            if user in self.host and self.host.pin_count(user):
                self.host.unpin(user)
            if transfer.error is not None:
                log.warning("offload of user %s failed; its host copy is dropped", user)
                self.on_host[user] = 0
                self.host.free(user)

    def evict(self, user: int) -> None:
        """Drop the user's host copy, spilling it to SSD first when there is an SSD tier (its offload landed)."""
        settle(self._offloads.get(user))
        self.reap()
        if user in self.host:
            self._spill(user)
            self.host.free(user)

    def truncate(self, user: int, tokens: int) -> None:
        self.on_host[user] = min(self.on_host.get(user, 0), tokens)
        if user in self.on_ssd:
            self.on_ssd[user] = min(self.on_ssd[user], tokens)

    def drop(self, user: int) -> None:
        settle(self._offloads.get(user))
        self.reap()
        if user in self.host:
            self.host.free(user)
        if self.ssd is not None:
            self.ssd.evict(user)
        self.on_host.pop(user, None)
        self.on_ssd.pop(user, None)

    def close(self) -> None:
        self.engine.close()
        self.signals.close()
        if self.ssd is not None:
            self.ssd.close()


class _AllOf(Transfer):
    """Several groups' transfers seen as one."""

    def __init__(self, transfers: list[Transfer]):
        self.transfers = transfers

    def done(self) -> bool:
        return all(t.done() for t in self.transfers)

    def wait(self, timeout: float | None = None) -> None:
        for t in self.transfers:
            t.wait(timeout)

    @property
    def error(self) -> BaseException | None:
        return next((t.error for t in self.transfers if t.error is not None), None)
