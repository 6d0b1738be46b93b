"""Free indices of a fixed range kept as sorted, merged runs, handed out in contiguous runs where possible.

Every run is one strided copy per layer for the copy engine, so both KV pools allocate through this.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import numpy as np


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
