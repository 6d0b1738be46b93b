"""CopyEngine on the GPU's copy engines: per layer, one cudaMemcpy2DAsync for a placement that is one run on both
sides, else one cudaMemcpyBatchAsync (an entry per page), on dedicated streams.

The per-copy calls go through ctypes on libcudart (`cudart`): cuda.bindings converts every batch entry to a Python
object, which delayed the first copy. Why one call per layer whenever the placement is fragmented at all: each
copy-engine call costs the copy engine a few microseconds when it ends, entries within a call nothing measurable, so
per-run 2D copies lose to one batch per layer from two runs up and win only for a single run (docs/performance.md,
Transfers, has the figures).

One H2D and one D2H non-blocking stream per engine, so every onboarding is issued in order on one stream (the signal
modes rely on that). Onboarding issues each layer's copies, then posts that layer's signal on the stream, all before
returning; the addresses are computed once per transfer in numpy.

Ordering: an offload waits for the work already queued on the caller's current torch stream (the block that wrote
its pages), through an event. An onboarding does not: its destination pages were just allocated to users no queued
kernel touches (batches in flight keep their own users pinned), so the next batch's KV can move while a batch
computes. `Transfer.done()` queries an event recorded after the last copy; the transfer keeps its tensors alive until
then.
"""

from __future__ import annotations

import enum
import math
import time
from itertools import pairwise
from typing import Callable

import numpy as np
import torch
from cuda.bindings import runtime as rt

from layerflow.transfer import cuda_api, cudart
from layerflow.transfer.copy_engine import CopyEngine, CopyJob, Transfer
from layerflow.transfer.copy_plan import ramp_bounds
from layerflow.transfer.cuda_api import check, poll_until, require_cuda
from layerflow.transfer.errors import TransferError

class CudaTransfer(Transfer):
    """Done when the event after the transfer's last copy completed; an issue-time error is reported then too."""

    def __init__(self, job: CopyJob, pool: cuda_api.EventPool) -> None:
        self.error: BaseException | None = None
        self._job: CopyJob | None = job
        self._pool = pool
        self._event: rt.cudaEvent_t | None = None
        self._finished = False

    def done(self) -> bool:
        if self._finished:
            return True
        if self._event is not None:
            try:
                if not cuda_api.query(self._event):
                    return False
            except TransferError as exc:
                self.error = self.error or exc
            self._pool.give(self._event)
            self._event = None
        self._finished = True
        self._job = None
        return True

    def wait(self, timeout: float | None = None) -> None:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        if not poll_until(self.done, deadline):
            raise TransferError(f"transfer not done within {timeout} s")
        if self.error is not None:
            raise TransferError(f"transfer failed: {self.error}") from self.error


class _BatchedLayers:
    """Issues one layer's per-page copies as cudaMemcpyBatchAsync calls over descriptor arrays it keeps alive.

    Every call's addresses are computed here once (numpy's `.ctypes` costs ~1 us per array and the first layer's
    chunks are issued while the copy engine waits for them); the first layer goes in doubling chunks (`ramp_bounds`).
    """

    def __init__(self, copier: cudart.BatchCopier, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                 stream: int) -> None:
        self._arrays = (dsts, srcs, sizes)
        self._copier, self._stream, self._pages = copier, stream, sizes.size
        entry = dsts.itemsize
        self._row_bytes = self._pages * entry
        self._dst, self._src, self._size = dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data
        self._first_layer = [(self._dst + a * entry, self._src + a * entry, self._size + a * entry, b - a)
                             for a, b in pairwise(ramp_bounds(self._pages))]

    def __call__(self, layer: int) -> None:
        if layer == 0:
            for call in self._first_layer:
                self._copier.copy(*call, self._stream)
        else:
            row = layer * self._row_bytes
            self._copier.copy(self._dst + row, self._src + row, self._size, self._pages, self._stream)


class CopyPath(enum.Enum):
    """How a transfer's copies are issued per layer: AUTO takes RUNS for a placement that is one run on both sides and
    PAGES otherwise (see the module docstring); the others force one path (tests, benchmarks)."""

    AUTO = enum.auto()
    RUNS = enum.auto()
    PAGES = enum.auto()


