"""A CopyEngine that issues another engine's copies on one thread of its own, off the thread that asks for them.

The caller (the serving scheduler) pays for the checks (`CopyEngine._layout`, `make_job`: a bad call still raises at
once, in the caller) and a queue put; the inner engine's issue (addresses, the per-layer copy calls and signal posts)
runs on the issue thread, in the order the transfers were asked for. Why: while the scheduler thread issued each
batch's copies itself, the copy engine sat idle whenever that thread was busy collecting, launching or preparing the
next batch (docs/serving.md); issued from a thread that does nothing else, the next onboarding is queued on the copy
stream as soon as it is asked for.

What still holds:
- Order: one FIFO thread, so onboardings reach the inner engine's H2D stream in the order they were asked for, and
  their layer signals are posted in that order too (the signal modes rely on it). The signals are posted by the copies
  themselves, on the copy stream, so a graph launched before its onboarding was issued just waits longer on the GPU.
- An offload waits for the work queued on the caller's current stream when it was asked for (CUDA: an event recorded
  there by the caller, waited by the issue thread's current stream, which the inner engine orders its offload after).
- The inner engine is only ever used from the issue thread, until `close()`, which drains the queue first.
- A failure to issue fails that transfer alone (and poisons its signal): the transfers queued behind it still run.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from layerflow.transfer.copy_engine import CopyEngine, CopyJob, Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.fifo_worker import FifoWorker

class IssuedTransfer(Transfer):
    """A transfer queued for the issue thread: done once it was issued and the inner transfer is done."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._inner: Transfer | None = None
        self._failure: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        if self._failure is not None:
            return self._failure
        return None if self._inner is None else self._inner.error

    def done(self) -> bool:
        return self._issued.is_set() and (self._inner is None or self._inner.done())

    def wait(self, timeout: float | None = None) -> None:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        if not self._issued.wait(timeout):
            raise TransferError(f"transfer not issued within {timeout} s")
        if self._failure is not None:
            raise TransferError(f"transfer failed: {self._failure}") from self._failure
        self._inner.wait(None if timeout is None else max(0.0, deadline - time.monotonic()))

    def _settle(self, inner: Transfer | None, failure: BaseException | None = None) -> None:
        self._inner, self._failure = inner, failure
        self._issued.set()


class _StreamFence:
    """Carries "after the work queued so far on the caller's current CUDA stream" to the issue thread: `mark()` (on
    the caller) records an event there; `enter(event)` (on the issue thread) makes that thread's current stream, a
    private one, wait for it, so an engine that orders its copies after the current stream orders them after it."""

    def __init__(self, device: torch.device) -> None:
        from layerflow.transfer import cuda_api   # CUDA only: cuda.bindings need not be installed for the CPU path

        self._api = cuda_api
        self._device = device.index if device.index is not None else torch.cuda.current_device()
        self._pool = cuda_api.EventPool()
        self._stream = torch.cuda.Stream(device=self._device)

    def adopt(self) -> None:
        """On the issue thread: make the engine's device and the private stream current."""
        self._api.set_device(self._device)
        torch.cuda.set_stream(self._stream)

    def mark(self):
        event = self._pool.take()
        self._api.record(event, torch._C._cuda_getCurrentRawStream(self._device))
        return event

    def enter(self, event) -> None:
        self._api.stream_wait(self._stream.cuda_stream, event)
        self._pool.give(event)

    def close(self) -> None:
        self._pool.close()


class IssueThreadCopyEngine(CopyEngine):
    """Issues `inner`'s transfers on one thread ("layerflow-copy-issue"); `device` is the pools' device (CUDA: the
    offload fence above); `close()` drains the queue, then closes `inner` if `owns_inner`."""

    def __init__(self, inner: CopyEngine, device: torch.device, owns_inner: bool = True) -> None:
        if not isinstance(inner, CopyEngine):
            raise ValueError(f"inner={inner!r}: expected a CopyEngine")
        super().__init__()
        self.inner, self.owns_inner = inner, owns_inner
        self._fence = _StreamFence(device) if device.type == "cuda" else None
        self._worker = FifoWorker("layerflow-copy-issue")
        self._closed = False
        if self._fence is not None:
            self._on_worker(self._fence.adopt)

    def _on_worker(self, work) -> None:
        """Run `work` on the issue thread and wait for it; what it raises is raised here (and the engine closed)."""
        ran, failure = threading.Event(), []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - handed to the constructing thread
                failure.append(exc)
            ran.set()

        self._worker.submit(run)
        ran.wait()
        if failure:
            self.close()
            raise failure[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.stop()
        if self._fence is not None:
            self._fence.close()
        if self.owns_inner:
            self.inner.close()

    def _onboard(self, job: CopyJob) -> Transfer:
        return self._enqueue(job, to_gpu=True)

    def _offload(self, job: CopyJob) -> Transfer:
        return self._enqueue(job, to_gpu=False)

    def _enqueue(self, job: CopyJob, to_gpu: bool) -> Transfer:
        if self._closed:
            raise TransferError("copy engine closed: no transfer can be issued")
        transfer = IssuedTransfer()
        fence = None if to_gpu or self._fence is None else self._fence.mark()
        self._worker.submit(lambda: self._issue(job, to_gpu, fence, transfer))
        return transfer

    def _issue(self, job: CopyJob, to_gpu: bool, fence, transfer: IssuedTransfer) -> None:
        """On the issue thread: the inner engine's issue of `job`; what it raises fails this transfer alone."""
        try:
            if fence is not None:
                self._fence.enter(fence)
            inner = self.inner._onboard(job) if to_gpu else self.inner._offload(job)
        except Exception as exc:  # noqa: BLE001 - any failure must reach this transfer's waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"issuing the copies failed: {exc!r}")
            if job.signal is not None:
                job.signal.fail(error)
            transfer._settle(None, error)
            return
        transfer._settle(inner)
