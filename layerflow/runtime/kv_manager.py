"""Who holds each user's KV (GPU pages, the tier below, nowhere) and the moves a batch needs.

The manager owns the GPU's side (histories, page pool, pins, LRU, the batch plan); everything below it is a `KVTier`.
A batch pins its users, allocates GPU pages for their history after the append, starts ONE onboarding for all its
host, SSD and remote hits (one signal counter; under a window only the pages read) and, after the launch, offloads
the pages it wrote. LRU eviction takes only users whose offload finished, unless the tier `orders_reuse`: then the
batch given an evicted user's pages has its onboarding and block ordered after that offload on the device
(`BatchPlan.reuse_fences`). A user gone from every tier is a miss, recomputed once from its stored history; one only a
shared tier holds is adopted with its manifest's history. A batch may be prepared on top of a launched one's
uncommitted history (runtime/chains.py: its abort aborts them too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from layerflow.model.batch import BatchShape, JaggedBatch, check_lengths
from layerflow.model.config import HSTUConfig
from layerflow.runtime.chains import PlanChains
from layerflow.runtime.deferred import DeferredReleases
from layerflow.runtime.history import EmbeddingHistory, History, ItemHistory
from layerflow.runtime.plan import BatchPlan, UserEntry
from layerflow.runtime.quarantine import Quarantine
from layerflow.runtime.request import EmbeddingRequest, Request
from layerflow.tier.allocator import PoolExhausted
from layerflow.tier.base import KVTier, Load, Tier, settle
from layerflow.tier.copies import AllOf
from layerflow.tier.gpu_pool import GpuKVPool
from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.errors import TransferError

__all__ = ["BatchPlan", "KVManager", "Tier", "UserEntry"]

log = logging.getLogger(__name__)

BELOW_GPU = (Tier.HOST, Tier.SSD, Tier.REMOTE)   # tiers a batch onboards from


class KVManager:
    """`pack_items(users, cached lens, appended ids, candidate ids, page rows)` packs an item-id batch instead of
    `JaggedBatch.from_lists`, validating the ids alike; `reap_after_launch`: a batch of GPU hits forgets finished
    offloads after its launch, overlapping the block (one placing other users first: they may need those pins)."""

    def __init__(self, config: HSTUConfig, gpu: GpuKVPool, below: KVTier, layerwise: bool,
                 pack_items: Callable[..., BatchShape] | None = None, reap_after_launch: bool = False):
        self.config, self.gpu, self.below, self.layerwise, self.pack_items = config, gpu, below, layerwise, pack_items
        self.reap_after_launch = reap_after_launch
        self.users: dict[int, UserEntry] = {}
        self._offloading: set[int] = set()   # users whose entry holds an offload not yet reaped
        self._fences: list[tuple[frozenset[int], Transfer]] = []   # pages freed while their offload was in flight
        self.quarantine = Quarantine(gpu)
        self.chains = PlanChains()
        self.deferred = DeferredReleases()   # committed onboardings given back after the next launch

    def tier(self, user: int) -> Tier:
        entry = self.users.get(user)
        if entry is None:
            adopted = self.below.adopt(user) if self.config.embedding_tables else None
            if adopted is None:
                return Tier.NONE
            entry = self.users[user] = UserEntry(self._new_history())
            entry.history.extend(adopted[1])
        if user in self.gpu:
            return Tier.GPU
        return self.below.locate(user, len(entry.history))

    def _tier_for(self, r) -> Tier:
        """`tier(user)` for this request: a GPU copy missing pages the request's step reads (a windowed onboarding
        skipped them and the window now starts earlier) is given up and the user looked up below."""
        entry = self.users.get(r.user_id)
        if entry is not None and r.user_id in self.gpu and \
                entry.gpu_first_page > self._first_page(r, len(entry.history)):
            settle(entry.offload)
            self._reap_offloads()
            self._forget_gpu(r.user_id)
        return self.tier(r.user_id)

    def _first_page(self, r, cached: int) -> int:
        """The first cached page a request's step reads: 0, or later under a sliding window."""
        if not self.config.max_attn_len:
            return 0
        appended = len(r.new_x) if isinstance(r, EmbeddingRequest) else len(r.items)
        candidates = len(r.candidates_x) if isinstance(r, EmbeddingRequest) else len(r.candidates)
        return self.config.mask_rule.cached_read_start(cached, appended, candidates) // self.gpu.page_size

    def replace_below(self, below: KVTier) -> None:
        """Swap the tier below the GPU (e.g. the transfer server died, or came back): the old one's copies are
        forgotten (closing it is the caller's choice); GPU-resident users stay hits and are offloaded to the new tier at
        their next batch; the rest become misses."""
        self.deferred.release()
        for user in self._offloading:
            settle(self.users[user].offload)
            self.users[user].offload = None
        self._offloading.clear()
        self._fences.clear()
        self.below = below

    # ---- a batch ------------------------------------------------------------------------------

    def prepare(self, requests: list[Request], chain: bool = False) -> BatchPlan:
        """Validate the batch, place every user on the GPU and launch the onboarding; nothing changes on error.
        `chain`: a user of a launched batch not committed yet may be in it (its history as that batch recorded it);
        else such a user is a ValueError, as one of a batch not launched yet always is (runtime/chains.py).

        The onboarding is issued before the batch is packed, so the first layer's copy starts as early as possible:
        what must be refused before any page moves (a request of the wrong kind, a batch past max_seq_len) is checked
        on lengths first; a bad id or embedding found by the packing gives the batch's pages, pins and onboarding
        back (`abort`) before the error propagates (an LRU user the allocation evicted stays a hit below the GPU)."""
        users = [r.user_id for r in requests]
        if len(set(users)) != len(users):
            dup = next(u for u in users if users.count(u) > 1)
            raise ValueError(f"user {dup} appears twice in one batch")
        parents = self.chains.parents(users, lambda plan: bool(plan.recorded), chain)
        if not self.reap_after_launch or any(u not in self.gpu for u in users):
            self._reap_offloads()
        self.quarantine.reap()
        tiers = [self._tier_for(r) for r in requests]
        cached, appended = self._query_tokens(requests, tiers)
        plan = BatchPlan(requests, None, tiers, [], appended)
        pinned = []
        try:
            for u, tier in zip(users, tiers):
                if tier is Tier.GPU:
                    self.gpu.pin(u)
                    pinned.append(u)
            for u, tier, c, new in zip(users, tiers, cached, appended):
                if tier is not Tier.GPU:
                    self._forget_gpu(u)
                pages = self._allocate(u, c + len(new), plan.reuse_fences)
                if tier is not Tier.GPU:
                    self.gpu.pin(u)
                    pinned.append(u)
                plan.page_rows.append(pages)
            self._onboard(plan, cached)
        except BaseException:
            for u in pinned:
                self.gpu.unpin(u)
            for u, tier in zip(users, tiers):
                if tier is not Tier.GPU:
                    self._forget_gpu(u)
            raise
        try:
            plan.batch = self._batch(requests, cached, appended, plan.page_rows)
        except BaseException:
            self.abort(plan)
            raise
        self.chains.open(plan, parents)
        return plan

    def _query_tokens(self, requests: list, tiers: list[Tier]) -> tuple[list[int], list]:
        """Per user its cached tokens and the tokens the batch computes (a hit's new tokens, a miss's whole stored
        history followed by its new tokens); ValueError for a request of the wrong kind or a user past max_seq_len."""
        embeddings = not self.config.embedding_tables
        kind = EmbeddingRequest if embeddings else Request
        bad = next((r for r in requests if not isinstance(r, kind)), None)
        if bad is not None:
            raise ValueError(f"user {getattr(bad, 'user_id', '?')}: a {type(bad).__name__} for a model that takes "
                             f"{kind.__name__}s ({'no' if embeddings else 'with'} embedding tables)")
        cached, appended = [], []
        for r, tier in zip(requests, tiers):
            entry = self.users.get(r.user_id)
            keep = tier is not Tier.NONE
            cached.append(len(entry.history) if keep else 0)
            new = r.new_x if embeddings else r.items
            if keep or entry is None or not len(entry.history):
                appended.append(new)
            elif embeddings:
                appended.append(torch.cat([entry.history.tokens(), new.to("cpu", self.config.dtype)]))
            else:
                appended.append(entry.history.tokens() + new)
        candidates = [r.candidates_x if embeddings else r.candidates for r in requests]
        check_lengths(self.config, [r.user_id for r in requests], cached, appended, candidates)
        return cached, appended

    def _batch(self, requests: list, cached: list[int], appended: list, page_rows: list[tuple]) -> BatchShape:
        """The batch's query tokens packed and validated (`_query_tokens` gathered them)."""
        users = [r.user_id for r in requests]
        if not self.config.embedding_tables:
            return JaggedBatch.from_embeddings(self.config, cached, appended, [r.candidates_x for r in requests],
                                               users)
        # Every list is a Request's (plain ints from its construction) or a stored history joined with one.
        if self.pack_items is not None:
            return self.pack_items(users, cached, appended, [r.candidates for r in requests], page_rows)
        return JaggedBatch.from_lists(self.config, cached, appended, [r.candidates for r in requests], users,
                                      plain_ints=True)

    def _new_history(self) -> History:
        c = self.config
        return ItemHistory() if c.embedding_tables else EmbeddingHistory(c.embedding_dim, c.dtype)

    def offload_early(self, plan: BatchPlan) -> None:
        """Right after the block is launched: record every user's new history and offload the pages the batch wrote.

        The copy stream waits for the block on the GPU, so issuing the offloads now overlaps their host cost with the
        block instead of adding it after the scores. An onboarded user's first offloaded page also holds onboarded
        tokens: if the batch fails, `abort` drops that user's copy below, which the offload may have overwritten.
        Earlier batches' deferred onboardings are given back first (their host pins may be needed for room).
        """
        self.deferred.release()
        if self.reap_after_launch:
            self._reap_offloads()
        for b in range(len(plan.requests)):
            self._record(plan, b)

    def commit(self, plan: BatchPlan) -> None:
        """The block succeeded (`offload_early` recorded its users): release its onboarding (signalled; or keep it for
        after the next launch, runtime/deferred.py) and pins."""
        if plan.onboarding is not None:
            if not self.deferred.keep(plan.onboarding):
                plan.onboarding.finish(wait=True)
            plan.onboarding = None
        for r in plan.requests:
            self.gpu.unpin(r.user_id)
        self.chains.close(plan)

    def abort(self, plan: BatchPlan) -> None:
        """The block failed: users whose pages were being filled lose them (they are no longer resident), users
        recorded early get their history back as it was before the batch, and an onboarded user recorded early loses
        its copy below (its offload may have written pages the failed onboarding left unfilled): it is recomputed.

        A producer that has not answered (a hung transfer server) may still write the onboarded users' pages: those
        pages are quarantined, never reused until the producer is done, so they can never corrupt another user's KV.
        The batches chained on this one are aborted first (their pins and pages go back before these users'); a
        second abort of a plan does nothing."""
        if plan.aborted:
            return
        plan.aborted = True
        for dependent in self.chains.close(plan):
            self.abort(dependent)
        fenced = True
        if plan.onboarding is not None:
            onboarding, plan.onboarding = plan.onboarding, None
            fenced = onboarding.finish(wait=False)
        onboarded = [r.user_id for r, tier in zip(plan.requests, plan.tiers) if tier in BELOW_GPU]
        for r in plan.requests:
            self.gpu.unpin(r.user_id)
        if not fenced:
            self.quarantine.hold(onboarding, onboarded)
            log.warning("onboarding of users %s did not end; their GPU pages stay out of use until it does", onboarded)
        for b, (r, tier) in enumerate(zip(plan.requests, plan.tiers)):
            if tier is not Tier.GPU:
                self._forget_gpu(r.user_id)
            if b in plan.recorded:
                if plan.recorded[b]:
                    self.truncate(r.user_id, plan.recorded[b])
                else:
                    self.drop(r.user_id)
                if tier in BELOW_GPU:
                    self.below.drop(r.user_id)

    def _record(self, plan: BatchPlan, b: int) -> None:
        r = plan.requests[b]
        entry = self.users.get(r.user_id)
        if entry is None:
            entry = self.users[r.user_id] = UserEntry(self._new_history())
        plan.recorded[b] = len(entry.history)
        if plan.tiers[b] is not Tier.GPU:
            entry.gpu_first_page = plan.first_pages.get(b, 0)
        if plan.batch.cached_lens[b] == 0:
            # A miss recomputed the whole history (the old one + the new items): any older copy below is stale.
            entry.history.clear()
            self.below.truncate(r.user_id, 0)
        entry.history.extend(plan.appended[b])
        try:
            self._offload(r.user_id, entry, plan.page_rows[b])
        except (PoolExhausted, ValueError, OSError, TransferError) as e:
            # The scores stand; the user stays a GPU hit with no copy below (recomputed if evicted later).
            log.warning("offload of user %s not started: %s", r.user_id, e)

    def wait_offloads(self) -> None:
        """Block until every offload landed (benchmarks, shutdown); deferred onboardings stay kept (runtime/deferred.py:
        the next launch gives them back, so a benchmark's untimed wait here does not hide their cost)."""
        for user in self._offloading:
            settle(self.users[user].offload)
        self._reap_offloads()

    def truncate(self, user: int, num_tokens: int) -> None:
        """Forget a user's history past `num_tokens` (retracted interactions; benchmarks replay one request so);
        the kept prefix's cached K/V stay valid (positions are absolute)."""
        entry = self.users.get(user)
        if entry is None or not 0 <= num_tokens <= len(entry.history):
            have = None if entry is None else len(entry.history)
            raise ValueError(f"user {user}: cannot truncate to {num_tokens} tokens (history has {have})")
        settle(entry.offload)
        self._reap_offloads()
        entry.history.truncate(num_tokens)
        self.below.truncate(user, num_tokens)

    def evict_from_gpu(self, user: int) -> None:
        """Drop a user's GPU pages once its host copy is complete (the cpu_hit set-up of the benchmark)."""
        settle(self.users[user].offload)
        self._reap_offloads()
        self.gpu.free(user)

    def evict_from_host(self, user: int) -> None:
        """Move a user's host copy down to SSD (or nowhere without one)."""
        self.deferred.release()   # a pinned host copy would stay behind
        settle(self.users[user].offload)
        self._reap_offloads()
        self.below.evict(user)

    def drop(self, user: int) -> None:
        """Forget a user everywhere: history, GPU pages and the tier below's copies."""
        self.deferred.release()
        entry = self.users.pop(user, None)
        if entry is not None:
            settle(entry.offload)
        self._offloading.discard(user)
        self._reap_offloads()
        if user in self.gpu:
            self.gpu.free(user)
        self.below.drop(user)

    # ---- moves --------------------------------------------------------------------------------

    def _gpu_can_drop(self, user: int) -> bool:
        entry = self.users.get(user)
        return entry is None or not entry.offloading()

    def _forget_gpu(self, user: int) -> None:
        if user in self.gpu and not self.gpu.pin_count(user):
            self.gpu.free(user)

    def _onboard(self, plan: BatchPlan, cached_lens: list[int]) -> None:
        """One onboarding for every host/SSD hit: all users and layer groups, one counter (windowed: pages read)."""
        ps = self.gpu.page_size
        loads = []
        for b, (r, tier, cached, pages) in enumerate(zip(plan.requests, plan.tiers, cached_lens, plan.page_rows)):
            if tier not in BELOW_GPU:
                continue
            first, last = self._first_page(r, cached), -(-cached // ps)
            plan.first_pages[b] = first
            if first < last:
                loads.append(Load(r.user_id, tier, cached, pages[first:last], first_page=first))
        if loads:
            self.deferred.before_onboard(loads, self.below.signals.num_counters)
            plan.onboarding = self.below.onboard(loads, self.layerwise, after=plan.reuse_fences)

    def _allocate(self, user: int, tokens: int, fences: list[Transfer]) -> tuple[int, ...]:
        """GPU pages for `tokens` tokens of `user`, evicting LRU users whose offload landed, or (`orders_reuse`) any
        unpinned LRU user: the in-flight offloads still reading the pages it gets are added to `fences`. When the
        pool is short, wait for the offloads of users eviction could then take, least recently used first, retrying
        after each; then a PoolExhausted names the sizes (the caller can retry later, or shed load). A pinned user's
        offload is never waited for: its pages stay taken either way, and under serving it is the batch in flight's,
        whose offload lands only after that batch computes (a prepare ahead would wait for the device)."""
        if self.below.orders_reuse:
            got = self.gpu.allocate(user, tokens, can_drop=_always, on_evict=self._fence_pages)
            if self._fences and got.new:
                fences.extend(t for pages, t in self._fences if not pages.isdisjoint(got.new) and t not in fences)
            return got.pages
        waited: set[int] = set()   # a transfer that timed out stays not done: never wait for it twice
        while True:
            try:
                return self.gpu.allocate(user, tokens, can_drop=self._gpu_can_drop).pages
            except PoolExhausted:
                waitable = next((u for u in self.gpu.users() if u in self._offloading and u not in waited
                                 and u != user and not self.gpu.pin_count(u)), None)
                if waitable is None:
                    raise
            waited.add(waitable)
            settle(self.users[waitable].offload)
            self._reap_offloads()

    def _fence_pages(self, victim: int) -> None:
        """Before an evicted user's pages are freed: remember the offload still reading them."""
        entry = self.users.get(victim)
        if entry is not None and entry.offloading():
            self._fences.append((frozenset(self.gpu.pages(victim)), entry.offload))

    @property
    def quarantined_pages(self) -> int:
        """GPU pages held back from failed onboardings whose producer has not ended yet."""
        return self.quarantine.pages

    def _offload(self, user: int, entry: UserEntry, pages: tuple[int, ...]) -> None:
        """Copy the pages this batch wrote down to the tier below (asynchronously)."""
        if not len(entry.history):
            return
        earlier = entry.offload
        if earlier is not None and not self.below.orders_reuse:
            settle(earlier)   # in flight, or ended but not reaped: its bookkeeping must not be lost
            self._reap_offloads()
            earlier = None
        items = entry.history if isinstance(entry.history, ItemHistory) else None
        offload = self.below.offload(user, len(entry.history), pages, entry.gpu_first_page, history=items)
        if earlier is not None and not earlier.done():   # the user's offloads in flight, all of them
            offload = AllOf([*(earlier.transfers if isinstance(earlier, AllOf) else [earlier]), offload])
        entry.offload = offload
        self._offloading.add(user)

    def _reap_offloads(self) -> None:
        """Forget finished offloads, looking only at those in flight (no cost per idle user); the tier reaps its own."""
        for user in [u for u in self._offloading if self.users[u].offload.done()]:
            self.users[user].offload = None
            self._offloading.discard(user)
        if self._fences:
            self._fences = [(pages, t) for pages, t in self._fences if not t.done()]
        self.below.reap()


def _always(user: int) -> bool:
    return True
