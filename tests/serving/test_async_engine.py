"""The asynchronous engine on the CPU path: batching keeps every user's order and the sequential scores, prefetch
onboards the next batch before the current one is collected (and waits when the pool cannot hold both), deadlines
give prepared pins and pages back, a failed batch fails only the request that fails again, close drains."""

import threading
import time

import pytest
import torch

from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.serving.async_engine import POLICIES, AsyncEngine
from layerflow.serving.errors import DeadlineExceeded, ShuttingDown
from layerflow.tier.base import Tier
from layerflow.transfer.errors import TransferError
from layerflow.transfer.issue_thread import IssueThreadCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.faults import FaultyThreadCopyEngine
from tests.serving.helpers import (MODEL, TOL, WAIT_S, FailingCollect, HeldEngine, config, sequential_scores,
                                   visits, wait_until)


def close_to(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=TOL, rtol=TOL)


def history(user: int, n: int) -> Request:
    return Request(user, [(user * 37 + i) % MODEL.item_vocab_size for i in range(n)], [])


def on_host(engine, lengths: dict[int, int]) -> None:
    """First visits with `lengths[user]` history items, then every such user evicted to the host."""
    for user, n in lengths.items():
        engine.score([history(user, n)])
    engine.kv.wait_offloads()
    for user in lengths:
        if user in engine.kv.gpu:
            engine.kv.evict_from_gpu(user)


def behind_a_blocker(engine: HeldEngine, serving: AsyncEngine, requests: list[Request]) -> list:
    """Submit `requests` while another request's launch is held, so they are all queued when the scheduler next
    forms a batch (one batch of them all, if it may be that large)."""
    engine.launch_gate.close()
    blocker = serving.submit(Request(99, [1], [2]))
    assert engine.launch_gate.entered.wait(WAIT_S)
    futures = [serving.submit(r) for r in requests]
    wait_until(lambda: len(serving.queue) == len(requests), "every request queued")
    engine.launch_gate.open()
    blocker.result(WAIT_S)
    return futures


@pytest.mark.parametrize("policy", POLICIES)
def test_concurrent_submitters_get_the_sequential_scores_in_batches_of_distinct_users(weights, policy):
    requests = visits(seed=1, users=list(range(12)), rounds=4)
    expected = dict(zip(map(id, requests), sequential_scores(weights, requests)))
    results: dict[int, torch.Tensor] = {}
    with HeldEngine(weights, config(serve_max_batch_size=4)) as engine, \
            AsyncEngine(engine, policy=policy) as serving:
        engine.launch_gate.close()
        blocker = serving.submit(Request(99, [1, 2], [3]))
        assert engine.launch_gate.entered.wait(WAIT_S)

        def client(users):
            mine = [r for r in requests if r.user_id in users]
            futures = [serving.submit(r) for r in mine]
            for r, f in zip(mine, futures):
                results[id(r)] = f.result(WAIT_S).scores

        threads = [threading.Thread(target=client, args=(set(range(k, 12, 3)),)) for k in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(serving.queue) == len(requests), "every request queued")
        engine.launch_gate.open()
        for t in threads:
            t.join()
        blocker.result(WAIT_S)
        batches = engine.launched
    assert all(close_to(results[id(r)], expected[id(r)]) for r in requests)
    assert max(len(b) for b in batches) == 4
    assert all(len({r.user_id for r in b}) == len(b) for b in batches)


