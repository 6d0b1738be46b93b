"""A CopyEngine that issues another engine's copies on one thread of its own, off the thread that asks for them.

The caller (the serving scheduler) pays for the checks (`CopyEngine._layout`, `make_job`: a bad call still raises at
once, in the caller) and a queue put; the inner engine's issue (addresses, the per-layer copy calls and signal posts)
runs on the issue thread, in the order the transfers were asked for (onboardings first, below). Why: while the
scheduler thread issued each batch's copies itself, the copy engine sat idle whenever that thread was busy collecting,
launching or preparing the next batch (docs/serving.md); issued from a thread that does nothing else, the next
onboarding is queued on the copy stream as soon as it is asked for.

What still holds:
- Order: one thread, so onboardings reach the inner engine's H2D stream in the order they were asked for, and their
  layer signals are posted in that order too (the signal modes rely on it). The signals are posted by the copies
  themselves, on the copy stream, so a graph launched before its onboarding was issued just waits longer on the GPU.
- Onboardings go first: a queued onboarding is issued before any queued offload (each kind in its order), because
  the next batch's copies are what the copy engine waits for, while an offload only has to land before its user's
  pages are reused. The exception: an onboarding ordered after offloads (`order_onboards_after`: it overwrites
  pages of a user evicted while its offload was in flight) has those offloads, and any queued before them, issued
  first, so the inner engine can order it after them on the device.
- An offload waits for the work queued on the caller's current stream when it was asked for (CUDA: an event recorded
  there by the caller, waited by the issue thread's current stream, which the inner engine orders its offload after).
- The inner engine is only ever used from the issue thread, until `close()`, which drains the queue first.
- A failure to issue fails that transfer alone (and poisons its signal): the transfers queued behind it still run.

What does not: a layer posted from the host by the caller (the tier posts an onboarding whose users were all read
back, or poisons one that failed before its first copy) is not queued behind the onboardings still waiting here. With
`waitvalue` signals, whose graph waits read one epoch shared by all onboardings, a poison posted that way before any
copy of its onboarding was queued could release the layers of an earlier onboarding still queued here. A read-back
onboarding queues its copies here and waits for them before posting, so only that failure path is exposed, and only
with SSD or a remote tier: `runtime/tiers.issues_on_copy_thread` does not wrap the engine there.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from functools import partial
from typing import Callable, Sequence

import torch

from layerflow.transfer.copy_engine import CopyEngine, CopyJob, LayerAddresses, Transfer
from layerflow.transfer.copy_plan import Run
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import SignalHandle


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

    @property
    def issued(self) -> bool:
        return self._issued.is_set() and (self._inner is None or self._inner.issued)

    def order_before(self, stream: int) -> None:
        """Waits on the host until the issue thread issued it (never call it there for a transfer still queued),
        then orders `stream` as the inner transfer does; one that failed to issue moved nothing to wait for."""
        self._issued.wait()
        if self._inner is not None:
            self._inner.order_before(stream)

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

    def mark(self) -> object:
        event = self._pool.take()
        self._api.record(event, torch._C._cuda_getCurrentRawStream(self._device))
        return event

    def enter(self, event: object) -> None:
        self._api.stream_wait(self._stream.cuda_stream, event)
        self._pool.give(event)

    def drop(self, event: object) -> None:
        """Give back a mark nothing will enter."""
        self._pool.give(event)

    def close(self) -> None:
        self._pool.close()


class _IssueQueue:
    """Work for one daemon thread: onboardings before offloads, each kind in submission order; `stop()` runs what
    was already submitted, then joins. `setup` runs first on the thread; what it raises, `start` raises."""

    def __init__(self, name: str, setup: Callable[[], None] | None) -> None:
        self._cond = threading.Condition()
        self._onboards: deque[Callable[[], None]] = deque()
        self._offloads: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._busy = False   # a job is running on the thread
        self._setup, self._setup_error = setup, None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            self.stop()
            raise self._setup_error

    def submit(self, work: Callable[[], None], onboard: bool) -> None:
        with self._cond:
            if self._stopping:
                raise TransferError("copy engine closed: no transfer can be issued")
            (self._onboards if onboard else self._offloads).append(work)
            self._cond.notify()

    def run_offloads_until(self, ready: Callable[[], bool]) -> None:
        """On the thread, from inside a job: run queued offloads, oldest first, until `ready()` or none is left (an
        onboarding ordered after offloads that are still queued behind it)."""
        while not ready():
            with self._cond:
                if not self._offloads:
                    return
                work = self._offloads.popleft()
            work()

    def idle(self) -> bool:
        """Nothing queued and nothing running: the inner engine is free for the caller's thread until it submits."""
        with self._cond:
            return not (self._onboards or self._offloads or self._busy)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        # Not joined from the thread itself: the engine's finalizer runs there when its last job held the last
        # reference to the engine.
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that starts the queue
            self._setup_error = exc
        self._ready.set()
        while True:
            with self._cond:
                while not (self._onboards or self._offloads or self._stopping):
                    self._cond.wait()
                if not (self._onboards or self._offloads):
                    return
                work = (self._onboards or self._offloads).popleft()
                self._busy = True
            try:
                work()
            finally:
                work = None   # an idle thread must not keep its last job's tensors alive
                with self._cond:
                    self._busy = False


