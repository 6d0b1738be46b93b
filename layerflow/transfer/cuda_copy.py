"""CopyEngine on the GPU's copy engines: per layer, one cudaMemcpy2DAsync for a placement that is one run on both
sides, else one cudaMemcpyBatchAsync (an entry per page), on dedicated streams; or (CopyPath.RUN_BATCH)
cudaMemcpy3DBatchAsync with a 2D op per run and layer, so the driver sees runs, not pages: one call per layer for an
onboarding (its layers are signalled one by one), one call for a whole offload.

The per-copy calls go through ctypes on libcudart (`cudart`): cuda.bindings converts every batch entry to a Python
object, which delayed the first copy. Why one call per layer whenever the placement is fragmented at all: each
copy-engine call costs the copy engine a few microseconds when it ends, entries within a call nothing measurable, so
per-run 2D copies lose to one batch per layer from two runs up and win only for a single run (docs/performance.md,
Transfers, has the figures). The per-page batch costs the driver about half a microsecond per entry on the host,
which RUN_BATCH's op per run saves; but the copy engine takes each 3D batch op like a call of its own (~3 us), so
AUTO stays the default: on the H200 a 4K user in runs of 1 / 4 / 16 pages copies in 2.74 / 2.73 / 2.68 ms per page
entry against 5.58 / 3.42 / 2.86 ms by RUN_BATCH, whose host issue is 3.02 / 1.08 / 0.53 ms against 1.24 / 1.23 /
1.21. RUN_BATCH is for schedules bound by the host's issue rather than the copy engine.

One H2D and one D2H non-blocking stream per engine, so every onboarding is issued in order on one stream (the signal
modes rely on that). Onboarding issues each layer's copies, then posts that layer's signal on the stream, all before
returning; the addresses are computed once per transfer in numpy.

An onboarding that is one run on both sides (`CopyEngine._onboard_run`) is a cudaMemcpy2DAsync per layer straight
from the layout's addresses, no CopyJob or numpy plan in between.

Ordering: an offload waits for the work already queued on the caller's current torch stream (the block that wrote
its pages), through an event. An onboarding does not: its destination pages were just allocated to users no queued
kernel touches (batches in flight keep their own users pinned), so the next batch's KV can move while a batch
computes. `Transfer.done()` queries an event recorded after the last copy; the transfer keeps its tensors alive until
then.
"""

from __future__ import annotations

import enum
import math
import os
import threading
import time
from itertools import pairwise
from typing import Callable, Sequence

import numpy as np
import torch
from cuda.bindings import runtime as rt

from layerflow.transfer import cuda_api, cudart
from layerflow.transfer.copy_engine import CopyEngine, CopyJob, LayerAddresses, Transfer
from layerflow.transfer.copy_plan import Run, ramp_bounds
from layerflow.transfer.cuda_api import check, poll_until, require_cuda
from layerflow.transfer.errors import TransferError
from layerflow.transfer.layer_issue import LayerIssue, lead_layers
from layerflow.transfer.signals.base import SignalHandle

class CudaTransfer(Transfer):
    """Done when the event after the transfer's last copy completed; an issue-time error is reported then too."""

    def __init__(self, keep: object, pool: cuda_api.EventPool) -> None:
        self.error: BaseException | None = None
        self._keep: object = keep   # what the copies read and write (a job, or a one-run onboarding's tensors)
        self._pool = pool
        self._event: rt.cudaEvent_t | None = None
        self._finished = False
        self._pending: Callable[[], None] | None = None   # issues this transfer's deferred layers (its engine's)
        self._lock = threading.Lock()   # the event is given back by `done` on one thread, waited on by another

    def done(self) -> bool:
        if self._finished:
            return True
        if self._pending is not None:
            self._pending()
        with self._lock:
            if self._event is not None:
                try:
                    if not cuda_api.query(self._event):
                        return False
                except TransferError as exc:
                    self.error = self.error or exc
                self._pool.give(self._event)
                self._event = None
            self._finished = True
            self._keep = None
        return True

    def order_before(self, stream: int) -> None:
        """`stream` waits on the device for the event after the last copy; a transfer with layers still deferred
        (an onboarding's lead) is waited for on the host, as the default does."""
        with self._lock:
            if self._finished:
                return
            if self._event is not None:
                cuda_api.stream_wait(stream, self._event)
                return
        super().order_before(stream)

    def wait(self, timeout: float | None = None) -> None:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        if not poll_until(self.done, deadline):
            raise TransferError(f"transfer not done within {timeout} s")
        if self.error is not None:
            raise TransferError(f"transfer failed: {self.error}") from self.error


