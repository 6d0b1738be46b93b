"""The batching rule on known queues: arrival order, one request per user, busy users skipped, the caps, the wait."""

import time
from concurrent.futures import Future

import pytest

from layerflow.runtime.request import Request
from layerflow.serving.errors import QueueFull, ShuttingDown
from layerflow.serving.queue import Pending, RequestQueue


def pending(user: int, tokens: int = 2, deadline: float | None = None, arrived: float | None = None) -> Pending:
    return Pending(Request(user, [1] * (tokens // 2), [2] * (tokens - tokens // 2)), Future(),
                   time.monotonic() if arrived is None else arrived, deadline)


def users(batch: list[Pending]) -> list[int]:
    return [p.user for p in batch]


def queue_of(*items: Pending, max_size: int = 16, max_batch: int = 3, max_tokens: int = 100,
             max_wait_s: float = 0.0) -> RequestQueue:
    q = RequestQueue(max_size, max_batch, max_tokens, max_wait_s)
    for p in items:
        assert q.put(p) == []
    return q


def test_a_batch_is_the_oldest_request_of_each_free_user_in_arrival_order():
    q = queue_of(pending(5), pending(5), pending(7), pending(8), pending(7), pending(9), max_batch=3)
    first = q.take(busy=set(), wait=False).batch
    assert users(first) == [5, 7, 8]
    assert users(q.take(busy={5, 7, 8}, wait=False).batch) == [9]
    assert users(q.take(busy=set(), wait=False).batch) == [5, 7]


def test_a_busy_users_later_requests_wait_behind_it():
    q = queue_of(pending(1), pending(2), pending(1))
    assert users(q.take(busy={1}, wait=False).batch) == [2]
    assert users(q.take(busy={1}, wait=False).batch) == []
    assert len(q) == 2


def test_the_token_cap_closes_a_batch_but_a_lone_large_request_still_goes():
    q = queue_of(pending(1, tokens=60), pending(2, tokens=50), pending(3, tokens=30), max_tokens=100)
    assert users(q.take(busy=set(), wait=False).batch) == [1]
    assert users(q.take(busy=set(), wait=False).batch) == [2, 3]
    q = queue_of(pending(4, tokens=500), max_tokens=100)
    assert users(q.take(busy=set(), wait=True).batch) == [4]


def test_waiting_holds_a_partial_batch_until_its_oldest_request_waited_max_wait():
    q = queue_of(pending(1, arrived=time.monotonic() - 10), max_batch=2, max_wait_s=5.0)
    assert users(q.take(busy=set(), wait=True).batch) == [1]     # waited 10 s > 5 s: goes at once
    q = queue_of(pending(1), pending(2), max_batch=2, max_wait_s=60.0)
    assert users(q.take(busy=set(), wait=True).batch) == [1, 2]  # full: goes at once
    q = queue_of(pending(1), max_batch=2, max_wait_s=60.0)
    q.close()
    assert users(q.take(busy=set(), wait=True).batch) == [1]     # closing: drained without waiting
    assert q.take(busy=set(), wait=True) is None


def test_requeued_requests_go_back_to_the_head_in_order():
    q = queue_of(pending(1), pending(2), pending(3), pending(4), max_batch=2)
    taken = q.take(busy=set(), wait=False).batch
    q.requeue(taken)
    assert users(q.take(busy=set(), wait=False).batch) == [1, 2]
    q.requeue(taken[1:])
    assert users(q.take(busy=set(), wait=False).batch) == [2, 3]


def test_expired_and_cancelled_requests_leave_the_queue():
    gone = pending(1, deadline=time.monotonic() - 1)
    cancelled = pending(2)
    assert cancelled.future.cancel()
    q = queue_of(gone, cancelled, pending(3))
    taken = q.take(busy=set(), wait=False)
    assert users(taken.batch) == [3] and taken.expired == [gone]
    assert len(q) == 0


def test_a_full_queue_refuses_at_once_unless_an_expired_request_makes_room():
    q = queue_of(pending(1), pending(2, deadline=time.monotonic() - 1), max_size=2)
    late = q.put(pending(3))
    assert users(late) == [2]
    with pytest.raises(QueueFull, match="serve_max_queue=2"):
        q.put(pending(4))
    q.close()
    with pytest.raises(ShuttingDown):
        q.put(pending(5))


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_batch=0"):
        RequestQueue(4, 0, 10, 0.0)
    with pytest.raises(ValueError, match="max_wait_s=-1"):
        RequestQueue(4, 1, 10, -1)


def test_users_names_the_users_of_the_oldest_queued_requests():
    q = queue_of(pending(5), pending(5), pending(7), pending(8))
    assert q.users(oldest=3) == {5, 7}
    assert q.users(oldest=10) == {5, 7, 8}
    q.requeue([pending(9)])
    assert q.users(oldest=1) == {9}


def test_a_request_whose_deadline_passes_after_it_was_requeued_still_expires():
    soon = time.monotonic() + 0.05
    q = queue_of(pending(1, deadline=time.monotonic() + 60), pending(2))
    q.requeue([pending(3, deadline=soon)])         # earlier than any deadline queued so far
    assert users(q.take(busy={1, 2, 3}, wait=False).expired) == []
    time.sleep(max(0.0, soon - time.monotonic()) + 0.01)
    taken = q.take(busy={1, 2}, wait=False)
    assert users(taken.expired) == [3] and taken.batch == []
    assert len(q) == 2


def test_a_cancelled_request_behind_busy_users_leaves_once_a_batch_reaches_it():
    cancelled = pending(2)
    q = queue_of(pending(1), cancelled, pending(3), max_batch=1)
    assert cancelled.future.cancel()
    assert users(q.take(busy={2}, wait=False).batch) == [1]     # user 2 busy: not reached, still queued
    assert len(q) == 2
    assert users(q.take(busy=set(), wait=False).batch) == [3]   # reached: it leaves, the next user goes
    assert len(q) == 0


def test_paced_a_deep_queue_goes_out_in_shares_of_its_longest_backlog_that_user_first():
    # 9 queued, user 1 has 3 of them: three batches are needed anyway, so each takes 3, user 1's oldest among them
    q = queue_of(*(pending(u) for u in (2, 3, 4, 5, 1, 6, 1, 7, 1)), max_batch=8)
    first = q.take(busy=set(), wait=False, full_only=True).batch
    assert users(first) == [2, 3, 1]
    assert users(q.take(busy={1}, wait=False).batch) == [4, 5, 6, 7]   # 6 left, no deeper than a batch: unpaced
    assert users(q.take(busy=set(), wait=False).batch) == [1]
    assert users(q.take(busy=set(), wait=False).batch) == [1]


def test_unpaced_or_no_deeper_than_a_batch_a_queue_goes_out_in_full_batches():
    items = [pending(u) for u in (2, 3, 4, 5, 1, 6, 1, 7, 1)]
    q = queue_of(*items, max_batch=8)
    q.paced = False
    assert users(q.take(busy=set(), wait=False).batch) == [2, 3, 4, 5, 1, 6, 7]
    q = queue_of(*(pending(u) for u in (2, 1, 3, 1)), max_batch=4)
    assert users(q.take(busy=set(), wait=False).batch) == [2, 1, 3]

