"""The engine: requests in, candidate scores out, with every user's KV placed by the KV manager.

`Engine(weights, config)` picks its parts from the machine: on CUDA the Triton kernels, the copy-engine
transfers and a captured graph per shape bucket whose layers wait on their KV (native eventfd host node, CUDA event or
stream wait-value); without CUDA the same pipeline runs eagerly with a transfer thread and eventfd signals.

The tier below the GPU is in this process, or a transfer server's when the config names one (`server_socket`) or asks
for a private one (`spawn_server`): the server then copies into this process's pool (CUDA IPC, or shared memory on the
CPU path) and posts the eventfds the same wait nodes read. If the server dies, the batch waiting on it is released at
once and its users, whose KV died with the server, are recomputed in the same call; the engine serves from an
in-process tier meanwhile and switches back when the server answers again (runtime/failover.py).
"""

from __future__ import annotations

import logging
import os
import threading
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

import torch

from layerflow.config import Config
from layerflow.model.batch import BatchShape
from layerflow.model.weights import HSTUWeights
from layerflow.runtime.buffers import BatchBuffers, Bucket, token_ladder
from layerflow.runtime.failover import ServerFailover
from layerflow.runtime.graphs import GraphRunner
from layerflow.runtime.kv_manager import BatchPlan, KVManager
from layerflow.runtime.native_staging import native_available, stage_items_native
from layerflow.runtime.pipeline import LayerPipeline, ReferenceKernels, TritonKernels
from layerflow.runtime.request import EmbeddingRequest, Request
from layerflow.runtime.staging import StagedBatch, stage_items
from layerflow.runtime.tiers import build_kv, check_config, in_process_tier, uses_server
from layerflow.runtime.waits import LayerWait, NoWait, make_layer_wait
from layerflow.tier.base import NotResident
from layerflow.tier.layout import KVLayout
from layerflow.tier.remote_manifest import model_key
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import LayerSignals

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8)
# Four sizes per power of two up to 4096, so that the largest batch bucket of hstu-bench's requests (8 x 320 query
# tokens) has a graph and the serving queue (which caps a batch at the largest bucket) can form it; a 320-token request
# runs in its own bucket, faster on the H200 than in the 512 one (docs/performance.md, "Bucket ladder").
TOKEN_BUCKETS = token_ladder(64, 4096, steps=4)
# How an item-id batch reaches the device (the first mode is the default): "slab" packs the requests straight into a
# pinned slab of the bucket in prepare (runtime/staging.py), so the launch issues only the copy; "batch" builds a
# JaggedBatch in prepare and packs the bucket's slab at the launch (H200, 2K GPU hits back to back: the launch's fill
# 0.033 -> 0.016 ms a request, the same scores).
STAGING_MODES = ("slab", "batch")
STAGING_ENV = "LAYERFLOW_STAGING"
# When a batch of GPU hits forgets finished offloads (the first mode is the default): "after" its launch, overlapping
# the block (KVManager's reap_after_launch), or "before" placing it.
REAP_MODES = ("after", "before")
REAP_ENV = "LAYERFLOW_REAP"