class IssueThreadCopyEngine(CopyEngine):
    """Issues `inner`'s transfers on one thread ("layerflow-copy-issue"); `device` is the pools' device (CUDA: the
    offload fence above); `close()` drains the queue, then closes `inner` if `owns_inner`.

    `inline` (set by the caller before each batch: `Engine.score`'s own batches with nothing in flight): the caller
    launches the batch right after its onboarding and collects it next, so while the queue is idle the batch's
    copies, its onboarding and its offload, are issued by `inner` on the caller's thread. Handed to the thread, the first copy
    waited for the GIL behind the caller's packing and launch, and the offload's issue held the GIL while the caller
    came back from the fetch (H200, 2K bf16 at batch size 1: layer 0 issued 0.40 ms after the request instead of
    ~0.12, the wake 0.07 ms). The thread is idle then and nothing else submits until the caller does, so `inner`
    still has one user at a time."""

    def __init__(self, inner: CopyEngine, device: torch.device, owns_inner: bool = True) -> None:
        if not isinstance(inner, CopyEngine):
            raise ValueError(f"inner={inner!r}: expected a CopyEngine")
        super().__init__()
        self.inner, self.owns_inner = inner, owns_inner
        self.inline = False
        self._inline_onboarded = False   # an inline onboarding since the last issue_deferred
        self._fence = _StreamFence(device) if device.type == "cuda" else None
        self._queue = _IssueQueue("layerflow-copy-issue", None if self._fence is None else self._fence.adopt)
        try:
            self._queue.start()
        except BaseException:
            if self._fence is not None:
                self._fence.close()
            raise
        # Stop the thread at close, at garbage collection or at interpreter exit, whichever comes first.
        self._stop = weakref.finalize(self, self._queue.stop)

    def close(self) -> None:
        if not self._stop.alive:
            return
        self._stop()
        if self._fence is not None:
            self._fence.close()
        if self.owns_inner:
            self.inner.close()

    def issue_deferred(self) -> None:
        """The inner engine's deferred layers, if an inline onboarding left any (the thread leaves none): at once
        where the queue is idle, else queued behind what is."""
        if not self._inline_onboarded:
            return
        self._inline_onboarded = False
        if self._queue.idle():
            self.inner.issue_deferred()
        else:
            self._queue.submit(self.inner.issue_deferred, onboard=True)

    def order_onboards_after(self, transfers: Sequence[Transfer]) -> None:
        """Queued with the onboardings, so it reaches the inner engine right before the next one: the offloads it
        orders after that are still queued here are issued first (they are small and wait for no onboarding), then
        the inner engine orders its onboardings after them. If that fails, the thread waits for them instead:
        an onboarding must never overwrite pages an offload still reads."""
        waited = list(transfers)
        if self.inline and self._queue.idle():
            self.inner.order_onboards_after(waited)
            return
        self._queue.submit(partial(self._order_after, waited), onboard=True)

    def _order_after(self, transfers: list[Transfer]) -> None:
        self._queue.run_offloads_until(lambda: all(t.issued for t in transfers))
        try:
            self.inner.order_onboards_after(transfers)
        except Exception:  # noqa: BLE001 - any failure to order on the device falls back to the host's wait
            CopyEngine.order_onboards_after(self, transfers)

    def _onboard(self, job: CopyJob) -> Transfer:
        if self.inline and self._queue.idle():
            self._inline_onboarded = True
            return self.inner._onboard(job)
        transfer = IssuedTransfer()
        self._queue.submit(lambda: self._issue(partial(self.inner._onboard, job), job.signal, None, transfer),
                           onboard=True)
        return transfer

    def _onboard_run(self, gpu_layers: tuple[torch.Tensor, ...], host: torch.Tensor, addresses: LayerAddresses,
                     run: Run, signal: SignalHandle | None, first_layer: int) -> Transfer:
        """A one-run onboarding keeps the inner engine's run path (no job) on the issue thread, or inline."""
        if self.inline and self._queue.idle():
            self._inline_onboarded = True
            return self.inner._onboard_run(gpu_layers, host, addresses, run, signal, first_layer)
        transfer = IssuedTransfer()
        start = partial(self.inner._onboard_run, gpu_layers, host, addresses, run, signal, first_layer)
        self._queue.submit(lambda: self._issue(start, signal, None, transfer), onboard=True)
        return transfer

    def _offload(self, job: CopyJob) -> Transfer:
        if self.inline and self._queue.idle():
            return self.inner._offload(job)
        transfer = IssuedTransfer()
        if self._fence is None:
            self._queue.submit(lambda: self._issue(partial(self.inner._offload, job), None, None, transfer),
                               onboard=False)
            return transfer
        fence = self._fence.mark()
        try:
            self._queue.submit(lambda: self._issue(partial(self.inner._offload, job), None, fence, transfer),
                               onboard=False)
        except BaseException:
            self._fence.drop(fence)
            raise
        return transfer

    def _issue(self, start: Callable[[], Transfer], signal: SignalHandle | None, fence: object | None,
               transfer: IssuedTransfer) -> None:
        """On the issue thread: `start()` issues on the inner engine; what it raises fails this transfer alone (and
        poisons `signal`)."""
        try:
            if fence is not None:
                self._fence.enter(fence)
            inner = start()
            self.inner.issue_deferred()   # the thread issues every layer: a lead is for the caller's thread
        except Exception as exc:  # noqa: BLE001 - any failure must reach this transfer's waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"issuing the copies failed: {exc!r}")
            if signal is not None:
                signal.fail(error)
            transfer._settle(None, error)
            return
        transfer._settle(inner)
