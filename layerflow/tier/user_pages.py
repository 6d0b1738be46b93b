"""Index bookkeeping shared by the GPU page pool and the host block pool.

`RunAllocator` hands out indices of a fixed range in contiguous runs where it can, because every run is one strided
copy per layer for the copy engine. `UserPages` gives each user an ordered list of indices (index i holds tokens
[i * page_size, (i + 1) * page_size)), keeps users in LRU order, and evicts only users that are neither pinned (batch or
transfers in flight) nor vetoed by the caller's `can_drop`. `runs` turns an index list into its contiguous runs
(the copy engine pairs GPU pages with host blocks in `copy_plan`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

from layerflow.tier.allocator import PoolExhausted, RunAllocator

User = Hashable
CanDrop = Callable[[User], bool]


class Allocation(NamedTuple):
    """Result of `UserPages.allocate`: the user's indices in token order, those just added, users evicted for them."""

    pages: tuple[int, ...]
    new: tuple[int, ...]
    evicted: tuple[User, ...]


class UserPages:
    """Per-user index lists over one `RunAllocator`, LRU order by user, pin counts and eviction.

    `drop_by_default` decides what `allocate` may evict when the caller passes no `can_drop`: a tier whose contents
    are safe elsewhere only after an offload (the GPU) says False; the last tier kept in memory (host) says True.
    """

    drop_by_default = False
    unit = "page"

    def __init__(self, total: int, page_size: int) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size={page_size!r}: must be a positive integer")
        self.page_size = page_size
        self.allocator = RunAllocator(total)
        self._owned: OrderedDict[User, list[int]] = OrderedDict()
        self._pins: dict[User, int] = {}

    @property
    def total(self) -> int:
        return self.allocator.total

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def __contains__(self, user: User) -> bool:
        return user in self._owned

    def __len__(self) -> int:
        return len(self._owned)

    def users(self) -> list[User]:
        """Resident users, least recently used first."""
        return list(self._owned)

    def _owned_by(self, user: User) -> list[int]:
        if user not in self._owned:
            raise ValueError(f"user {user!r} holds no {self.unit}s in this pool")
        return self._owned[user]

    def pages(self, user: User) -> tuple[int, ...]:
        """The user's indices in token order."""
        return tuple(self._owned_by(user))

    def capacity_tokens(self, user: User) -> int:
        return len(self._owned_by(user)) * self.page_size

    def touch(self, user: User) -> None:
        """Mark the user most recently used."""
        self._owned_by(user)
        self._owned.move_to_end(user)

    def pin(self, user: User) -> None:
        """Forbid evicting the user (counted: one `unpin` per `pin`)."""
        self._owned_by(user)
        self._pins[user] = self._pins.get(user, 0) + 1

    def unpin(self, user: User) -> None:
        if user not in self._pins:
            raise ValueError(f"user {user!r} is not pinned")
        self._pins[user] -= 1
        if not self._pins[user]:
            del self._pins[user]

    @property
    def num_pinned(self) -> int:
        """Users pinned at least once."""
        return len(self._pins)

    def pin_count(self, user: User) -> int:
        return self._pins.get(user, 0)

    def rename(self, user: User, new: User) -> None:
        """Hand `user`'s indices to `new` (a user not in the pool), keeping their order; `user` must not be pinned."""
        pages = self._owned_by(user)
        if user in self._pins:
            raise ValueError(f"user {user!r} is pinned {self._pins[user]} time(s): cannot rename it")
        if new in self._owned:
            raise ValueError(f"user {new!r} already holds {self.unit}s in this pool")
        del self._owned[user]
        self._owned[new] = pages

    def free(self, user: User) -> None:
        """Release all of a user's indices. A pinned user cannot be freed: its batch or transfer is in flight."""
        pages = self._owned_by(user)
        if user in self._pins:
            raise ValueError(f"user {user!r} is pinned {self._pins[user]} time(s): cannot free it")
        self.allocator.release(pages)
        del self._owned[user]

    def _victims(self, target_free: int, can_drop: CanDrop, keep: User | None) -> tuple[list[User], bool]:
        """LRU-first evictable users whose release reaches `target_free` free indices, and whether it does."""
        free = self.num_free
        victims: list[User] = []
        for user, pages in self._owned.items():
            if free >= target_free:
                break
            if user == keep or user in self._pins or not can_drop(user):
                continue
            victims.append(user)
            free += len(pages)
        return victims, free >= target_free

    def evict_until(self, num_free: int, can_drop: CanDrop) -> list[User]:
        """Evict least recently used users that are unpinned and `can_drop`, until `num_free` indices are free.

        Stops early when no such user is left; returns the evicted users in eviction (LRU) order.
        """
        victims, _ = self._victims(num_free, can_drop, keep=None)
        for user in victims:
            self.free(user)
        return victims

    def allocate(self, user: User, num_tokens: int, can_drop: CanDrop | None = None,
                 on_evict: Callable[[User], None] | None = None) -> Allocation:
        """Make the user's indices hold `num_tokens` tokens in all (growing an existing user) and mark it MRU.

        When free indices are short, evicts LRU users allowed by `can_drop` (or by the pool's default), never the
        user itself, and only when the eviction makes the request fit; `on_evict(victim)` runs just before each victim
        is freed (its data still in place: e.g. a spill to SSD). Raises ValueError when the user could never fit in
        this pool and PoolExhausted when it cannot fit now; nothing is evicted or allocated in either case.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r}: must be a non-negative integer")
        wanted = -(-num_tokens // self.page_size)
        if wanted > self.total:
            raise ValueError(
                f"user {user!r}: {num_tokens} tokens need {wanted} {self.unit}s of {self.page_size} tokens, "
                f"but the pool has {self.total} {self.unit}s in all"
            )
        pages = self._owned.get(user, [])
        need = wanted - len(pages)
        evicted: list[User] = []
        if need > self.num_free:
            if can_drop is None and self.drop_by_default:
                can_drop = _always
            victims, fits = self._victims(need, can_drop or _never, keep=user)
            if not fits:
                pinned = sum(len(self._owned[u]) for u in self._pins)
                raise PoolExhausted(
                    f"user {user!r}: {num_tokens} tokens need {need} more {self.unit}s; {self.num_free} free of "
                    f"{self.total}, {pinned} held by pinned users, the rest by users that may not be dropped"
                )
            for victim in victims:
                if on_evict is not None:
                    on_evict(victim)
                self.free(victim)
            evicted = victims
        new = self.allocator.allocate(need, after=pages[-1] if pages else None) if need > 0 else []
        pages.extend(new)   # in place: the user's own list (or the fresh one above)
        self._owned[user] = pages
        self._owned.move_to_end(user)
        return Allocation(tuple(pages), tuple(new), tuple(evicted))


def _always(user: User) -> bool:
    return True


def _never(user: User) -> bool:
    return False
