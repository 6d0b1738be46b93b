"""The host tier's policy, written once: what host memory and the SSD hold per user, and every move between them.

The in-process tier and the transfer server both keep their KV here; they differ only in who issues the copies to the
GPU and who waits for them. Per user the cache knows how many tokens of its history the host copy holds (a valid
prefix: positions are absolute, so a truncated history keeps the K/V of its first tokens) and how many the SSD copy
holds. Rules:
- A host copy is written by an offload from the first page it does not hold yet; while the offload is in flight the
  user is pinned. A new host copy makes the SSD copy stale, so the SSD copy is dropped.
- The host evicts least recently used unpinned users when it needs room, spilling each to SSD first (unless the SSD
  already holds the same copy: one read back from SSD and not offloaded since).
- An onboarding pins every user it reads. Users found only on SSD get host blocks (host-resident users of the same
  onboarding are pinned first, so the read-back cannot spill them) and are read back block group by block group; each
  verified group can be handed to the copy engine as it lands. A damaged or missing SSD copy is a `Miss`: the user's
  blocks are freed and the SSD entry forgotten, never served.
Thread-safe: one lock guards the bookkeeping; SSD reads and copies run outside it on pinned blocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from layerflow.tier.base import Tier, TierUsage
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.ssd import Miss, SsdStore, tensor_block_views

log = logging.getLogger(__name__)

User = Hashable


@dataclass(frozen=True)
class Pinned:
    """One user of an onboarding, pinned on the host: its blocks in token order up to the last one onboarded, whether
    they come from SSD, and the first block the onboarding copies (an SSD read-back reads from block 0)."""

    user: User
    blocks: tuple[int, ...]
    from_ssd: bool
    first: int = 0

    @property
    def copied(self) -> tuple[int, ...]:
        """The blocks the onboarding copies to the GPU."""
        return self.blocks[self.first:]


@dataclass(frozen=True)
class OffloadSlot:
    """Where an offload writes: the user's host blocks and the first page the host copy does not hold yet."""

    blocks: tuple[int, ...]
    first: int