class _LayerCalls:
    """Issues layer l's entries `[l * n, (l + 1) * n)` of a descriptor table as `issue(first entry, count)` calls:
    one call per layer, the first layer in doubling chunks (`ramp_bounds`) so its copies start before the whole
    layer is queued. The caller's `issue` computes its addresses from precomputed bases (numpy's `.ctypes` costs
    ~1 us per array, and the first layer's chunks are issued while the copy engine waits for them)."""

    def __init__(self, issue: Callable[[int, int], None], per_layer: int, tables: tuple[np.ndarray, ...]) -> None:
        self._issue, self._per_layer = issue, per_layer
        self._tables = tables   # the arrays `issue` reads, alive as long as the calls
        self._first_layer = [(a, b - a) for a, b in pairwise(ramp_bounds(per_layer))]

    def __call__(self, layer: int) -> None:
        if layer == 0:
            for first, count in self._first_layer:
                self._issue(first, count)
        else:
            self._issue(layer * self._per_layer, self._per_layer)


def _page_batches(copier: cudart.BatchCopier, dsts: np.ndarray, srcs: np.ndarray, page: int,
                  stream: int) -> _LayerCalls:
    """cudaMemcpyBatchAsync calls over `[layers, pages]` destination and source addresses of `page` bytes each."""
    sizes = np.full(dsts.shape, page, dtype=np.uint64)
    dst, src, size, entry = dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.itemsize

    def issue(first: int, count: int) -> None:
        offset = first * entry
        copier.copy(dst + offset, src + offset, size + offset, count, stream)

    return _LayerCalls(issue, dsts.shape[1], (dsts, srcs, sizes))


def _op_batches(copier: cudart.OpsCopier, ops: np.ndarray, stream: int) -> _LayerCalls:
    """cudaMemcpy3DBatchAsync calls over a `[layers, runs]` table of BATCH_OP_3D ops."""
    base, entry = ops.ctypes.data, ops.itemsize

    def issue(first: int, count: int) -> None:
        copier.copy(base + first * entry, count, stream)

    return _LayerCalls(issue, ops.shape[1], (ops,))


def _one_op_batch(copier: cudart.OpsCopier, ops: np.ndarray, stream: int) -> Callable[[int], None]:
    """One cudaMemcpy3DBatchAsync of the whole table, issued with layer 0 (for an offload: nothing waits for its
    layers one at a time, so one call instead of one per layer)."""

    def issue(layer: int) -> None:
        if layer == 0:
            copier.copy(ops.ctypes.data, ops.size, stream)

    return issue


