"""Who holds each user's KV (GPU pages, host blocks, SSD, nowhere) and the moves a batch needs.

For a batch: pin the users, allocate GPU pages for their history after the append, launch one onboarding for every
host or SSD hit (all layer groups, one signal counter), and after the block launch the asynchronous offload of the
pages the batch wrote. The GPU evicts by LRU only users whose offload finished; the host spills LRU users to SSD.
A user whose KV is gone from every tier is a miss: its stored item history is recomputed once, exactly.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from layerflow.hstu.batch import JaggedBatch
from layerflow.hstu.config import HSTUConfig
from layerflow.runtime.workload import Request
from layerflow.transfer.copy_engine import CopyEngine, Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.gpu_pool import GpuKVPool
from layerflow.transfer.host_pool import HostKVPool
from layerflow.transfer.signal_base import LayerSignals, SignalHandle
from layerflow.transfer.ssd import Miss, SsdStore, tensor_block_views

log = logging.getLogger(__name__)


class Tier(enum.Enum):
    GPU = "gpu"
    HOST = "host"
    SSD = "ssd"
    NONE = "none"


@dataclass
class UserEntry:
    """What the manager remembers of a user: its item history (to recompute a miss) and its host copy."""

    history: list[int] = field(default_factory=list)
    on_host: int = 0                    # tokens whose K/V the host copy holds once `offload` is done
    offload: Transfer | None = None

    def offloading(self) -> bool:
        return self.offload is not None and not self.offload.done()


@dataclass
class BatchPlan:
    """One batch's placement: the validated batch, each user's GPU pages, its tier, and the onboarding."""

    requests: list[Request]
    batch: JaggedBatch
    tiers: list[Tier]
    page_rows: list[tuple[int, ...]]
    handle: SignalHandle | None = None
    transfers: list[Transfer] = field(default_factory=list)


class KVManager:
    def __init__(self, config: HSTUConfig, gpu: GpuKVPool, host: HostKVPool, engine: CopyEngine,
                 signals: LayerSignals, layerwise: bool, ssd: SsdStore | None = None):
        self.config, self.gpu, self.host, self.engine = config, gpu, host, engine
        self.signals, self.layerwise, self.ssd = signals, layerwise, ssd
        self.users: dict[int, UserEntry] = {}

    def tier(self, user: int) -> Tier:
        entry = self.users.get(user)
        if entry is None:
            return Tier.NONE
        if user in self.gpu:
            return Tier.GPU
        if user in self.host and entry.on_host == len(entry.history):
            return Tier.HOST
        if self.ssd is not None and self.ssd.contains(user):
            return Tier.SSD
        return Tier.NONE

    # ---- a batch ------------------------------------------------------------------------------

    def prepare(self, requests: list[Request]) -> BatchPlan:
        """Validate the batch, place every user on the GPU and launch the onboarding; nothing changes on error."""
        users = [r.user_id for r in requests]
        if len(set(users)) != len(users):
            dup = next(u for u in users if users.count(u) > 1)
            raise ValueError(f"user {dup} appears twice in one batch")
        tiers = [self.tier(u) for u in users]
        cached, appended = [], []
        for r, tier in zip(requests, tiers):
            history = self.users[r.user_id].history if r.user_id in self.users else []
            keep = tier is not Tier.NONE
            cached.append(len(history) if keep else 0)
            appended.append(list(r.items) if keep else history + list(r.items))
        batch = JaggedBatch.from_lists(self.config, cached, appended, [list(r.candidates) for r in requests], users)
        self._reap_offloads()
        plan = BatchPlan(requests, batch, tiers, [])
        pinned = []
        try:
            for u, tier in zip(users, tiers):
                if tier is Tier.GPU:
                    self.gpu.pin(u)
                    pinned.append(u)
            for u, tier, total in zip(users, tiers, batch.history_lens):
                if tier is not Tier.GPU:
                    self._forget_gpu(u)
                pages = self.gpu.allocate(u, total, can_drop=self._gpu_can_drop).pages
                if tier is not Tier.GPU:
                    self.gpu.pin(u)
                    pinned.append(u)
                plan.page_rows.append(pages)
            self._onboard(plan)
        except BaseException:
            for u in pinned:
                self.gpu.unpin(u)
            for u, tier in zip(users, tiers):
                if tier is not Tier.GPU:
                    self._forget_gpu(u)
            raise
        return plan

    def commit(self, plan: BatchPlan) -> None:
        """The block succeeded: record the new history and offload the pages the batch wrote."""
        self._finish_onboarding(plan)
        ao = plan.batch.appended_offsets.tolist()
        for b, r in enumerate(plan.requests):
            self.gpu.unpin(r.user_id)
            entry = self.users.setdefault(r.user_id, UserEntry())
            if plan.batch.cached_lens[b] == 0:
                # A miss recomputed the whole history: any older host copy is stale.
                entry.history, entry.on_host = [], 0
            entry.history = entry.history + plan.batch.appended_ids[ao[b]:ao[b + 1]].tolist()
            self._offload(r.user_id, entry, plan.page_rows[b])

    def abort(self, plan: BatchPlan) -> None:
        """The block failed: users whose pages were being filled lose them (they are no longer resident)."""
        self._finish_onboarding(plan)
        for r, tier in zip(plan.requests, plan.tiers):
            self.gpu.unpin(r.user_id)
            if tier is not Tier.GPU:
                self._forget_gpu(r.user_id)

    def wait_offloads(self) -> None:
        """Block until every offload landed (benchmarks, shutdown)."""
        for entry in self.users.values():
            _settle(entry.offload)
        self._reap_offloads()

    def truncate(self, user: int, num_tokens: int) -> None:
        """Forget the tail of a user's history past `num_tokens` (e.g. retracted interactions; benchmarks use it to
        replay one request on a constant history). Cached K/V of the kept prefix stay valid: positions are absolute."""
        entry = self.users.get(user)
        if entry is None or not 0 <= num_tokens <= len(entry.history):
            have = None if entry is None else len(entry.history)
            raise ValueError(f"user {user}: cannot truncate to {num_tokens} tokens (history has {have})")
        _settle(entry.offload)
        self._reap_offloads()
        entry.history = entry.history[:num_tokens]
        entry.on_host = min(entry.on_host, num_tokens)

    def evict_from_gpu(self, user: int) -> None:
        """Drop a user's GPU pages once its host copy is complete (the cpu_hit set-up of the benchmark)."""
        _settle(self.users[user].offload)
        self._reap_offloads()
        self.gpu.free(user)

    # ---- moves --------------------------------------------------------------------------------

    def _gpu_can_drop(self, user: int) -> bool:
        entry = self.users.get(user)
        return entry is None or not entry.offloading()

    def _forget_gpu(self, user: int) -> None:
        if user in self.gpu and not self.gpu.pin_count(user):
            self.gpu.free(user)

    def _onboard(self, plan: BatchPlan) -> None:
        """One onboarding for every host/SSD hit of the batch: all layer groups, one signal counter."""
        ps = self.gpu.page_size
        gpu_pages, host_blocks = [], []
        for r, tier, cached, pages in zip(plan.requests, plan.tiers, plan.batch.cached_lens, plan.page_rows):
            if tier is Tier.SSD:
                self._load_from_ssd(r.user_id, cached)
            if tier in (Tier.HOST, Tier.SSD):
                n = -(-cached // ps)
                self.host.pin(r.user_id)
                gpu_pages += pages[:n]
                host_blocks += self.host.pages(r.user_id)[:n]
        if not gpu_pages:
            return
        plan.handle = self.signals.acquire(layerwise=self.layerwise)
        first = 0
        for g, group in enumerate(self.gpu.layout.groups):
            layers = self.gpu.kv[first:first + group.num_layers]
            plan.transfers.append(self.engine.onboard(layers, self.host.blocks[g], gpu_pages, host_blocks,
                                                      plan.handle, first_layer=first))
            first += group.num_layers

    def _load_from_ssd(self, user: int, cached: int) -> None:
        blocks = self._host_allocate(user, cached, keep={user}).pages
        try:
            self.ssd.load(user, tensor_block_views(self.host.blocks), blocks)
        except Miss:
            self.host.free(user)
            raise
        self.users[user].on_host = cached

    def _finish_onboarding(self, plan: BatchPlan) -> None:
        for t in plan.transfers:
            _settle(t)
        for r, tier in zip(plan.requests, plan.tiers):
            if tier in (Tier.HOST, Tier.SSD) and r.user_id in self.host and self.host.pin_count(r.user_id):
                self.host.unpin(r.user_id)
        if plan.handle is not None:
            plan.handle.release()
            plan.handle = None

    def _host_allocate(self, user: int, tokens: int, keep: set[int]):
        """Host blocks for `tokens` tokens of `user`, spilling LRU unpinned users to SSD to make room."""
        need = -(-tokens // self.host.page_size) - (len(self.host.pages(user)) if user in self.host else 0)
        for victim in self.host.users():
            if self.host.num_free >= need:
                break
            if victim in keep or self.host.pin_count(victim):
                continue
            entry = self.users.get(victim)
            if self.ssd is not None and entry is not None and entry.on_host == len(entry.history) > 0:
                self.ssd.store(victim, tensor_block_views(self.host.blocks), self.host.pages(victim))
            self.host.free(victim)
            if entry is not None:
                entry.on_host = 0
        return self.host.allocate(user, tokens, can_drop=lambda u: False)

    def _offload(self, user: int, entry: UserEntry, pages: tuple[int, ...]) -> None:
        """Copy the pages this batch wrote (from the first page not yet on the host) to the user's host blocks."""
        total = len(entry.history)
        if total == 0:
            return
        if entry.offloading():
            _settle(entry.offload)
            self._reap_offloads()
        blocks = self._host_allocate(user, total, keep={user}).pages
        ps = self.gpu.page_size
        first = entry.on_host // ps if user in self.host else 0
        n = -(-total // ps)
        self.host.pin(user)
        transfers = []
        start = 0
        for g, group in enumerate(self.gpu.layout.groups):
            layers = self.gpu.kv[start:start + group.num_layers]
            transfers.append(self.engine.offload(layers, self.host.blocks[g], pages[first:n], blocks[first:n]))
            start += group.num_layers
        entry.offload = transfers[-1] if len(transfers) == 1 else _AllOf(transfers)
        entry.on_host = total

    def _release_host_pin(self, user: int, entry: UserEntry) -> None:
        if user in self.host and self.host.pin_count(user):
            self.host.unpin(user)
        entry.offload = None

    def _reap_offloads(self) -> None:
        """Unpin the host blocks of finished offloads; a failed offload leaves no host copy."""
        for user, entry in self.users.items():
            if entry.offload is not None and entry.offload.done():
                failed = entry.offload.error is not None
                self._release_host_pin(user, entry)
                if failed:
                    log.warning("offload of user %s failed; its host copy is dropped", user)
                    entry.on_host = 0
                    self.host.free(user)


def _settle(transfer: Transfer | None) -> None:
    """Wait for a transfer to end; its failure was already reported (layer waits) or is handled by the reaper."""
    if transfer is None:
        return
    try:
        transfer.wait()
    except TransferError:
        pass


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