class HostCache:
    """A host block pool and an optional SSD store with the rules of the module docstring."""

    def __init__(self, host: HostKVPool, ssd: SsdStore | None = None) -> None:
        self.host, self.ssd = host, ssd
        self.page_size = host.page_size
        self._views = tensor_block_views(host.blocks)
        self._lock = threading.Lock()
        self._host_tokens: dict[User, int] = {}
        self._ssd_tokens: dict[str, int] = {}   # keyed as the SSD store names users: str(user)

    # ---- questions ----------------------------------------------------------------------------

    def lookup(self, user: User) -> tuple[Tier, int]:
        """Where the user's newest copy is (HOST, SSD or NONE) and how many history tokens of it are valid."""
        with self._lock:
            if user in self.host:
                return Tier.HOST, self._host_tokens.get(user, 0)
            if self.ssd is not None and str(user) in self._ssd_tokens and self.ssd.contains(user):
                return Tier.SSD, self._ssd_tokens[str(user)]
            return Tier.NONE, 0

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(host_blocks=self.host.total - self.host.num_free, host_total=self.host.total,
                             host_users=len(self.host), pinned_users=self.host.num_pinned,
                             ssd_users=0 if self.ssd is None else len(self.ssd.users()))

    # ---- onboarding ---------------------------------------------------------------------------

    def pin_for_onboard(self, loads: Sequence[tuple[User, int, int]]) -> list[Pinned]:
        """Pin every `(user, first, pages)` load (its cached pages first .. first + pages - 1), host-resident users
        first; users only on SSD get host blocks for their first `first + pages` pages (to be read back with
        `read_back`). LookupError names a user that cannot serve them; then nothing stays pinned or allocated."""
        done: dict[int, Pinned] = {}
        order = sorted(range(len(loads)), key=lambda i: loads[i][0] not in self.host)
        with self._lock:
            try:
                for i in order:
                    user, first, pages = loads[i]
                    done[i] = self._pin_one(user, first, pages)
            except BaseException:
                for p in done.values():
                    self._release_onboarded(p, failed=True)
                raise
        return [done[i] for i in range(len(loads))]

    def _pin_one(self, user: User, first: int, pages: int) -> Pinned:
        last = first + pages
        tokens = last * self.page_size
        if first < 0 or pages <= 0:
            raise LookupError(f"user {user!r}: pages {first}..{last - 1} asked")
        if user in self.host:
            held = self._host_tokens.get(user, 0)
            if -(-held // self.page_size) < last:
                raise LookupError(f"user {user!r}: pages {first}..{last - 1} asked, the host copy holds {held} tokens")
            self.host.touch(user)
            self.host.pin(user)
            return Pinned(user, self.host.pages(user)[:last], False, first)
        held = self._ssd_tokens.get(str(user), 0) if self.ssd is not None and self.ssd.contains(user) else 0
        if -(-held // self.page_size) < last:
            raise LookupError(f"user {user!r} is not resident with pages {first}..{last - 1} (host or SSD)")
        blocks = self.host.allocate(user, tokens, on_evict=self._spill).pages
        self.host.pin(user)
        self._host_tokens[user] = min(held, tokens)
        return Pinned(user, blocks[:last], True, first)

    def read_back(self, pinned: Pinned, on_group: Callable[[list[int]], None] | None = None) -> None:
        """SSD -> the pinned host blocks, group by group (`on_group(blocks)` as each verified group lands). A damaged
        or missing copy raises Miss; the caller then releases the onboarding with `failed=True`."""
        try:
            self.ssd.load(pinned.user, self._views, list(pinned.blocks), on_group=on_group)
        except Miss:
            with self._lock:
                self._ssd_tokens.pop(str(pinned.user), None)
            raise

    def release_onboarded(self, pinned: Sequence[Pinned], failed: bool) -> None:
        """Unpin an onboarding's users. After a failure, blocks read back from SSD are freed: a half-read copy must
        not pass for a host copy (the SSD entry, if it is still there, decides next time)."""
        with self._lock:
            for p in pinned:
                self._release_onboarded(p, failed)

    def _release_onboarded(self, p: Pinned, failed: bool) -> None:
        self.host.unpin(p.user)
        if failed and p.from_ssd and not self.host.pin_count(p.user):
            self.host.free(p.user)
            self._host_tokens.pop(p.user, None)

    # ---- offload ------------------------------------------------------------------------------

    def begin_offload(self, user: User, tokens: int, valid_from: int = 0) -> OffloadSlot:
        """Host blocks for `tokens` tokens of `user` (evicting and spilling LRU users if needed), pinned until
        `end_offload`; the copy needs only the pages from `first` on. The GPU holds valid pages only from
        `valid_from` on (a windowed onboarding skipped the others): a copy that would need earlier ones is refused.
        Raises PoolExhausted or ValueError (the user can never fit, or its GPU pages cannot make a whole copy) with
        nothing changed."""
        with self._lock:
            held = self._host_tokens.get(user, 0) if user in self.host else 0
            first = held // self.page_size
            if first < valid_from:
                raise ValueError(f"offload of user {user!r}: the host holds {held} tokens, the GPU pages before page "
                                 f"{valid_from} are not valid (a windowed onboarding): no whole copy to write")
            if first == 0 and user in self.host and not self.host.pin_count(user):
                self.host.free(user)  # nothing valid to keep: take fresh, contiguous blocks
            blocks = self.host.allocate(user, tokens, on_evict=self._spill).pages
            self.host.pin(user)
            self._host_tokens[user] = tokens
            self._drop_ssd(user)
            return OffloadSlot(blocks, first)

    def end_offload(self, user: User, ok: bool) -> None:
        """The offload's copies ended; a failed one leaves no host copy."""
        with self._lock:
            self.host.unpin(user)
            if not ok:
                log.warning("offload of user %r failed; its host copy is dropped", user)
                self._host_tokens.pop(user, None)
                if not self.host.pin_count(user):
                    self.host.free(user)

    # ---- forgetting ---------------------------------------------------------------------------

    def truncate(self, user: User, tokens: int) -> None:
        """Only the first `tokens` tokens of the user's copies stay valid."""
        with self._lock:
            for held, key in ((self._host_tokens, user), (self._ssd_tokens, str(user))):
                if key in held:
                    held[key] = min(held[key], tokens)

    def evict(self, user: User) -> None:
        """Move the user's host copy down to SSD (or nowhere without one)."""
        with self._lock:
            if user in self.host:
                self._spill(user)
                self.host.free(user)
                self._host_tokens.pop(user, None)

    def drop(self, user: User) -> None:
        """Forget the user on the host and on SSD (an in-flight transfer of it must have ended: the caller's job)."""
        with self._lock:
            if user in self.host:
                self.host.free(user)
            self._host_tokens.pop(user, None)
            self._drop_ssd(user)

    def _drop_ssd(self, user: User) -> None:
        self._ssd_tokens.pop(str(user), None)
        if self.ssd is not None:
            self.ssd.evict(user)

    def _spill(self, victim: User) -> None:
        """Under the lock, just before the victim's host blocks are freed: write its valid copy to SSD."""
        tokens = self._host_tokens.pop(victim, 0)
        if self.ssd is None or tokens == 0 or str(victim) in self._ssd_tokens:
            return
        blocks = self.host.pages(victim)[:-(-tokens // self.page_size)]
        try:
            dropped = self.ssd.store(victim, self._views, blocks)
        except (OSError, ValueError) as e:
            log.warning("could not spill user %r to SSD: %s", victim, e)
            return
        self._ssd_tokens[str(victim)] = tokens
        for key in dropped:  # the SSD store evicted these to make room
            self._ssd_tokens.pop(key, None)
