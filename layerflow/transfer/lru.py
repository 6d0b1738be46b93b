"""Index bookkeeping shared by the GPU page pool and the host block pool.

`RunAllocator` hands out indices of a fixed range in contiguous runs where it can, because every run is one strided
copy per layer for the copy engine. `UserPages` gives each user an ordered list of indices (index i holds tokens
[i * page_size, (i + 1) * page_size)), keeps users in LRU order, and evicts only users that are neither pinned (batch or
transfers in flight) nor vetoed by the caller's `can_drop`. `runs` turns an index list into its contiguous runs
(the copy engine pairs GPU pages with host blocks in `copy_plan`).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

User = Hashable
CanDrop = Callable[[User], bool]


class PoolExhausted(RuntimeError):
    """Not enough free indices even after evicting every user that may go; retry once pins are released."""


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs `(start, length)` of consecutive ascending indices, in list order."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [idx.size])))
    return list(zip(idx[starts].tolist(), lengths.tolist()))


class RunAllocator:
    """Free indices of `range(total)` kept as sorted, merged runs.

    A request takes the lowest free run that holds it whole (a fresh allocator returns 0..n-1); when no run is long
    enough it takes the longest runs first, so a fragmented request still has few runs.
    """

    def __init__(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total={total!r}: must be a non-negative integer")
        self.total = total
        self._starts: list[int] = [0] if total else []
        self._length: dict[int, int] = {0: total} if total else {}
        self.num_free = total

    def free_runs(self) -> list[tuple[int, int]]:
        """The free runs `(start, length)`, ascending."""
        return [(s, self._length[s]) for s in self._starts]

    def _take(self, pos: int, count: int) -> list[int]:
        """Take `count` indices from the front of the run at `pos` of the sorted starts."""
        start = self._starts[pos]
        length = self._length.pop(start)
        if count == length:
            del self._starts[pos]
        else:
            self._starts[pos] = start + count
            self._length[start + count] = length - count
        self.num_free -= count
        return list(range(start, start + count))

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` free indices; if `after` is given, continue right after it first when that index is free."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count={count!r}: must be a non-negative integer")
        if count > self.num_free:
            raise PoolExhausted(f"{count} indices requested, {self.num_free} free of {self.total}")
        out: list[int] = []
        if after is not None and count and (after + 1) in self._length:
            pos = bisect.bisect_left(self._starts, after + 1)
            out = self._take(pos, min(count, self._length[after + 1]))
        pieces: list[list[int]] = []
        remaining = count - len(out)
        while remaining:
            fit = next((i for i, s in enumerate(self._starts) if self._length[s] >= remaining), None)
            if fit is not None:
                pieces.append(self._take(fit, remaining))
                break
            longest = max(range(len(self._starts)), key=lambda i: self._length[self._starts[i]])
            pieces.append(self._take(longest, self._length[self._starts[longest]]))
            remaining -= len(pieces[-1])
        for piece in sorted(pieces):
            out.extend(piece)
        return out

    def release(self, indices: Iterable[int]) -> None:
        """Return indices to the free list, merging neighbouring runs. Raises on out-of-range or double release."""
        idx = sorted(indices)
        if len(set(idx)) != len(idx):
            raise ValueError(f"indices released twice in one call: {idx}")
        if idx and (idx[0] < 0 or idx[-1] >= self.total):
            raise ValueError(f"indices out of range [0, {self.total}): {idx[0]}..{idx[-1]}")
        for start, length in runs(idx):
            self._insert(start, length)

    def _insert(self, start: int, length: int) -> None:
        pos = bisect.bisect_left(self._starts, start)
        end = start + length
        if pos > 0:
            prev = self._starts[pos - 1]
            if prev + self._length[prev] > start:
                raise ValueError(f"indices {start}..{end - 1} overlap free run {prev}..{prev + self._length[prev] - 1}")
        if pos < len(self._starts) and self._starts[pos] < end:
            nxt = self._starts[pos]
            raise ValueError(f"indices {start}..{end - 1} overlap free run {nxt}..{nxt + self._length[nxt] - 1}")
        self.num_free += length
        if pos < len(self._starts) and self._starts[pos] == end:
            length += self._length.pop(end)
            del self._starts[pos]
        if pos > 0 and self._starts[pos - 1] + self._length[self._starts[pos - 1]] == start:
            self._length[self._starts[pos - 1]] += length
            return
        self._starts.insert(pos, start)
        self._length[start] = length


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

    def pin_count(self, user: User) -> int:
        return self._pins.get(user, 0)

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
        new = self.allocator.allocate(max(need, 0), after=pages[-1] if pages else None)
        pages = pages + new
        self._owned[user] = pages
        self._owned.move_to_end(user)
        return Allocation(tuple(pages), tuple(new), tuple(evicted))


def _always(user: User) -> bool:
    return True


def _never(user: User) -> bool:
    return False
