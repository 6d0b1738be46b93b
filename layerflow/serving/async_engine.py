"""The asynchronous engine: `submit` from any thread (or `await score`), one scheduler thread drives the Engine.

The scheduler is the only caller of the engine's steps. Its rules, in the order it applies them:
- Batches come from the queue (layerflow.serving.queue: arrival order, one request per user, busy users skipped,
  capped in requests and query tokens, paced by the longest per-user backlog while the queue is deeper than a batch,
  held back up to `serve_max_wait_ms` to fill).
- Prefetch, policy "guarded" (`serve_prefetch`, on by default: chained, on the H200 it served 8-11% more than
  "off" at 720-800 req/s offered): while batch N computes, the scheduler keeps admitting requests and prepares batch
  N+1 (its KV placed, its onboarding issued on the copy engine) as soon as the queue holds a full batch, or at once
  when N onboards nothing (the copy engine is free), or when N has computed (polled, never waited for): so batches
  grow with the load and N+1's copies run while N computes. N+1's placement evicts no resident user of the next two
  batches' requests (serving.guard). N+1 is launched once N is collected. If the GPU pool cannot hold N+1 beside N
  (PoolExhausted), it goes back to the head of the queue and is prepared after N is collected: at most one batch is
  prepared ahead, and only when the pool holds it.
- Policy "off" (`serve_prefetch: false`, or the constructor's `policy`): every batch is prepared after the previous
  one is collected. A user's requests are served in arrival order under both.
- Chaining: the batch prepared ahead may hold a user of the batch in flight, built on the history that batch
  recorded at its launch, so a hot user's next request need not skip a batch (on the H200 it lifted every prefetch
  policy by 90-125 req/s); if the batch in flight fails, the one chained on it is aborted with it (runtime/chains.py)
  and its requests go back to the head of the queue, behind the failed batch's retries.
- Deadlines: a request whose deadline passes while queued is answered DeadlineExceeded; one whose deadline passed
  when its prepared batch is about to launch is too, and that batch is cancelled (pins and pages released) and its
  other requests go back to the head of the queue, in order. A launched request is answered with its scores.
- Failures: a batch that fails to launch or collect (its KV state rolled back by the engine), or whose preparation
  fails other than for a bad request or a full pool, has each request retried alone once (`Engine.score`); what fails
  again is that request's error. A bad request (ValueError) or a batch the GPU cannot hold with nothing in flight is
  split in halves until the culprit is alone, which gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch

from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.serving.errors import DeadlineExceeded, ShuttingDown, ServingError, error_kind
from layerflow.serving.flights import DeviceMark, InFlight, Prepared
from layerflow.serving.guard import pin_guarded
from layerflow.serving.metrics import ServingMetrics
from layerflow.serving.queue import Pending, RequestQueue
from layerflow.serving.validation import check_deadline_s
from layerflow.tier.allocator import PoolExhausted
from layerflow.tier.base import Tier

log = logging.getLogger(__name__)

POOL_SAMPLE_S = 0.2   # pool occupancy is read at most this often (a remote tier answers it over its socket)
POLL_S = 0.0002       # while a batch computes and nothing is ready to prepare, its completion is polled this often
POLICIES = ("off", "guarded")   # prefetch across batches (module docstring)


@dataclass(frozen=True)
class Scored:
    """A served request: its candidates' scores, the tier its KV came from, arrival-to-answer latency, the size of
    the batch it ran in and the cached history tokens it reused (0 for a miss)."""

    scores: torch.Tensor
    tier: Tier
    latency_ms: float
    batch_size: int
    cached_tokens: int


def _start(pending: Pending) -> None:
    """Mark the request's future running, so a caller can no longer cancel it (a cancelled one is served anyway and
    its answer dropped: its batch is already on its way)."""
    if not pending.future.running():
        pending.future.set_running_or_notify_cancel()


class AsyncEngine:
    """Serves `engine` from a scheduler thread (see the module docstring for its rules); `close()` drains and stops
    it. The engine stays the caller's to close."""

    def __init__(self, engine: Engine, metrics: ServingMetrics | None = None, policy: str | None = None) -> None:
        """`policy`: one of POLICIES (the module docstring); None: "guarded" if `serve_prefetch`, else "off"."""
        config = engine.config
        policy = ("guarded" if config.serve_prefetch else "off") if policy is None else policy
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
        self.engine = engine
        self.metrics = metrics or ServingMetrics()
        self.prefetch = policy != "off"
        self.default_deadline_s = config.serve_deadline_ms / 1e3 if config.serve_deadline_ms > 0 else None
        max_batch = min(config.serve_max_batch_size, max(b.max_batch for b in engine.buckets))
        max_tokens = max(b.max_tokens for b in engine.buckets)
        self.queue = RequestQueue(config.serve_max_queue, max_batch, max_tokens, config.serve_max_wait_ms / 1e3,
                                  paced=config.serve_paced_batches)
        self._flight: InFlight | None = None
        self._prepared: Prepared | None = None
        self._retry: list[Pending] = []
        self._deferred = False       # the prefetch did not fit beside the batch in flight: wait for its collect
        self._sampled = 0.0
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="layerflow-scheduler", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    def submit(self, request: Request, deadline_s: float | None = None) -> Future:
        """Queue `request`; the future gets a `Scored` or the request's error. `deadline_s` (from now) overrides the
        config's `serve_deadline_ms`. Raises QueueFull when the queue is at its bound, ShuttingDown after `close()`,
        ValueError for a bad argument."""
        if not isinstance(request, Request):
            raise ValueError(f"request={request!r}: expected a layerflow Request")
        deadline_s = check_deadline_s(deadline_s)
        if deadline_s is None:
            deadline_s = self.default_deadline_s
        now = time.monotonic()
        pending = Pending(request, Future(), now, None if deadline_s is None else now + deadline_s)
        try:
            expired = self.queue.put(pending)
        except ServingError as e:
            self.metrics.request_failed(error_kind(e))
            raise
        self._expire(expired)
        self.metrics.queue_depth.set(len(self.queue))
        return pending.future

    async def score(self, request: Request, deadline_s: float | None = None) -> Scored:
        """`submit`, awaited in the running event loop."""
        return await asyncio.wrap_future(self.submit(request, deadline_s))

    @property
    def closing(self) -> bool:
        return self.queue.closed

    def close(self) -> None:
        """Refuse new requests, answer every queued one (served, or failed by its deadline), stop the thread."""
        with self._close_lock:
            self.queue.close()
            self._thread.join()

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear of it
            log.exception("the serving scheduler stopped")
            self._abandon(e)

    def _loop(self) -> None:
        while True:
            if self._retry and self._flight is None and self._prepared is None:
                batch, self._retry = self._retry, []   # retries run alone: after the batches in flight and prepared
                self._retry_alone(batch)
            elif self._flight is None and self._prepared is not None:
                prepared, self._prepared = self._prepared, None
                self._launch(prepared)
            elif self._flight is None:
                taken = self._take(wait=True)
                if taken is None:
                    return
                if taken:
                    self._prepared = self._prepare(taken, prefetch=False)
            elif self.prefetch and self._prepared is None and not self._deferred and not self._retry:
                self._prefetch_or_poll()
            else:
                self._collect()

    def _prefetch_or_poll(self) -> None:
        """Batch N is in flight and nothing is prepared behind it: prepare N+1 if it is due (see the module
        docstring), collect N once it has computed, else pause until a request arrives or the next poll."""
        due = self._next_is_due(self._flight)
        taken = self._take(wait=False, full_only=not due)
        if taken:
            self._prepared = self._prepare(taken, prefetch=True)
        elif due and self._flight.computed():
            self._collect()
        else:
            self._pause()

    def _next_is_due(self, in_flight: InFlight) -> bool:
        """Prepare a partial next batch now? Only while waiting for more requests would idle the copy engine or the
        GPU: the batch in flight onboards nothing, or has computed."""
        return not in_flight.prepared.onboards() or in_flight.computed()

    def _pause(self) -> None:
        self.queue.wait_for_put(POLL_S)

    def _busy(self) -> set[int]:
        """Users the next batch must skip: prepared or waiting for a retry (those in flight are chained on)."""
        batches = [self._retry]
        if self._prepared is not None:
            batches.append(self._prepared.batch)
        return {p.user for batch in batches for p in batch}

    def _take(self, wait: bool, full_only: bool = False) -> list[Pending] | None:
        taken = self.queue.take(self._busy(), wait, full_only)
        if taken is None:
            return None
        self._expire(taken.expired)
        self.metrics.queue_depth.set(len(self.queue))
        return taken.batch

    def _requeue(self, batch: list[Pending]) -> None:
        self.queue.requeue(batch)
        self.metrics.queue_depth.set(len(self.queue))

    def _prepare(self, batch: list[Pending], prefetch: bool) -> Prepared | None:
        """Prepare `batch` (`prefetch`: behind the batch in flight), or deal with why it cannot be (see the module
        docstring); None when nothing was prepared. A batch the pool cannot hold while another holds pages (in flight
        or prepared) goes back to the head of the queue, to be prepared after it."""
        gpu = self.engine.kv.gpu
        resident = len(gpu)
        guarded = pin_guarded(gpu, self.queue, batch) if prefetch else []
        try:
            plan = self.engine.prepare([p.request for p in batch], chain=True)
        except PoolExhausted as e:
            if prefetch or self._prepared is not None:
                self._requeue(batch)
                if prefetch:
                    self._deferred = True
                    self.metrics.prefetch_deferred.inc()
                return None
            return self._split(batch, prefetch, e)
        except ValueError as e:
            return self._split(batch, prefetch, e)
        except Exception as e:  # noqa: BLE001 - e.g. a failed onboarding: retried alone once nothing is in flight
            log.warning("preparing a batch of %d failed (%s): retrying its requests alone", len(batch), e)
            self.metrics.failed_batches.inc()
            self._retry.extend(batch)
            return None
        finally:
            for user in guarded:
                gpu.unpin(user)
        layout = self.engine.layout
        onboard = sum(layout.pages_for_tokens(cached) for cached, tier in zip(plan.batch.cached_lens, plan.tiers)
                      if tier in (Tier.HOST, Tier.SSD)) * layout.page_bytes
        placed = sum(tier is not Tier.GPU for tier in plan.tiers)
        self.metrics.batch_prepared(prefetch, onboard, max(0, resident + placed - len(gpu)))
        return Prepared(plan, batch, onboard)

    def _split(self, batch: list[Pending], prefetch: bool, error: Exception) -> Prepared | None:
        """A batch refused as a whole: the request alone gets the error; else the first half is tried again and the
        second goes back to the head of the queue."""
        if len(batch) == 1:
            self._fail(batch[0], error)
            return None
        half = len(batch) // 2
        self._requeue(batch[half:])
        return self._prepare(batch[:half], prefetch)

    def _launch(self, prepared: Prepared) -> None:
        now = time.monotonic()
        dropped = [p for p in prepared.batch if p.expired(now) or p.future.cancelled()]
        if dropped:
            self.engine.cancel(prepared.plan)
            self._expire([p for p in dropped if not p.future.cancelled()])
            self._requeue([p for p in prepared.batch if p not in dropped])
            return
        for p in prepared.batch:
            _start(p)   # from here on the request is served: its history is recorded
        try:
            flight = self.engine.launch(prepared.plan)
        except Exception as e:  # noqa: BLE001 - the engine rolled the batch back
            log.warning("launching a batch of %d failed (%s): retrying its requests alone", len(prepared.batch), e)
            self.metrics.failed_batches.inc()
            self._retry.extend(prepared.batch)
            return
        self._flight = InFlight(flight, prepared, DeviceMark(flight.bufs.stream))

    def _collect(self) -> None:
        in_flight, self._flight = self._flight, None
        self._deferred = False
        prepared = in_flight.prepared
        try:
            scores = self.engine.collect(in_flight.flight)
        except Exception as e:  # noqa: BLE001 - the engine rolled the batch back
            log.warning("a batch of %d failed (%s): retrying its requests alone", len(prepared.batch), e)
            self.metrics.failed_batches.inc()
            if self._prepared is not None:   # pages back: the retries must find the pool as it was
                self.engine.cancel(self._prepared.plan)
                self._requeue(self._prepared.batch)
            self._prepared = None
            self._retry.extend(prepared.batch)
            return
        now = time.monotonic()
        self._sample_pools(now)
        self._answer(prepared, scores, now - prepared.started)

    def _answer(self, prepared: Prepared, scores: list[torch.Tensor], seconds: float) -> None:
        """Answer a collected batch's requests (`seconds`: prepare to collect) and count the batch."""
        batch, plan = prepared.batch, prepared.plan
        self.metrics.batch_collected(len(batch), prepared.onboard_bytes, seconds)
        for p, score, tier, tokens in zip(batch, scores, plan.tiers, plan.batch.cached_lens):
            self._deliver(p, score, tier, len(batch), tokens)

    def _retry_alone(self, batch: list[Pending]) -> None:
        for p in batch:
            if p.future.cancelled():
                continue
            if p.expired(time.monotonic()):
                self._expire([p])
                continue
            _start(p)
            try:
                tier = self.engine.kv.tier(p.user)
                entry = self.engine.kv.users.get(p.user)
                cached = len(entry.history) if entry is not None and tier is not Tier.NONE else 0
                scores = self.engine.score([p.request])[0]
            except Exception as e:  # noqa: BLE001 - this request's own error
                self._fail(p, e)
            else:
                self._deliver(p, scores, tier, 1, cached)

    def _sample_pools(self, now: float) -> None:
        if now - self._sampled < POOL_SAMPLE_S:
            return
        self._sampled = now
        gpu = self.engine.kv.gpu
        try:
            usage = self.engine.kv.below.usage()
        except Exception as e:  # noqa: BLE001 - occupancy is informative; serving goes on without it
            log.debug("host pool usage unavailable: %s", e)
            return
        self.metrics.pools(gpu.total - gpu.num_free, gpu.total, len(gpu), usage.host_blocks, usage.host_total,
                           usage.host_users)

    # ---- answers ------------------------------------------------------------------------------

    def _deliver(self, pending: Pending, scores: torch.Tensor, tier: Tier, batch_size: int, cached: int) -> None:
        latency = time.monotonic() - pending.arrived
        self.metrics.request_done(tier, latency)
        try:
            pending.future.set_result(Scored(scores, tier, latency * 1e3, batch_size, cached))
        except InvalidStateError:   # the caller cancelled it
            pass

    def _fail(self, pending: Pending, error: BaseException) -> None:
        self.metrics.request_failed(error_kind(error))
        try:
            pending.future.set_exception(error)
        except InvalidStateError:
            pass

    def _expire(self, pendings: list[Pending]) -> None:
        for p in pendings:
            waited = (time.monotonic() - p.arrived) * 1e3
            self._fail(p, DeadlineExceeded(f"user {p.user}: deadline passed after {waited:.1f} ms, before its "
                                           f"batch was launched"))

    def _abandon(self, error: BaseException) -> None:
        """The scheduler died: nothing more will be served, so every waiting request hears why."""
        self.queue.close()
        reason = ShuttingDown(f"the serving scheduler stopped: {error!r}")
        waiting = list(self._retry) + self.queue.clear()
        if self._prepared is not None:
            waiting += self._prepared.batch
        if self._flight is not None:
            waiting += self._flight.prepared.batch
        for p in waiting:
            self._fail(p, reason)
