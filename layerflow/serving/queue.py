"""The requests waiting to be batched: bounded, in arrival order, and the rule that picks the next batch from them.

A batch takes the oldest queued requests in arrival order, at most one per user and only a user's oldest queued
request, skipping users that are busy (the scheduler's choice: in a prepared batch, and in the batch in flight unless
it chains): so two requests of one user are served in arrival order and never share a batch. A batch
is capped in requests and in query tokens (appended items + candidates: the engine's largest graph bucket). With
`wait`, `take` holds the batch back until it is full or its oldest request has waited `max_wait_s`.

Paced (`paced`, on by default): while more requests are queued than one batch holds, a batch is full at its share of
the queue, ceil(queued / backlog) requests, where the backlog is the most requests one user has queued, and those
users' requests are taken first. Why: a user's requests go one per batch, so at least `backlog` more batches will
run anyway; taking the oldest requests up to the batch cap instead fills the first batches and leaves that user's
last requests to GPU-hit batches of their own at the end, run one after another with the copy engine idle (under
Zipf 1.0 the hottest user sends about a fifth of the requests; on the H200, 23-25 such batches after a 300-request
run's last copy). Spread over the batches the backlog needs anyway, each batch carries its share of host hits
(session 16: 824 / 840 req/s against 774 / 798 at 960 / 1400/s offered, docs/serving.md).

`take` runs for every batch and every poll of the scheduler, so it looks only at what it must: the queue is scanned
for expired requests only once the earliest queued deadline has passed, and a request cancelled by its caller leaves
when a batch reaches it (or when the queue is full), not on every take.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from layerflow.runtime.request import Request
from layerflow.serving.errors import QueueFull, ShuttingDown

_sequence = itertools.count()


@dataclass(eq=False)
class Pending:
    """One submitted request: its future, when it arrived and when it expires (`time.monotonic()` seconds)."""

    request: Request
    future: Future
    arrived: float
    deadline: float | None
    seq: int = field(default_factory=lambda: next(_sequence))

    @property
    def user(self) -> int:
        return self.request.user_id

    @property
    def tokens(self) -> int:
        """Query tokens of the request on the cached path (appended items + candidates)."""
        return len(self.request.items) + len(self.request.candidates)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


@dataclass(frozen=True)
class Taken:
    """What one `take` removed from the queue: the batch, and requests that expired or were cancelled meanwhile."""

    batch: list[Pending]
    expired: list[Pending]


class RequestQueue:
    """Thread-safe: any thread `put`s, the scheduler thread `take`s and `requeue`s."""

    def __init__(self, max_size: int, max_batch: int, max_tokens: int, max_wait_s: float, paced: bool = True) -> None:
        for name, value in (("max_size", max_size), ("max_batch", max_batch), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s={max_wait_s!r}: must be >= 0")
        self.max_size, self.max_batch, self.max_tokens, self.max_wait_s = max_size, max_batch, max_tokens, max_wait_s
        self.paced = paced
        self._items: deque[Pending] = deque()
        self._per_user: dict[int, int] = {}   # queued requests per user
        self._next_deadline = math.inf   # no queued request expires before this (a lower bound of the earliest)
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, pending: Pending) -> list[Pending]:
        """Queue `pending`, or raise QueueFull / ShuttingDown. Returns the requests found expired to make room (the
        caller answers them)."""
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down: no new requests")
            expired = []
            if len(self._items) >= self.max_size:
                expired = self._remove_expired(time.monotonic(), cancelled=True)
            if len(self._items) >= self.max_size:
                raise QueueFull(f"{len(self._items)} requests queued (serve_max_queue={self.max_size}): retry later")
            self._items.append(pending)
            self._count(pending, 1)
            self._note_deadline(pending)
            self._cond.notify_all()
            return expired

    def requeue(self, pendings: Iterable[Pending]) -> None:
        """Put requests taken earlier back at the head, in their order (they are older than what is queued)."""
        with self._cond:
            pendings = list(pendings)
            self._items.extendleft(reversed(pendings))
            for p in pendings:
                self._count(p, 1)
                self._note_deadline(p)
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse new requests from now on; `take` then hands out what is queued without waiting, and once the queue
        is empty `take(wait=True)` returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def users(self, oldest: int) -> set[int]:
        """The users of the `oldest` requests queued longest."""
        with self._cond:
            return {p.user for p in itertools.islice(self._items, oldest)}

    def clear(self) -> list[Pending]:
        """Remove and return everything queued."""
        with self._cond:
            items, self._items = list(self._items), deque()
            self._per_user = {}
            return items

    def take(self, busy: set[int], wait: bool, full_only: bool = False) -> Taken | None:
        """The next batch (see the module docstring) and the requests that expired or were cancelled meanwhile.

        Without `wait`, whatever batch can be formed now (maybe empty; with `full_only`, empty unless it is full).
        With `wait`, block until a batch is ready or something expired; None once the queue is closed and empty. A
        closed queue's batches are ready at once.
        """
        with self._cond:
            while True:
                now = time.monotonic()
                expired = self._remove_expired(now)
                batch, full = self._eligible(busy)
                if full_only and not full:
                    batch = []
                ready = bool(batch) and (full or self._closed or now - batch[0].arrived >= self.max_wait_s)
                if ready or not wait:
                    for p in batch:
                        self._remove(p)
                    return Taken(batch, expired)
                if expired:
                    return Taken([], expired)
                if self._closed and not self._items:
                    return None
                self._cond.wait(self._wake_in(now, batch))

    def wait_for_put(self, timeout_s: float) -> None:
        """Block until a request is put or requeued, the queue closes, or `timeout_s` passes (the scheduler's pause
        while a batch computes and nothing is ready to prepare)."""
        with self._cond:
            self._cond.wait(timeout_s)

    def _eligible(self, busy: set[int]) -> tuple[list[Pending], bool]:
        """The batch that can be formed now, and whether it is full (in requests, at its paced share, or the next
        one's tokens). Cancelled requests it reaches leave the queue."""
        cap, backlog, longest = self.max_batch, 0, set()
        if self.paced and len(self._items) > self.max_batch:
            backlog = max(self._per_user.values())
            cap = min(cap, -(-len(self._items) // backlog))
            if backlog > 1:
                longest = {u for u, n in self._per_user.items() if n == backlog and u not in busy}
        critical = frozenset(longest)   # taken first: their backlog sets how many batches the queue needs
        first: list[Pending] = []   # each eligible user's oldest request, in queue order
        cancelled: list[Pending] = []
        blocked = set(busy)
        for p in self._items:
            user = p.user
            if user in blocked:
                continue
            if p.future.cancelled():
                cancelled.append(p)
                continue
            blocked.add(user)
            first.append(p)
            longest.discard(user)
            if len(first) >= cap and not longest:   # every longest-backlog user met (their oldest is near the head)
                break
        for p in cancelled:
            self._remove(p)
        if critical:   # the users with the longest backlog first, then the oldest
            ahead = [p for p in first if p.user in critical][:cap]
            rest = [p for p in first if p.user not in critical][:cap - len(ahead)]
            first = sorted(ahead + rest, key=lambda p: p.seq)
        picked: list[Pending] = []
        tokens = 0
        for p in first[:cap]:
            if picked and tokens + p.tokens > self.max_tokens:
                return picked, True
            picked.append(p)
            tokens += p.tokens
        return picked, len(picked) == cap

    def _count(self, pending: Pending, delta: int) -> None:
        left = self._per_user.get(pending.user, 0) + delta
        if left:
            self._per_user[pending.user] = left
        else:
            del self._per_user[pending.user]

    def _remove(self, pending: Pending) -> None:
        self._items.remove(pending)
        self._count(pending, -1)

    def _note_deadline(self, pending: Pending) -> None:
        if pending.deadline is not None and pending.deadline < self._next_deadline:
            self._next_deadline = pending.deadline

    def _remove_expired(self, now: float, cancelled: bool = False) -> list[Pending]:
        """Remove the requests whose deadline passed (and, with `cancelled`, the cancelled ones) and return those
        not cancelled. Without `cancelled`, nothing is scanned while the earliest deadline is ahead."""
        if not cancelled and now < self._next_deadline:
            return []
        gone = [p for p in self._items if p.expired(now) or p.future.cancelled()]
        for p in gone:
            self._remove(p)
        self._next_deadline = min((p.deadline for p in self._items if p.deadline is not None), default=math.inf)
        return [p for p in gone if not p.future.cancelled()]

    def _wake_in(self, now: float, batch: list[Pending]) -> float | None:
        """Seconds until the batch's wait ends or the earliest deadline passes (None: until a put or close)."""
        times = [self._next_deadline] if self._next_deadline < math.inf else []
        if batch:
            times.append(batch[0].arrived + self.max_wait_s)
        return max(0.0, min(times) - now) if times else None