def resolved_path(path: CopyPath, num_runs: int) -> CopyPath:
    """The path a transfer of `num_runs` runs (contiguous on both sides) takes under `path`."""
    if path is not CopyPath.AUTO:
        return path
    return CopyPath.RUNS if num_runs <= 1 else CopyPath.PAGES


class CudaCopyEngine(CopyEngine):
    """Copies on one H2D and one D2H stream of its own, on `device` (default: torch's current device)."""

    def __init__(self, path: CopyPath = CopyPath.AUTO, device: int | None = None) -> None:
        require_cuda("CudaCopyEngine")
        super().__init__()
        self.device = torch.cuda.current_device() if device is None else device
        cuda_api.set_device(self.device)
        self.path = path
        self.h2d_stream = cuda_api.create_stream()
        self.d2h_stream = cuda_api.create_stream()
        self._pool = cuda_api.EventPool()
        self._batch_attrs = rt.cudaMemcpyAttributes()
        self._batch_attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._batch = cudart.BatchCopier(self._batch_attrs.getPtr())

    def close(self) -> None:
        for stream in (self.h2d_stream, self.d2h_stream):
            check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            cuda_api.destroy_stream(stream)
        self._pool.close()

    def _onboard(self, job: CopyJob) -> Transfer:
        return self._issue(job, self.h2d_stream, to_gpu=True)

    def _offload(self, job: CopyJob) -> Transfer:
        return self._issue(job, self.d2h_stream, to_gpu=False)

    def _issue(self, job: CopyJob, stream: int, to_gpu: bool) -> CudaTransfer:
        # The engine's device is made current on the issuing thread: its events (and a notifier's) are created there,
        # and one process (the transfer server) drives an engine per GPU from shared threads.
        cuda_api.set_device(self.device)
        transfer = CudaTransfer(job, self._pool)
        layer = 0
        try:
            if not to_gpu:
                self._after_current_stream(stream)
            copy_layer = self._layer_copier(job, stream, to_gpu)
            for layer in range(job.num_layers):
                copy_layer(layer)
                if job.signal is not None:
                    job.signal.complete_layer(job.first_layer + layer, stream)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"issuing layer {layer} failed: {exc!r}")
            transfer.error = error
            if job.signal is not None:
                job.signal.fail(error, stream)
        event = self._pool.take()
        cuda_api.record(event, stream)
        transfer._event = event
        return transfer

    def _after_current_stream(self, stream: int) -> None:
        event = self._pool.take()
        # torch's current stream as a raw handle (what Triton launches on): torch.cuda.current_stream() builds a
        # Stream object and resolves the device, ~7.5 us a call on the H200's host.
        cuda_api.record(event, torch._C._cuda_getCurrentRawStream(self.device))
        cuda_api.stream_wait(stream, event)
        self._pool.give(event)

    def _layer_copier(self, job: CopyJob, stream: int, to_gpu: bool) -> Callable[[int], None]:
        """Per-layer issue function (called with l, it issues layer l's copies on `stream`), every per-run/per-page
        address computed once here (plain ints for runs, numpy for a batch of pages).

        `_issue` calls this once per transfer, after an offload's wait for the current stream and before the
        first copy, and posts layer l's signal right after layer l's call: the seam a subclass wraps to time or
        fail copies; what the function raises fails the transfer from that layer on."""
        plan, page = job.plan, job.layer_page_bytes
        pitch = job.num_layers * page
        host_base = job.host.data_ptr()
        gpu_bases = [t.data_ptr() for t in job.gpu_layers]
        host_layers = [host_base + layer * page for layer in range(job.num_layers)]
        if resolved_path(self.path, plan.num_runs) is CopyPath.PAGES:
            u64 = np.uint64
            gpu = np.array(gpu_bases, dtype=u64)[:, None] + (plan.gpu_pages.astype(u64) * u64(page))[None, :]
            host = np.array(host_layers, dtype=u64)[:, None] + (plan.host_blocks.astype(u64) * u64(pitch))[None, :]
            dsts, srcs = (gpu, host) if to_gpu else (host, gpu)
            return _BatchedLayers(self._batch, dsts, srcs, np.full(plan.num_pages, page, dtype=u64), stream)

        runs = list(zip((plan.run_gpu * page).tolist(), (plan.run_host * pitch).tolist(), plan.run_len.tolist()))

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