@pytest.mark.parametrize("copy_thread", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_stream_beyond_the_gpu_pool_gets_the_sequential_scores_and_leaves_no_pins(weights, policy, copy_thread):
    """A pool for about 5 of the 12 users: most returns are host hits, onboarded under each policy's batching, their
    copies issued by the scheduler thread or by the copy thread (`copy_thread`)."""
    requests = visits(seed=4, users=list(range(12)), rounds=4)
    expected = sequential_scores(weights, requests)
    with HeldEngine(weights, config(serve_max_batch_size=4, gpu_pages=16, copy_thread=copy_thread)) as engine, \
            AsyncEngine(engine, policy=policy) as serving:
        assert isinstance(engine.kv.below.engine, IssueThreadCopyEngine) is copy_thread
        served = [f.result(WAIT_S) for f in [serving.submit(r) for r in requests]]
        assert engine.kv.gpu.num_pinned == 0
    assert sum(s.tier is Tier.HOST for s in served) >= 24
    assert all(close_to(s.scores, e) for s, e in zip(served, expected))


@pytest.mark.parametrize("policy", POLICIES)
def test_one_users_queued_requests_are_served_in_arrival_order_each_seeing_the_last(weights, policy):
    requests = [Request(7, [i, i + 1], [i + 2, 3]) for i in range(10)]
    others = visits(seed=2, users=[1, 2], rounds=5)
    stream = [r for pair in zip(requests, others) for r in pair]
    expected = sequential_scores(weights, stream)
    with HeldEngine(weights, config(serve_max_batch_size=8)) as engine, \
            AsyncEngine(engine, policy=policy) as serving:
        engine.launch_gate.close()
        futures = [serving.submit(r) for r in stream]
        assert engine.launch_gate.entered.wait(WAIT_S)
        engine.launch_gate.open()
        scores = [f.result(WAIT_S).scores for f in futures]
        launched = [r for batch in engine.launched for r in batch if r.user_id == 7]
    assert launched == requests
    assert all(close_to(s, e) for s, e in zip(scores, expected))


def test_an_expired_prepared_batch_gives_back_its_pins_and_pages_and_requeues_the_rest(weights):
    deadline_s = 1.0
    with HeldEngine(weights, config(serve_max_batch_size=2)) as engine, AsyncEngine(engine) as serving:
        on_host(engine, {1: 40, 2: 40})
        engine.score([Request(1, [], [])])         # user 1 back on the GPU; user 2 is onboarded when prepared
        setup = len(engine.launched)
        engine.launch_gate.close()
        engine.collect_gate.close()
        first = serving.submit(Request(3, [5, 6], [7]))
        assert engine.launch_gate.entered.wait(WAIT_S)
        late = serving.submit(Request(2, [8], [9]), deadline_s=deadline_s)
        expires = time.monotonic() + deadline_s
        kept = serving.submit(Request(1, [10], [11]))
        engine.launch_gate.open()                  # batch [3] launches; [2, 1] is prepared behind it
        assert engine.collect_gate.entered.wait(WAIT_S)
        assert engine.kv.gpu.pin_count(2) == 1 and engine.kv.gpu.pin_count(1) == 1
        time.sleep(max(0.0, expires - time.monotonic()) + 0.01)
        engine.collect_gate.open()
        with pytest.raises(DeadlineExceeded, match="user 2"):
            late.result(WAIT_S)
        kept_scores = kept.result(WAIT_S).scores
        first.result(WAIT_S)
        gpu = engine.kv.gpu
        assert gpu.num_pinned == 0
        assert 2 not in gpu
        assert gpu.num_free == gpu.total - sum(len(gpu.pages(u)) for u in gpu.users())
        again = serving.submit(Request(2, [12], [13])).result(WAIT_S)
        assert again.tier is Tier.HOST
        assert [[r.user_id for r in b] for b in engine.launched[setup:]] == [[3], [1], [2]]
    expected = sequential_scores(weights, [history(1, 40), history(2, 40), Request(1, [10], [11]),
                                           Request(2, [12], [13])])
    assert close_to(kept_scores, expected[2]) and close_to(again.scores, expected[3])


def recording_copies(events: list) -> FaultyThreadCopyEngine:
    """A copy engine that notes each onboarded layer (on the copy worker, before the layer's copy)."""
    def note(layer: int) -> None:
        if threading.current_thread().name == "layerflow-h2d":
            events.append(layer)
    return FaultyThreadCopyEngine(before_layer=note)


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_starts_the_next_batchs_onboarding_before_the_current_one_is_collected(weights, prefetch):
    events: list[int] = []
    layers = MODEL.num_layers
    with HeldEngine(weights, config(serve_max_batch_size=1, serve_prefetch=prefetch),
                    copy_engine=recording_copies(events)) as engine, AsyncEngine(engine) as serving:
        on_host(engine, {1: 40, 2: 40})
        events.clear()
        engine.collect_gate.close()
        first, second = serving.submit(Request(1, [3], [4])), serving.submit(Request(2, [5], [6]))
        assert engine.collect_gate.entered.wait(WAIT_S)     # batch [1] computed, not yet collected
        if prefetch:
            wait_until(lambda: len(events) == 2 * layers, "the second batch's onboarding started")
        else:
            assert len(events) == layers                     # only the first batch's layers so far
        assert not first.done()
        engine.collect_gate.open()
        assert first.result(WAIT_S).tier is Tier.HOST and second.result(WAIT_S).tier is Tier.HOST
        assert serving.metrics.prefetched._value.get() == (1 if prefetch else 0)


def test_prefetch_prepares_the_next_batch_of_host_and_resident_users_ahead(weights):
    """Users 1 and 2 on the host, 3 on the GPU. While [1] is in flight the prefetch prepares [2, 3] ahead, with 1's
    next request chained on [1]'s appended history (per-user order)."""
    batches, ahead = [[1], [2, 3, 1]], 1
    with HeldEngine(weights, config(serve_max_batch_size=4)) as engine, \
            AsyncEngine(engine) as serving:
        on_host(engine, {1: 40, 2: 40})
        engine.score([history(3, 40)])
        engine.kv.wait_offloads()
        setup = len(engine.launched)
        engine.launch_gate.close()
        first = serving.submit(Request(1, [3], [4]))
        assert engine.launch_gate.entered.wait(WAIT_S)
        later = [serving.submit(r) for r in (Request(2, [5], [6]), Request(3, [7], [8]), Request(1, [9], [10]))]
        wait_until(lambda: len(serving.queue) == 3, "every request queued")
        engine.launch_gate.open()
        results = [f.result(WAIT_S) for f in [first, *later]]
        assert [[r.user_id for r in b] for b in engine.launched[setup:]] == batches
        assert serving.metrics.prefetched._value.get() == ahead
        assert [r.tier for r in results] == [Tier.HOST, Tier.HOST, Tier.GPU, Tier.GPU]
        assert engine.kv.gpu.num_pinned == 0
    expected = sequential_scores(weights, [history(1, 40), history(2, 40), history(3, 40), Request(1, [3], [4]),
                                           Request(2, [5], [6]), Request(3, [7], [8]), Request(1, [9], [10])])
    assert all(close_to(r.scores, e) for r, e in zip(results, expected[3:]))


def test_the_copy_thread_wraps_only_the_tiers_own_copy_engine(weights):
    given = ThreadCopyEngine()
    with Engine(weights, config(), device="cpu", copy_engine=given) as engine:
        assert config().copy_thread and engine.kv.below.engine is given
    with Engine(weights, config(), device="cpu") as engine:
        assert isinstance(engine.kv.below.engine, IssueThreadCopyEngine)


def test_an_unknown_policy_is_refused(weights):
    with Engine(weights, config()) as engine, pytest.raises(ValueError, match="policy='eager'"):
        AsyncEngine(engine, policy="eager")


def test_a_prefetch_the_pool_cannot_hold_waits_for_the_collect(weights):
    """Each user needs 7 of the 12 pages: the second cannot be placed while the first is in flight."""
    with HeldEngine(weights, config(gpu_pages=12, serve_max_batch_size=1)) as engine, \
            AsyncEngine(engine) as serving:
        on_host(engine, {1: 100, 2: 100})
        engine.launch_gate.close()
        first = serving.submit(Request(1, [3], [4]))
        assert engine.launch_gate.entered.wait(WAIT_S)
        second = serving.submit(Request(2, [5], [6]))
        engine.launch_gate.open()
        a, b = first.result(WAIT_S), second.result(WAIT_S)
        assert serving.metrics.prefetch_deferred._value.get() == 1
        assert serving.metrics.prefetched._value.get() == 0
        assert a.tier is Tier.HOST and b.tier is Tier.HOST
    expected = sequential_scores(weights, [history(1, 100), history(2, 100), Request(1, [3], [4]),
                                           Request(2, [5], [6])], gpu_pages=12)
    assert close_to(a.scores, expected[2]) and close_to(b.scores, expected[3])


def test_a_guarded_prefetch_evicts_no_resident_user_queued_for_the_next_batches(weights):
    """27 pages, 7 a user: users 3 and 4 are resident (3 least recently used), 1 and 2 on the host. While [1] is in
    flight, [2] is prepared ahead and needs one of them evicted: LRU would take 3, though 3's request is the next
    batch; the guard keeps 3 and takes 4, so 3 is then a GPU hit."""
    with HeldEngine(weights, config(gpu_pages=27, serve_max_batch_size=1)) as engine, \
            AsyncEngine(engine) as serving:
        on_host(engine, {1: 100, 2: 100})
        for user in (3, 4):
            engine.score([history(user, 100)])
        engine.kv.wait_offloads()
        engine.launch_gate.close()
        engine.collect_gate.close()
        first = serving.submit(Request(1, [3], [4]))
        assert engine.launch_gate.entered.wait(WAIT_S)
        later = [serving.submit(Request(2, [5], [6])), serving.submit(Request(3, [7], [8]))]
        wait_until(lambda: len(serving.queue) == 2, "both requests queued")
        engine.launch_gate.open()
        assert engine.collect_gate.entered.wait(WAIT_S)   # [1] in flight, its prefetch done or deferred
        assert {u for u in (3, 4) if u in engine.kv.gpu} == {3}
        assert serving.metrics.prefetched._value.get() == 1
        assert serving.metrics.prefetch_deferred._value.get() == 0
        engine.collect_gate.open()
        results = [f.result(WAIT_S) for f in [first, *later]]
        assert engine.kv.gpu.num_pinned == 0
    assert results[2].tier is Tier.GPU
    expected = sequential_scores(weights, [history(1, 100), history(2, 100), history(3, 100), history(4, 100),
                                           Request(1, [3], [4]), Request(2, [5], [6]), Request(3, [7], [8])],
                                 gpu_pages=27)
    assert all(close_to(r.scores, e) for r, e in zip(results, expected[4:]))


def test_a_failed_batch_fails_only_the_request_that_fails_alone_again(weights):
    copies = FaultyThreadCopyEngine()
    with HeldEngine(weights, config(serve_max_batch_size=3), copy_engine=copies) as engine, \
            AsyncEngine(engine) as serving:
        on_host(engine, {1: 40})                    # user 1 onboards, users 2 and 3 are GPU hits
        engine.score([history(2, 40)])
        engine.score([history(3, 40)])
        copies.fail_at_layer = 1
        setup = len(engine.launched)
        futures = behind_a_blocker(engine, serving, [Request(u, [u], [u + 1]) for u in (1, 2, 3)])
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            futures[0].result(WAIT_S)
        scores = [f.result(WAIT_S).scores for f in futures[1:]]
        assert [len(b) for b in engine.launched[setup + 1:]] == [3, 1, 1, 1]
        assert serving.metrics.failed_batches._value.get() == 1
        copies.fail_at_layer = None
        again = serving.submit(Request(1, [9], [10])).result(WAIT_S)
    expected = sequential_scores(weights, [history(1, 40), history(2, 40), history(3, 40), Request(2, [2], [3]),
                                           Request(3, [3], [4]), Request(1, [9], [10])])
    assert close_to(scores[0], expected[3]) and close_to(scores[1], expected[4])
    assert close_to(again.scores, expected[5])


def test_a_bad_request_in_a_batch_gets_its_error_and_the_others_their_scores(weights):
    with HeldEngine(weights, config(serve_max_batch_size=3)) as engine, AsyncEngine(engine) as serving:
        for user, n in ((1, 1000), (2, 40), (3, 40)):
            engine.score([history(user, n)])
        futures = behind_a_blocker(engine, serving, [Request(u, [4] * 30, [5]) for u in (2, 1, 3)])
        with pytest.raises(ValueError, match="exceeds max_seq_len"):
            futures[1].result(WAIT_S)
        scores = [futures[0].result(WAIT_S).scores, futures[2].result(WAIT_S).scores]
    expected = sequential_scores(weights, [history(2, 40), history(3, 40), Request(2, [4] * 30, [5]),
                                           Request(3, [4] * 30, [5])])
    assert close_to(scores[0], expected[2]) and close_to(scores[1], expected[3])


def test_close_answers_every_queued_request_then_refuses_new_ones(weights):
    requests = visits(seed=3, users=list(range(6)), rounds=3)
    with HeldEngine(weights, config()) as engine:
        serving = AsyncEngine(engine)
        engine.launch_gate.close()
        futures = [serving.submit(r) for r in requests]
        assert engine.launch_gate.entered.wait(WAIT_S)
        closer = threading.Thread(target=serving.close)
        closer.start()
        wait_until(lambda: serving.closing, "close began")
        with pytest.raises(ShuttingDown):
            serving.submit(Request(1, [1], [2]))
        engine.launch_gate.open()
        closer.join(WAIT_S)
        assert not closer.is_alive()
        scores = [f.result(0).scores for f in futures]
    expected = sequential_scores(weights, requests)
    assert all(close_to(s, e) for s, e in zip(scores, expected))


def test_submit_refuses_bad_arguments(weights):
    with HeldEngine(weights, config()) as engine, AsyncEngine(engine) as serving:
        with pytest.raises(ValueError, match="deadline_s=0"):
            serving.submit(Request(1, [1], [2]), deadline_s=0)
        with pytest.raises(ValueError, match="expected a layerflow Request"):
            serving.submit({"user_id": 1})


class DueOnRequest(AsyncEngine):
    """An AsyncEngine whose batch in flight counts as still onboarding and computing until `due` is set, so a test
    sees what the scheduler does while a batch occupies the device (on the CPU every batch has computed at launch)."""

    def __init__(self, *args, **kwargs) -> None:
        self.due = threading.Event()
        super().__init__(*args, **kwargs)

    def _next_is_due(self, in_flight) -> bool:
        return self.due.is_set() and super()._next_is_due(in_flight)

    def close(self) -> None:
        self.due.set()   # a failed test must not leave a batch in flight forever
        super().close()


def in_flight_and_polling(engine: HeldEngine, serving: DueOnRequest) -> object:
    first = serving.submit(Request(1, [3], [4]))
    wait_until(lambda: len(engine.launched) == 1, "the first batch launched")
    return first


def test_while_a_batch_computes_the_next_one_is_prepared_once_it_is_full(weights):
    with HeldEngine(weights, config(serve_max_batch_size=2)) as engine, DueOnRequest(engine) as serving:
        first = in_flight_and_polling(engine, serving)
        second = serving.submit(Request(2, [5], [6]))
        time.sleep(0.05)                                    # the scheduler polls meanwhile
        assert serving.metrics.prefetched._value.get() == 0 and len(serving.queue) == 1
        third = serving.submit(Request(3, [7], [8]))      # now a full batch is queued: prepared behind the first
        wait_until(lambda: serving.metrics.prefetched._value.get() == 1, "the full batch prepared ahead")
        assert len(serving.queue) == 0
        serving.due.set()
        assert all(f.result(WAIT_S).batch_size == n for f, n in ((first, 1), (second, 2), (third, 2)))
        assert [[r.user_id for r in b] for b in engine.launched] == [[1], [2, 3]]


def test_a_partial_next_batch_is_prepared_once_the_one_in_flight_is_due_without_another_arrival(weights):
    with HeldEngine(weights, config(serve_max_batch_size=4)) as engine, DueOnRequest(engine) as serving:
        engine.collect_gate.close()
        first = in_flight_and_polling(engine, serving)
        second = serving.submit(Request(2, [5], [6]))
        time.sleep(0.05)
        assert serving.metrics.prefetched._value.get() == 0
        serving.due.set()                                   # noticed by polling: nothing else wakes the scheduler
        wait_until(lambda: serving.metrics.prefetched._value.get() == 1, "the partial batch prepared ahead")
        assert engine.collect_gate.entered.wait(WAIT_S) and not first.done()
        engine.collect_gate.open()
        assert first.result(WAIT_S).batch_size == 1 and second.result(WAIT_S).batch_size == 1
        assert [[r.user_id for r in b] for b in engine.launched] == [[1], [2]]


class FailingPrepare(HeldEngine):
    """A HeldEngine whose `prepare` raises for a batch holding a user of `failing` (e.g. a tier that cannot read)."""

    failing: set[int] = set()

    def prepare(self, requests, chain=False):
        if any(r.user_id in self.failing for r in requests):
            raise RuntimeError("injected prepare failure")
        return super().prepare(requests, chain)


def test_a_batch_that_fails_to_prepare_behind_one_in_flight_is_retried_alone_after_it(weights):
    with FailingPrepare(weights, config(serve_max_batch_size=2)) as engine, AsyncEngine(engine) as serving:
        engine.failing = {2}
        futures = behind_a_blocker(engine, serving, [Request(2, [5], [6]), Request(3, [7], [8])])
        with pytest.raises(RuntimeError, match="injected prepare failure"):
            futures[0].result(WAIT_S)
        assert futures[1].result(WAIT_S).batch_size == 1
        assert serving.metrics.failed_batches._value.get() == 1
        assert [[r.user_id for r in b] for b in engine.launched] == [[99], [3]]


def test_chaining_prepares_a_users_next_request_behind_its_batch_in_flight(weights):
    first, second = Request(5, [1, 2], [3]), Request(5, [4], [5, 6])
    with HeldEngine(weights, config()) as engine, AsyncEngine(engine) as serving:
        engine.score([history(5, 40)])
        engine.launch_gate.close()
        engine.collect_gate.close()
        futures = [serving.submit(first)]
        assert engine.launch_gate.entered.wait(WAIT_S)
        futures.append(serving.submit(second))
        wait_until(lambda: len(serving.queue) == 1, "the second request queued")
        engine.launch_gate.open()
        assert engine.collect_gate.entered.wait(WAIT_S)    # the first is in flight, the scheduler at its collect
        prepared = serving._prepared
        assert prepared.batch[0].request is second and prepared.plan.batch.cached_lens == [42]
        engine.collect_gate.open()
        scores = [f.result(WAIT_S).scores for f in futures]
        assert engine.kv.gpu.num_pinned == 0
    expected = sequential_scores(weights, [history(5, 40), first, second])[1:]
    assert all(close_to(s, e) for s, e in zip(scores, expected))


def test_a_failed_batch_in_flight_takes_the_batch_chained_on_it_back_to_the_queue_behind_its_retries(weights):
    with FailingCollect(weights, config(serve_max_batch_size=3)) as engine, \
            AsyncEngine(engine) as serving:
        on_host(engine, {1: 40})                    # user 1 onboards, users 2 and 3 are GPU hits
        engine.score([history(2, 40)])
        engine.score([history(3, 40)])
        setup = len(engine.launched)
        engine.failing = {1}
        requests = [Request(u, [u], [u + 1]) for u in (1, 2, 3)] + [Request(2, [7], [8])]
        futures = behind_a_blocker(engine, serving, requests)
        with pytest.raises(TransferError, match="injected failure found at the collect"):
            futures[0].result(WAIT_S)
        scores = [f.result(WAIT_S).scores for f in futures[1:]]
        assert [[r.user_id for r in b] for b in engine.launched[setup + 1:]] == [[1, 2], [1], [2], [3, 2]]
        # [1, 2] behind the blocker (paced: user 2's two requests need two batches, so the four queued go two a
        # batch, user 2's first), [3, 2] chained behind it (then aborted, and launched after the retries)
        assert serving.metrics.prefetched._value.get() == 2
        assert engine.kv.gpu.num_pinned == 0
    expected = sequential_scores(weights, [history(1, 40), history(2, 40), history(3, 40), Request(2, [2], [3]),
                                           Request(3, [3], [4]), Request(2, [7], [8])])
    assert all(close_to(s, e) for s, e in zip(scores, expected[3:]))


class _EventMark:
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def reached(self) -> bool:
        return self.event.is_set()


class ComputesOnRequest(AsyncEngine):
    """An AsyncEngine whose launched batches count as computing until `computed` is set (on the CPU every batch has
    computed at launch), so a test sees what the scheduler prepares behind a batch that still occupies the device."""

    def __init__(self, *args, **kwargs) -> None:
        self.computed = threading.Event()
        super().__init__(*args, **kwargs)

    def _launch(self, prepared) -> None:
        super()._launch(prepared)
        if self._flight is not None:
            self._flight.mark = _EventMark(self.computed)

    def close(self) -> None:
        self.computed.set()   # a failed test must not leave a batch computing forever
        super().close()


def test_behind_an_onboarding_batch_a_partial_one_is_prepared_only_once_it_computed(weights):
    with HeldEngine(weights, config(serve_max_batch_size=4)) as engine, ComputesOnRequest(engine) as serving:
        on_host(engine, {1: 40})
        setup = len(engine.launched)
        first = serving.submit(Request(1, [3], [4]))                # onboards: its copies occupy the copy engine
        wait_until(lambda: len(engine.launched) == setup + 1, "the onboarding batch launched")
        second = serving.submit(Request(2, [5], [6]))
        time.sleep(0.05)
        assert serving.metrics.prefetched._value.get() == 0 and len(serving.queue) == 1
        serving.computed.set()
        assert first.result(WAIT_S).tier is Tier.HOST and second.result(WAIT_S).batch_size == 1
        assert serving.metrics.prefetched._value.get() == 1
        assert [[r.user_id for r in b] for b in engine.launched[setup:]] == [[1], [2]]




@pytest.mark.parametrize("paced", [True, False])
def test_serve_paced_batches_sets_how_the_schedulers_queue_sizes_batches(weights, paced):
    with HeldEngine(weights, config(serve_paced_batches=paced)) as engine, AsyncEngine(engine) as serving:
        assert serving.queue.paced is paced
