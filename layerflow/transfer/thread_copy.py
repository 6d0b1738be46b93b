"""CopyEngine without CUDA: one worker thread per direction doing torch copies layer by layer.

This is the engine of the runtime's CPU path and of CI. Each direction is a FIFO thread, the way a copy stream is in
order: layer l's copy finishes, then its signal is posted, then layer l+1 starts. Within a layer the pages move as one
gather + scatter (index_select / index_copy_), so there is no Python loop over pages or runs.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from layerflow.transfer.copy_engine import CopyEngine, CopyJob, Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.fifo_worker import FifoWorker


class ThreadTransfer(Transfer):
    """Completion flag set by the worker; keeps the job (and so its tensors) alive until then."""

    def __init__(self, job: CopyJob) -> None:
        self.error: BaseException | None = None
        self._job: CopyJob | None = job
        self._finished = threading.Event()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._finished.wait(timeout):
            raise TransferError(f"transfer not done within {timeout} s")
        if self.error is not None:
            raise TransferError(f"transfer failed: {self.error}") from self.error

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._job = None
        self._finished.set()


def _stop_workers(*workers: FifoWorker) -> None:
    for worker in workers:
        worker.stop()


class ThreadCopyEngine(CopyEngine):
    """`layer_hook(layer)` runs on the worker before each layer's copy (tests slow or break copies with it)."""

    def __init__(self, fail_at_layer: int | None = None, layer_hook: Callable[[int], None] | None = None) -> None:
        super().__init__(fail_at_layer)
        self.layer_hook = layer_hook
        self._h2d = FifoWorker("layerflow-h2d")
        self._d2h = FifoWorker("layerflow-d2h")
        # Stop the workers at close, at garbage collection or at interpreter exit, whichever comes first: a worker
        # thread still alive when torch's OpenMP pool is torn down aborts the process.
        self._stop = weakref.finalize(self, _stop_workers, self._h2d, self._d2h)

    def close(self) -> None:
        self._stop()

    def _onboard(self, job: CopyJob) -> Transfer:
        transfer = ThreadTransfer(job)
        self._h2d.submit(lambda: self._run(job, transfer, self._onboard_layer))
        return transfer

    def _offload(self, job: CopyJob) -> Transfer:
        transfer = ThreadTransfer(job)
        self._d2h.submit(lambda: self._run(job, transfer, self._offload_layer))
        return transfer

    def _run(self, job: CopyJob, transfer: ThreadTransfer, copy_layer: Callable[[CopyJob, int], None]) -> None:
        layer = 0
        try:
            for layer in range(job.num_layers):
                if self.layer_hook is not None:
                    self.layer_hook(layer)
                self._check_injected(layer)
                if job.plan.num_pages:
                    copy_layer(job, layer)
                if job.signal is not None:
                    job.signal.complete_layer(job.first_layer + layer)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"copy of layer {layer} failed: {exc!r}")
            if job.signal is not None:
                job.signal.fail(error)
            transfer._finish(error)
            return
        transfer._finish()

    @staticmethod
    def _onboard_layer(job: CopyJob, layer: int) -> None:
        dst = job.gpu_layers[layer]
        pages = torch.from_numpy(job.plan.host_blocks)
        dst.index_copy_(0, torch.from_numpy(job.plan.gpu_pages).to(dst.device),
                        job.host[pages, layer].to(dst.device))

    @staticmethod
    def _offload_layer(job: CopyJob, layer: int) -> None:
        src = job.gpu_layers[layer]
        pages = src.index_select(0, torch.from_numpy(job.plan.gpu_pages).to(src.device)).to(job.host.device)
        job.host[:, layer].index_copy_(0, torch.from_numpy(job.plan.host_blocks), pages)
