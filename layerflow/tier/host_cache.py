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
- With a remote store (shared with other hosts, layerflow.tier.remote_store) below: a user on neither host nor SSD is
  looked up there and read back like an SSD user. The remote copy is written from the host copy, asynchronously,
  `write_through` (after each offload: the writer keeps the offload's pin until it has read the blocks) or
  `on_evict` (when the host drops the user: the blocks are copied into the write queue first). Every offload names
  the item history it holds (the manifest carries it, so another host can `adopt` the user); a remote copy is served
  only for the history this host last offloaded or adopted for the user (a copy another host computed from another
  history is a miss).
Thread-safe: one lock guards the bookkeeping; SSD and remote reads and copies run outside it on pinned blocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from layerflow.tier.base import Tier, TierUsage
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.remote_manifest import Manifest, history_key
from layerflow.tier.remote_store import ON_EVICT, REMOTE_WRITES, WRITE_THROUGH, RemoteStore
from layerflow.tier.ssd import Miss, SsdStore, tensor_block_views

log = logging.getLogger(__name__)

User = Hashable


@dataclass(frozen=True)
class Pinned:
    """One user of an onboarding, pinned on the host: its blocks in token order up to the last one onboarded, the
    tier they are read from (HOST: already there; SSD or REMOTE: read back into them first, from block 0) and the
    first block the onboarding copies to the GPU (a step under a sliding window reads only its last pages)."""

    user: User
    blocks: tuple[int, ...]
    source: Tier
    first: int = 0

    @property
    def copied(self) -> tuple[int, ...]:
        """The blocks the onboarding copies to the GPU."""
        return self.blocks[self.first:]

    @property
    def from_ssd(self) -> bool:
        return self.source is Tier.SSD

    @property
    def reads_back(self) -> bool:
        return self.source is not Tier.HOST


@dataclass(frozen=True)
class OffloadSlot:
    """Where an offload writes: the user's host blocks and the first page the host copy does not hold yet."""

    blocks: tuple[int, ...]
    first: int


class HostCache:
    """A host block pool, an optional SSD store and an optional remote store with the rules of the module
    docstring; `remote_write` is `write_through` or `on_evict`."""

    def __init__(self, host: HostKVPool, ssd: SsdStore | None = None, remote: RemoteStore | None = None,
                 remote_write: str = WRITE_THROUGH, keep_histories: bool = False) -> None:
        """`keep_histories`: keep each host copy's item history even without a remote store, so another engine can
        `adopt` the user from this host (the transfer server's cache, shared by the engines of one host)."""
        if remote_write not in REMOTE_WRITES:
            raise ValueError(f"remote_write={remote_write!r}: expected one of {list(REMOTE_WRITES)}")
        self.host, self.ssd, self.remote, self.remote_write = host, ssd, remote, remote_write
        self.keep_histories = keep_histories or remote is not None
        self.page_size = host.page_size
        self._views = tensor_block_views(host.blocks)
        self._lock = threading.RLock()   # a remote write released from inside a call that holds it
        self._host_tokens: dict[User, int] = {}
        self._ssd_tokens: dict[str, int] = {}   # keyed as the SSD store names users: str(user)
        self._remote_tokens: dict[str, int] = {}   # tokens of a remote copy that matches this host's history
        self._histories: dict[User, np.ndarray] = {}   # item ids of the host copy's tokens (remote writes, adopt)
        self._history_keys: dict[str, tuple[int, int]] = {}   # the history a remote copy must have been made from
        self._first_changed: dict[User, int] = {}   # lowest host block rewritten since the last remote write

    # ---- questions ----------------------------------------------------------------------------

    def lookup(self, user: User) -> tuple[Tier, int]:
        """Where the user's newest copy is (HOST, SSD, REMOTE or NONE) and how many history tokens of it are valid.
        The remote store is asked outside the lock (a round trip)."""
        with self._lock:
            if user in self.host:
                return Tier.HOST, self._host_tokens.get(user, 0)
            if self.ssd is not None and str(user) in self._ssd_tokens and self.ssd.contains(user):
                return Tier.SSD, self._ssd_tokens[str(user)]
        if self.remote is None:
            return Tier.NONE, 0
        held = self._note_remote(user, self.remote.lookup(user))
        return (Tier.REMOTE, held) if held else (Tier.NONE, 0)

    def adopt(self, user: User) -> tuple[int, list[int]] | None:
        """`(tokens, item history)` of a user the asking KV manager does not know yet (None: no usable copy), so it
        can take the user over: the host copy's, when this cache keeps histories and holds one (another engine of
        this host offloaded it), else the remote copy's; from then on only a copy of that history is served."""
        with self._lock:
            history, tokens = self._histories.get(user), self._host_tokens.get(user, 0)
            if user in self.host and tokens and history is not None and len(history) >= tokens:
                return tokens, history[:tokens].tolist()
        copy = self.remote.lookup(user) if self.remote is not None else None
        if copy is None:
            return None
        with self._lock:
            self._history_keys[str(user)] = history_key(copy.history)
        self._note_remote(user, copy)
        return copy.tokens, copy.history.tolist()

    def _note_remote(self, user: User, copy: Manifest | None) -> int:
        """Tokens of `copy` this host may serve: as many as the history it last offloaded or adopted for the user
        has, if the copy was made from that history; else none."""
        key = str(user)
        with self._lock:
            expected = self._history_keys.get(key)
            held = 0
            if copy is not None and expected is not None and copy.history_key(expected[0]) == expected:
                held = expected[0]
            if held:
                self._remote_tokens[key] = held
            else:
                self._remote_tokens.pop(key, None)
            return held

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
            return Pinned(user, self.host.pages(user)[:last], Tier.HOST, first)
        source, held = Tier.SSD, self._ssd_tokens.get(str(user), 0)
        if not (self.ssd is not None and self.ssd.contains(user) and held):
            source, held = Tier.REMOTE, self._remote_tokens.get(str(user), 0)
        if -(-held // self.page_size) < last:
            raise LookupError(f"user {user!r} is not resident with pages {first}..{last - 1} (host, SSD or remote)")
        blocks = self.host.allocate(user, tokens, on_evict=self._spill).pages
        self.host.pin(user)
        self._host_tokens[user] = min(held, tokens)
        return Pinned(user, blocks[:last], source, first)

    def read_back(self, pinned: Pinned, on_group: Callable[[list[int]], None] | None = None) -> None:
        """SSD or remote store -> the pinned host blocks, group by group (`on_group(blocks)` as each verified group
        lands). A damaged, missing or unreachable copy raises Miss; the caller then releases the onboarding with
        `failed=True`."""
        store, known = (self.ssd, self._ssd_tokens) if pinned.source is Tier.SSD else (self.remote, self._remote_tokens)
        try:
            store.load(pinned.user, self._views, list(pinned.blocks), on_group=on_group)
        except Miss:
            with self._lock:
                known.pop(str(pinned.user), None)
            raise

    def release_onboarded(self, pinned: Sequence[Pinned], failed: bool) -> None:
        """Unpin an onboarding's users. After a failure, blocks read back from SSD are freed: a half-read copy must
        not pass for a host copy (the SSD entry, if it is still there, decides next time)."""
        with self._lock:
            for p in pinned:
                self._release_onboarded(p, failed)

    def _release_onboarded(self, p: Pinned, failed: bool) -> None:
        self.host.unpin(p.user)
        if failed and p.reads_back and not self.host.pin_count(p.user):
            self.host.free(p.user)
            self._host_tokens.pop(p.user, None)

    # ---- offload ------------------------------------------------------------------------------

    def begin_offload(self, user: User, tokens: int, valid_from: int = 0,
                      history: Sequence[int] | None = None) -> OffloadSlot:
        """Host blocks for `tokens` tokens of `user` (evicting and spilling LRU users if needed), pinned until
        `end_offload`; the copy needs only the pages from `first` on. The GPU holds valid pages only from
        `valid_from` on (a windowed onboarding skipped the others): a copy that would need earlier ones is refused.
        `history`: the item id of each of the tokens (needed for the user's remote copy). Raises PoolExhausted or
        ValueError (the user can never fit, its GPU pages cannot make a whole copy, or a history of another length)
        with nothing changed."""
        if history is not None and len(history) != tokens:
            raise ValueError(f"user {user!r}: a history of {len(history)} items for {tokens} tokens")
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
            if self.remote is not None:
                self._first_changed[user] = min(self._first_changed.get(user, first), first)
            if self.keep_histories:
                self._histories.pop(user, None)
                if history is not None:
                    self._histories[user] = np.asarray(history, dtype=np.int64)
                    if self.remote is not None:
                        self._history_keys[str(user)] = history_key(self._histories[user])
            return OffloadSlot(blocks, first)

    def end_offload(self, user: User, ok: bool) -> None:
        """The offload's copies ended; a failed one leaves no host copy (nor does a later offload of the user that
        overlapped it: it copied only the pages after the failed one's). Writing through, the remote write takes
        over the offload's pin."""
        with self._lock:
            if ok and self.remote_write == WRITE_THROUGH and self._write_remote(user, pinned=True):
                return
            self.host.unpin(user)
            if not ok:
                log.warning("offload of user %r failed; its host copy is dropped", user)
                self._host_tokens.pop(user, None)
            if user not in self._host_tokens and user in self.host and not self.host.pin_count(user):
                self.host.free(user)

    # ---- forgetting ---------------------------------------------------------------------------

    def truncate(self, user: User, tokens: int) -> None:
        """Only the first `tokens` tokens of the user's copies stay valid (the remote one too)."""
        with self._lock:
            for held, key in ((self._host_tokens, user), (self._ssd_tokens, str(user)),
                              (self._remote_tokens, str(user))):
                if key in held:
                    held[key] = min(held[key], tokens)
            if user in self._histories:
                self._histories[user] = self._histories[user][:tokens]
            if self.remote is None:
                return
            self._first_changed[user] = min(self._first_changed.get(user, tokens), tokens // self.page_size)
            known = self._history_keys.get(str(user))
            if known is not None and known[0] > tokens:
                # the prefix's key needs its items: without the host copy's, no remote copy is served until the next
                # offload names the history again
                history = self._histories.get(user)
                self._history_keys[str(user)] = history_key(history) if history is not None else (tokens, None)
            self.remote.truncate(user, tokens)

    def evict(self, user: User) -> None:
        """Move the user's host copy down to SSD or the remote store (on_evict), or nowhere without them."""
        with self._lock:
            if user in self.host:
                self._spill(user)
                self._free_host(user)

    def drop(self, user: User) -> None:
        """Forget the user on the host, on SSD and in the remote store (an in-flight transfer of it must have ended:
        the caller's job)."""
        with self._lock:
            self._free_host(user)
            self._drop_ssd(user)
            if self.remote is not None:
                self._remote_tokens.pop(str(user), None)
                self._history_keys[str(user)] = (0, None)   # no remote copy is served until an offload or adopt
                self._first_changed.pop(user, None)
                self.remote.evict(user)

    def close(self) -> None:
        """Close the SSD store and the remote store (which first runs its queued writes)."""
        if self.ssd is not None:
            self.ssd.close()
        if self.remote is not None:
            self.remote.close()

    def _free_host(self, user: User) -> None:
        """Forget the host copy; its blocks go back now, or when the remote write still reading them ends."""
        self._host_tokens.pop(user, None)
        self._histories.pop(user, None)
        if user in self.host and not self.host.pin_count(user):
            self.host.free(user)

    def _drop_ssd(self, user: User) -> None:
        self._ssd_tokens.pop(str(user), None)
        if self.ssd is not None:
            self.ssd.evict(user)

    def _write_remote(self, user: User, pinned: bool) -> bool:
        """Under the lock: queue a remote write of the user's host copy (pinned: read from the host blocks, which
        stay pinned until the writer is done; else copied now). True if the remote store took it."""
        tokens, history = self._host_tokens.get(user, 0), self._histories.get(user)
        if self.remote is None or not tokens or history is None or user not in self.host:
            return False
        if self._remote_tokens.get(str(user)) == tokens and user not in self._first_changed:
            return False   # the remote copy already is this one (read back from it, not offloaded since)
        blocks = self.host.pages(user)[:-(-tokens // self.page_size)]
        if pinned:
            read, held, release = self._block_bytes(blocks), 0, _once(lambda: self._release_write(user))
        else:
            snapshot = [b"".join(self._views(b)) for b in blocks]
            read, held, release = snapshot.__getitem__, len(blocks) * self.host.layout.page_bytes, _nothing
        if not self.remote.store(user, history, len(blocks), read, release,
                                 self._first_changed.get(user, 0), held):
            return False
        self._first_changed.pop(user, None)
        self._remote_tokens[str(user)] = tokens
        return True

    def _block_bytes(self, blocks: Sequence[int]) -> Callable[[int], bytes]:
        return lambda i: b"".join(self._views(blocks[i]))

    def _release_write(self, user: User) -> None:
        """The remote writer has read the user's pinned blocks: unpin them (and free them if the copy was dropped)."""
        with self._lock:
            self.host.unpin(user)
            if user not in self._host_tokens and not self.host.pin_count(user):
                self.host.free(user)

    def _spill(self, victim: User) -> None:
        """Under the lock, just before the victim's host blocks are freed: write its valid copy to SSD and, on_evict,
        to the remote store."""
        if self.remote_write == ON_EVICT:
            self._write_remote(victim, pinned=False)
        self._histories.pop(victim, None)
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


def _once(call: Callable[[], None]) -> Callable[[], None]:
    done = threading.Event()

    def run() -> None:
        if not done.is_set():
            done.set()
            call()
    return run


def _nothing() -> None:
    pass
