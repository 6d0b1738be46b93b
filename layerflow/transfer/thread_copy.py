"""CopyEngine without CUDA: one worker thread per direction doing torch copies layer by layer.

This is the engine of the runtime's CPU path and of CI. Each direction is a FIFO thread, the way a copy stream is in
order: layer l's copy finishes, then its signal is posted, then layer l+1 starts. Within a layer the pages move as one
gather + scatter (index_select / index_copy_), so there is no Python loop over pages or runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

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
    """Torch copies on two FIFO worker threads ("layerflow-h2d", "layerflow-d2h"), one layer at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._h2d = FifoWorker("layerflow-h2d")
        self._d2h = FifoWorker("layerflow-d2h")
        # Stop the workers at close, at garbage collection or at interpreter exit, whichever comes first: a worker
        # thread still alive when torch's OpenMP pool is torn down aborts the process.
        self._stop = weakref.finalize(self, _stop_workers, self._h2d, self._d2h)

    def close(self) -> None:
        self._stop()

    def order_onboards_after(self, transfers: Sequence[Transfer]) -> None:
        """The H2D worker waits for `transfers` before the onboardings asked for after this call (FIFO)."""
        waited = list(transfers)
        self._h2d.submit(lambda: CopyEngine.order_onboards_after(self, waited))

    def _onboard(self, job: CopyJob) -> Transfer:
        transfer = ThreadTransfer(job)
        self._h2d.submit(lambda: self._run(job, transfer, to_gpu=True))
        return transfer

    def _offload(self, job: CopyJob) -> Transfer:
        transfer = ThreadTransfer(job)
        self._d2h.submit(lambda: self._run(job, transfer, to_gpu=False))
        return transfer

    def _run(self, job: CopyJob, transfer: ThreadTransfer, to_gpu: bool) -> None:
        layer = 0
        try:
            for layer in range(job.num_layers):
                self._copy_layer(job, layer, to_gpu)
                if job.signal is not None:
                    job.signal.complete_layer(job.first_layer + layer)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"copy of layer {layer} failed: {exc!r}")
            if job.signal is not None:
                job.signal.fail(error)
            transfer._finish(error)
            return
        transfer._finish()

    def _copy_layer(self, job: CopyJob, layer: int, to_gpu: bool) -> None:
        """Copy one layer's pages, on the direction's worker, before that layer is signalled; what it raises fails
        the transfer from this layer on. The one per-layer step, so a subclass can wrap it (timing, faults)."""
        if not job.plan.num_pages:
            return
        gpu_pages = torch.from_numpy(job.plan.gpu_pages)
        host_blocks = torch.from_numpy(job.plan.host_blocks)
        gpu = job.gpu_layers[layer]
        if to_gpu:
            gpu.index_copy_(0, gpu_pages.to(gpu.device), job.host[host_blocks, layer].to(gpu.device))
        else:
            pages = gpu.index_select(0, gpu_pages.to(gpu.device)).to(job.host.device)
            job.host[:, layer].index_copy_(0, host_blocks, pages)