def _sizes(name: str, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Bucket sizes, sorted and distinct; ValueError naming `name` for an empty list or a size that is not positive."""
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
        raise ValueError(f"{name}={sizes!r}: expected positive integers")
    return tuple(sorted(set(sizes)))


def _mode(name: str, value: str | None, env: str, modes: tuple[str, ...]) -> str:
    """`value`, else $`env`, else the first of `modes`; ValueError naming a value that is not one of them."""
    chosen = value or os.environ.get(env, modes[0])
    if chosen not in modes:
        raise ValueError(f"{name}={chosen!r} ({env}): expected one of {list(modes)}")
    return chosen


def _next_power_of_2(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


@dataclass(frozen=True)
class TokenOutputs:
    """An embeddings-in request's result: the last layer's output of its new tokens and of its candidates."""

    new: torch.Tensor          # [n, E]
    candidates: torch.Tensor   # [c, E]


def _per_request(batch: BatchShape, results: torch.Tensor) -> list:
    """Split a batch's results: candidate scores per request (`results` holds exactly the batch's candidates: one
    request's are all of it, several are cut by one torch call), or (embeddings in) TokenOutputs per request."""
    if batch.query_x is None:
        return [results] if len(batch.candidate_lens) == 1 else list(results.split(batch.candidate_lens))
    offsets = list(accumulate(batch.query_lens, initial=0))
    return [TokenOutputs(results[offsets[b]:offsets[b] + a], results[offsets[b] + a:offsets[b + 1]])
            for b, a in enumerate(batch.appended_lens)]


def _lost_users(error: BaseException | None) -> set:
    """The users a NotResident somewhere in `error`'s cause chain names."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, NotResident):
            return set(error.users)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return set()


@dataclass
class Flight:
    """A batch launched on the device: its plan, the bucket buffers it runs in and the wait bound to it."""

    plan: BatchPlan
    bufs: BatchBuffers
    wait: LayerWait


class Engine:
    """Scores batches of returning-user requests; usable as a library and from the CLI.

    `score` runs one batch start to end. A scheduler that overlaps batches uses the three steps it is made of:
    `prepare` (place the KV, start the onboarding: allowed while another batch is in flight, so the next batch's KV
    moves while this one computes), `launch` (one batch on the device at a time) and `collect` (its scores). Every step
    holds the engine's lock, so the engine is safe to call from several threads; `score` calls from other threads wait
    their turn. `copy_engine` replaces the in-process tier's copy engine (e.g. a wrapper that times or breaks copies);
    the engine closes it at `close()`; `staging` (default: $LAYERFLOW_STAGING, else "slab") is one of
    STAGING_MODES, `reap` (default: $LAYERFLOW_REAP, else "after") one of REAP_MODES. Under "slab" staging a request
    is packed by the native packer (`pack` "native": one C call, H200 2K GPU hit prepare 0.055 -> 0.033 ms) where it
    builds, else by the numpy packer ("numpy": the same bytes; no C compiler or Python headers). The captured shapes
    are every size of `batch_buckets` with every size of `token_buckets` (`token_ladder(64, 2048)` bounds the padding
    to 12.5%); a batch runs in the smallest that fits.
    """

    def __init__(self, weights: HSTUWeights, config: Config | None = None, *,
                 device: torch.device | str | None = None, use_cuda_graph: bool = True,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, token_buckets: tuple[int, ...] = TOKEN_BUCKETS,
                 copy_engine: CopyEngine | None = None, staging: str | None = None, reap: str | None = None):
        self.config = config or Config()
        self.staging = _mode("staging", staging, STAGING_ENV, STAGING_MODES)
        # Built and loaded here (native_available), never by a request.
        self.pack = "native" if native_available() else "numpy"
        self._stage = stage_items_native if self.pack == "native" else stage_items
        self.reap = _mode("reap", reap, REAP_ENV, REAP_MODES)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda = self.device.type == "cuda"
        check_config(self.config, self.device)
        self._batch_sizes = _sizes("batch_buckets", batch_buckets)
        self._token_sizes = _sizes("token_buckets", token_buckets)
        self.weights = weights.to(self.device)
        model = weights.config
        self.layout = KVLayout.for_hstu(model, self.config.page_size, self.config.kv_cache_dtype)
        self.max_pages = self.layout.pages_for_tokens(model.max_seq_len)
        self._copy_engine = copy_engine
        key = model_key(weights) if self.config.remote_url is not None else None
        gpu, below = build_kv(self.config, self.layout, self.device, copy_engine, model_key=key)
        self._failover = ServerFailover(below, lambda: in_process_tier(self.config, self.layout, gpu, copy_engine,
                                                                   model_key=key, fallback=True)) \
            if uses_server(self.config) else None
        self._cond = threading.Condition(threading.RLock())
        self._flight: Flight | None = None
        self._scoring = False   # `score` is preparing its own batch (see `prepare`)
        self._closed = False
        self.layerwise = self.config.enable_layerwise
        if not self.layerwise:
            log.info("layerwise onboarding is off: each onboarding completes before the block starts")
        self.kv = KVManager(model, gpu, below, self.layerwise,
                            pack_items=self._stage_items if self.staging == "slab" else None,
                            reap_after_launch=self.reap == "after")
        kv_dtype = self.layout.groups[0].fp8_dtype
        self.buckets = sorted(Bucket(b, t) for b in self._batch_sizes for t in self._token_sizes)
        kernels = TritonKernels(self.weights, self.config.page_size, self.max_pages, kv_dtype) if cuda \
            else ReferenceKernels(self.weights, kv_dtype)
        if cuda:
            kernels.reserve(self.buckets, self.device)   # the attentions' shared workspace sized once, for them all
        self.pipeline = LayerPipeline(self.weights, gpu.kv, kernels)
        self._buffers: dict[Bucket, BatchBuffers] = {}
        self.graphs = GraphRunner(self.pipeline, self.device) if cuda and use_cuda_graph else None
        self.no_wait = NoWait()
        self.layer_wait = make_layer_wait(below.signals, self.device, self.config.transfer_timeout_s)

    @property
    def signals(self) -> LayerSignals:
        """The signal ring of the tier below (the transfer client's when a server does the copies)."""
        return self.kv.below.signals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    # ---- public API ---------------------------------------------------------------------------

    def warmup(self) -> None:
        """Capture every bucket's graphs (with and without wait nodes) so no request pays a capture."""
        with self._cond:
            self._check_open()
            if self.graphs is None:
                return
            for bucket in self.buckets:
                bufs = self._bufs(bucket)
                for wait in (self.no_wait, self.layer_wait):
                    if not self.graphs.captured(bufs, wait):
                        self.graphs.capture(bufs, wait)
            torch.cuda.synchronize(self.device)

    def score(self, requests: list[Request | EmbeddingRequest]) -> list:
        """Per request, on the host: an item-id model's candidate scores (fp32, in the order of its candidates); for
        a model whose caller brings the embeddings (EmbeddingRequest), its TokenOutputs (the final embeddings of the
        new tokens and of the candidates, for the caller's own heads).

        A bad request raises ValueError, a failed transfer TransferError, a batch that cannot get GPU pages now
        PoolExhausted; in every case the engine's state is consistent and the next batch is served. A user whose KV
        turns out to be gone below the GPU (a damaged SSD copy, a server that lost it) is recomputed from its stored
        history within the same call, with a warning.
        """
        with self._cond:
            self._check_open()
            if not requests:
                return []
            try:
                return self._score(requests)
            except TransferError as e:
                lost = _lost_users(e) & {r.user_id for r in requests}
                if not lost:
                    raise
                log.warning("users %s had no usable KV below the GPU (%s): recomputing them", sorted(lost), e)
                for user in lost:
                    self.kv.below.drop(user)
                return self._score(requests)

    def _score(self, requests: list[Request]) -> list[torch.Tensor]:
        self._scoring = True   # under the engine's lock: this thread's own prepare below, no other
        try:
            plan = self.prepare(requests)
        finally:
            self._scoring = False
        return self.collect(self.launch(plan))

    def prepare(self, requests: list[Request], chain: bool = False) -> BatchPlan:
        """Place the batch's KV on the GPU and start its onboarding (ValueError for a bad request, PoolExhausted for a
        batch the GPU cannot hold now; nothing changes then). Its users must not be in another batch not collected yet
        (ValueError), unless `chain` and that batch is in flight: this one then builds on the history the flight
        recorded and is aborted if the flight fails (runtime/chains.py; `cancel`, or `launch` raising ChainAborted,
        then gives its slab back). Inside `score`, which launches and collects the batch at once, with nothing in
        flight, its copies are issued on this thread, not handed to the copy thread (transfer/issue_thread.py)."""
        with self._cond:
            self._check_open()
            if self._flight is None and self._failover is not None:
                self._failover.check(self.kv)
            self.kv.below.issue_inline(self._scoring and self._flight is None)
            plan = self.kv.prepare(requests, chain)
            if self._flight is not None:   # its launch waits for the flight: the lead would leave the copies idle
                self.kv.below.issue_deferred()
            return plan

    def launch(self, plan: BatchPlan) -> Flight:
        """Run a prepared batch on the device (waiting for the batch in flight to be collected first)."""
        with self._cond:
            while self._flight is not None:   # Condition.wait_for's frames and a lambda cost microseconds per launch
                self._cond.wait()
            try:
                self._check_open()
                self.kv.chains.check_launch(plan)
                flight = self._launch(plan)
            except BaseException:
                self.kv.abort(plan)
                self._release_slab(plan)
                raise
            self._flight = flight
            return flight

    def collect(self, flight: Flight) -> list[torch.Tensor]:
        """The launched batch's scores per request; a failed batch raises (its KV state is rolled back)."""
        with self._cond:
            if self._flight is not flight:
                raise ValueError("collect: this batch is not the one in flight")
            try:
                results = flight.bufs.fetch()
                flight.wait.check()
            except BaseException:
                self.kv.abort(flight.plan)
                raise
            finally:
                self._flight = None
                self._release_slab(flight.plan)
                self._cond.notify_all()
            self.kv.commit(flight.plan)
            return _per_request(flight.plan.batch, results)

    def cancel(self, plan: BatchPlan) -> None:
        """Give back a prepared batch that will not be launched (e.g. its deadline passed): pins and pages go back."""
        with self._cond:
            self.kv.abort(plan)
            self._release_slab(plan)

    def close(self) -> None:
        """Finish pending offloads and release streams, threads, eventfds, files and a spawned server (once)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self.kv.deferred.release()
            self.kv.wait_offloads()
            if self.graphs is not None:
                torch.cuda.synchronize(self.device)
                self.graphs.release()
            self.kv.below.close()
            if self._failover is not None:
                self._failover.close(self.kv)
            if self._copy_engine is not None:
                self._copy_engine.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one batch ----------------------------------------------------------------------------

    def _bufs(self, bucket: Bucket) -> BatchBuffers:
        """The bucket's buffers, made on its first batch (one dict lookup per request otherwise)."""
        found = self._buffers.get(bucket)
        if found is None:
            found = self._buffers[bucket] = BatchBuffers(bucket, self.max_pages, self.device, self.weights.config)
        return found

    def _bucket(self, batch_size: int, num_tokens: int) -> Bucket:
        """The smallest captured bucket that fits (the buckets are every batch size with every token size, so that is
        the smallest of each), else a power-of-two one run eagerly (e.g. a long miss): powers of two keep the buffers
        and attention workspaces such batches create to a few sizes."""
        b, t = bisect_left(self._batch_sizes, batch_size), bisect_left(self._token_sizes, num_tokens)
        if b < len(self._batch_sizes) and t < len(self._token_sizes):
            return Bucket(self._batch_sizes[b], self._token_sizes[t])
        return Bucket(_next_power_of_2(batch_size, 1), _next_power_of_2(num_tokens, 64))

    def _stage_items(self, users: list[int], cached_lens: list[int], appended: list[list[int]],
                     candidates: list[list[int]], page_rows: list[tuple[int, ...]]) -> StagedBatch:
        """The KV manager's packer under "slab" staging: the batch straight into a slab of its bucket."""
        tokens = sum(map(len, appended)) + sum(map(len, candidates))
        bufs = self._bufs(self._bucket(len(users), tokens))
        slab = bufs.take_slab()
        try:
            return self._stage(slab, self.weights.config, users, cached_lens, appended, candidates, page_rows,
                               bufs.bucket)
        except BaseException:
            bufs.give_slab(slab)
            raise

    def _release_slab(self, plan: BatchPlan) -> None:
        """A staged batch's slab back to its bucket (the batch was collected, failed or given up)."""
        if isinstance(plan.batch, StagedBatch):
            self._buffers[plan.batch.bucket].give_slab(plan.batch.slab)

    def _launch(self, plan: BatchPlan) -> Flight:
        batch = plan.batch
        bucket = batch.bucket if isinstance(batch, StagedBatch) else self._bucket(batch.batch_size,
                                                                                  sum(batch.query_lens))
        bufs = self._bufs(bucket)
        if plan.reuse_fences:   # offloads still reading pages this block writes: it runs after them
            stream = 0
            if self.device.type == "cuda":
                index = torch.cuda.current_device() if self.device.index is None else self.device.index
                stream = torch._C._cuda_getCurrentRawStream(index)
            for fence in plan.reuse_fences:
                fence.order_before(stream)
        bufs.fill(batch, plan.page_rows)
        wait = self.no_wait
        if plan.handle is not None:
            if self.layerwise:
                wait = self.layer_wait
            else:
                plan.handle.wait()
        wait.bind(plan.handle)
        if self.graphs is not None and self.graphs.captured(bufs, wait):
            self.graphs.replay(bufs, wait)
        else:
            self.pipeline.forward(bufs, wait)
        # The onboarding's layers past its lead (the copies a layerwise block waits for on the device), before the
        # offloads: the lead was issued ahead so that this launch left sooner.
        self.kv.below.issue_deferred()
        self.kv.offload_early(plan)
        return Flight(plan, bufs, wait)