def _layer_addresses(gpu_bases: tuple[int, ...], gpu_offsets: np.ndarray, host_layers: tuple[int, ...],
                     host_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[layers, n]` uint64 GPU and host addresses: each layer's base plus the byte offsets of one transfer."""
    u64 = np.uint64
    gpu = np.array(gpu_bases, dtype=u64)[:, None] + gpu_offsets.astype(u64)[None, :]
    host = np.array(host_layers, dtype=u64)[:, None] + host_offsets.astype(u64)[None, :]
    return gpu, host


def _runs_copier(addresses: LayerAddresses, runs: list[tuple[int, int, int]], to_gpu: bool,
                 stream: int) -> Callable[[int], None]:
    """Per layer, a cudaMemcpy2DAsync per `(gpu byte offset, host byte offset, pages)` run: pages packed on the
    GPU, a block pitch apart on the host."""
    page, pitch = addresses.page_bytes, addresses.block_pitch
    gpu_bases, host_layers = addresses.gpu_bases, addresses.host_layers

    def copy_runs(layer: int) -> None:
        gpu_base, host_layer = gpu_bases[layer], host_layers[layer]
        for gpu_off, host_off, rows in runs:
            if to_gpu:
                cudart.memcpy_2d_async(gpu_base + gpu_off, page, host_layer + host_off, pitch, page, rows,
                                       cudart.MEMCPY_HOST_TO_DEVICE, stream)
            else:
                cudart.memcpy_2d_async(host_layer + host_off, pitch, gpu_base + gpu_off, page, page, rows,
                                       cudart.MEMCPY_DEVICE_TO_HOST, stream)

    return copy_runs


COPY_PATH_ENV = "LAYERFLOW_COPY_PATH"


class CopyPath(enum.Enum):
    """How a transfer's copies are issued per layer: AUTO takes RUNS for a placement that is one run on both sides and
    PAGES otherwise (see the module docstring); RUNS: a cudaMemcpy2DAsync per run and layer; PAGES: one
    cudaMemcpyBatchAsync per layer, an entry per page; RUN_BATCH: cudaMemcpy3DBatchAsync, a 2D op per run and layer,
    one call per layer onboarding and one call per offload."""

    AUTO = enum.auto()
    RUNS = enum.auto()
    PAGES = enum.auto()
    RUN_BATCH = enum.auto()


def configured_path() -> CopyPath:
    """$LAYERFLOW_COPY_PATH (a CopyPath name, any case), else AUTO; ValueError naming any other value."""
    value = os.environ.get(COPY_PATH_ENV, "auto").strip().upper()
    if value not in CopyPath.__members__:
        raise ValueError(f"{COPY_PATH_ENV}={value.lower()!r}: expected one of "
                         f"{[name.lower() for name in CopyPath.__members__]}")
    return CopyPath[value]


def resolved_path(path: CopyPath, num_runs: int) -> CopyPath:
    """The path a transfer of `num_runs` runs (contiguous on both sides) takes under `path`."""
    if path is not CopyPath.AUTO:
        return path
    return CopyPath.RUNS if num_runs <= 1 else CopyPath.PAGES


class _Tables(threading.local):
    """Per issuing thread, a reusable op table per shape, pitches and width (`cudart.PitchedTable`): a transfer's
    calls are all made within its `_issue`, on one thread, so its table is free again when the next one starts."""

    def __init__(self) -> None:
        self._tables: dict[tuple, cudart.PitchedTable] = {}

    def get(self, shape: tuple[int, ...], dst_pitch: int, src_pitch: int, width: int) -> cudart.PitchedTable:
        key = (shape, dst_pitch, src_pitch, width)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= 64:   # a long-lived engine sees many run counts: keep the set bounded
                self._tables.clear()
            table = self._tables[key] = cudart.PitchedTable(shape, dst_pitch, src_pitch, width)
        return table


class CudaCopyEngine(CopyEngine):
    """Copies on one H2D and one D2H stream of its own, on `device` (default: torch's current device), by `path`
    (default: `configured_path()`; an attribute, so one engine can be switched between transfers). `lead_bytes`
    (an attribute too; None: off): a layerwise onboarding issues only the layers that hold that many bytes first and
    the rest at `issue_deferred` (layer_issue.py); only a caller that calls it after its launch should set it."""

    def __init__(self, path: CopyPath | None = None, device: int | None = None, lead_bytes: int | None = None) -> None:
        require_cuda("CudaCopyEngine")
        super().__init__()
        self.device = torch.cuda.current_device() if device is None else device
        cuda_api.set_device(self.device)
        self.path = configured_path() if path is None else path
        self.lead_bytes = lead_bytes
        self._deferred: LayerIssue | None = None
        self._ops: cudart.OpsCopier | None = None
        self._tables = _Tables()
        self.h2d_stream = cuda_api.create_stream()
        self.d2h_stream = cuda_api.create_stream()
        self._pool = cuda_api.EventPool()
        self._batch_attrs = rt.cudaMemcpyAttributes()
        self._batch_attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._batch = cudart.BatchCopier(self._batch_attrs.getPtr())

    def close(self) -> None:
        self.issue_deferred()
        for stream in (self.h2d_stream, self.d2h_stream):
            check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            cuda_api.destroy_stream(stream)
        self._pool.close()

    def order_onboards_after(self, transfers: Sequence[Transfer]) -> None:
        """The H2D stream waits for `transfers` on the device (call on the issuing thread, like the copies)."""
        cuda_api.set_device(self.device)
        for t in transfers:
            t.order_before(self.h2d_stream)

    def _onboard(self, job: CopyJob) -> Transfer:
        return self._issue(job, self.h2d_stream, to_gpu=True)

    def _offload(self, job: CopyJob) -> Transfer:
        return self._issue(job, self.d2h_stream, to_gpu=False)

    def _issue(self, job: CopyJob, stream: int, to_gpu: bool) -> CudaTransfer:
        def copier() -> Callable[[int], None]:
            if not to_gpu:
                self._after_current_stream(stream)
            return self._layer_copier(job, stream, to_gpu)

        return self._issue_layers(job, copier, job.num_layers, job.signal, job.first_layer, stream,
                                  job.plan.num_pages * job.addresses.page_bytes)

    def _onboard_run(self, gpu_layers: tuple[torch.Tensor, ...], host: torch.Tensor, addresses: LayerAddresses,
                     run: Run, signal: SignalHandle | None, first_layer: int) -> Transfer:
        """One run: a cudaMemcpy2DAsync per layer straight from the layout's addresses (no job, no numpy), unless
        `path` sends a single run elsewhere."""
        if resolved_path(self.path, 1) is not CopyPath.RUNS:
            return super()._onboard_run(gpu_layers, host, addresses, run, signal, first_layer)
        stream = self.h2d_stream
        return self._issue_layers((gpu_layers, host), lambda: self._run_copier(addresses, run, stream),
                                  len(gpu_layers), signal, first_layer, stream, run.pages * addresses.page_bytes)

    def _issue_layers(self, keep: object, copier: Callable[[], Callable[[int], None]], num_layers: int,
                      signal: SignalHandle | None, first_layer: int, stream: int, layer_bytes: int = 0) -> CudaTransfer:
        """`copier()`'s function called for every layer in order, layer l's signal posted right after it; the
        returned transfer keeps `keep` (the tensors its copies read and write) alive until it is done. A layerwise
        onboarding of `layer_bytes` per layer whose waits may precede its posts issues only its lead now when
        `lead_bytes` is set (layer_issue.py): the rest waits for `issue_deferred`, for the next transfer of this
        engine, or for the transfer's own done/wait."""
        self.issue_deferred()   # an earlier onboarding's rest first: one stream, layers in order
        # The engine's device is made current on the issuing thread: its events (and a notifier's) are created there,
        # and one process (the transfer server) drives an engine per GPU from shared threads.
        cuda_api.set_device(self.device)
        transfer = CudaTransfer(keep, self._pool)

        def finish(error: TransferError | None) -> None:
            transfer.error = transfer.error or error
            transfer._pending = None
            event = self._pool.take()
            cuda_api.record(event, stream)
            transfer._event = event

        try:
            copy_layer = copier()
        except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"issuing layer 0 failed: {exc!r}")
            if signal is not None:
                signal.fail(error, stream)
            finish(error)
            return transfer
        issue = LayerIssue(copy_layer, num_layers, signal, first_layer, stream, finish)
        split = (self.lead_bytes is not None and signal is not None and signal.layerwise
                 and signal.ring.waits_before_posts)
        issue.issue(lead_layers(num_layers, layer_bytes, self.lead_bytes) if split else num_layers)
        if not issue.done:
            self._deferred = issue
            transfer._pending = self.issue_deferred
        return transfer

    def issue_deferred(self) -> None:
        """Issue the rest of the onboarding whose lead alone was issued, if any (call on the issuing thread)."""
        issue, self._deferred = self._deferred, None
        if issue is not None:
            cuda_api.set_device(self.device)
            issue.issue(math.inf)

    def _after_current_stream(self, stream: int) -> None:
        event = self._pool.take()
        # torch's current stream as a raw handle (what Triton launches on): torch.cuda.current_stream() builds a
        # Stream object and resolves the device, ~7.5 us a call on the H200's host.
        cuda_api.record(event, torch._C._cuda_getCurrentRawStream(self.device))
        cuda_api.stream_wait(stream, event)
        self._pool.give(event)

    def _layer_copier(self, job: CopyJob, stream: int, to_gpu: bool) -> Callable[[int], None]:
        """Per-layer issue function (called with l, it issues layer l's copies on `stream`), every per-run/per-page
        address computed once here (plain ints for runs, numpy for a batch of pages) from the layers' addresses the
        layout check took (`job.addresses`).

        `_issue` calls this once per transfer, after an offload's wait for the current stream and before the
        first copy, and posts layer l's signal right after layer l's call: the seam a subclass wraps to time or
        fail copies; what the function raises fails the transfer from that layer on."""
        plan, addresses = job.plan, job.addresses
        page, pitch = addresses.page_bytes, addresses.block_pitch
        gpu_bases, host_layers = addresses.gpu_bases, addresses.host_layers
        path = resolved_path(self.path, plan.num_runs)
        if path is CopyPath.PAGES:
            gpu, host = _layer_addresses(gpu_bases, plan.gpu_pages * page, host_layers, plan.host_blocks * pitch)
            dsts, srcs = (gpu, host) if to_gpu else (host, gpu)
            return _page_batches(self._batch, dsts, srcs, page, stream)
        if path is CopyPath.RUN_BATCH:
            # A 2D op per run: `run_len` rows of one page, packed on the GPU, `pitch` apart on the block-first host.
            copier = self._run_ops()
            gpu, host = _layer_addresses(gpu_bases, plan.run_gpu * page, host_layers, plan.run_host * pitch)
            dsts, srcs, pitches = (gpu, host, (page, pitch)) if to_gpu else (host, gpu, (pitch, page))
            ops = self._tables.get(gpu.shape, *pitches, page).fill(dsts, srcs, plan.run_len)
            return _op_batches(copier, ops, stream) if to_gpu else _one_op_batch(copier, ops, stream)

        runs = list(zip((plan.run_gpu * page).tolist(), (plan.run_host * pitch).tolist(), plan.run_len.tolist()))
        return _runs_copier(addresses, runs, to_gpu, stream)

    def _run_copier(self, addresses: LayerAddresses, run: Run, stream: int) -> Callable[[int], None]:
        """The per-layer issue function of a one-run onboarding: layer l's run as one cudaMemcpy2DAsync, its offsets
        plain ints. The seam a subclass wraps to time or fail those copies, as `_layer_copier` a job's."""
        offsets = (run.gpu_page * addresses.page_bytes, run.host_block * addresses.block_pitch, run.pages)
        return _runs_copier(addresses, [offsets], True, stream)

    def _run_ops(self) -> cudart.OpsCopier:
        """The 3D batch copier, made on first use (TransferError where libcudart lacks it)."""
        if self._ops is None:
            self._ops = cudart.OpsCopier()
        return self._ops
