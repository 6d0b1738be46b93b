"""An onboarding's copies issued from a thread of their own, so the engine's thread packs, fills and launches the
batch while the copy calls go out.

A layer's wait in the block is on its signal, not on the issue, so the block may be launched before its copies are
issued when the wait reads the signal at run time: a waitvalue word or an eventfd (an `event` wait would see the
previous onboarding's event; the engine refuses that pairing). The copy calls go through ctypes and cuda.bindings,
which drop the GIL in the driver, so the two threads alternate at those calls. `submit` returns once the first
layer's copies are issued: the engine's thread would otherwise take the GIL at the worker's first driver call and
hold it through its own Python (packing, filling), delaying the first copy by that long; the later layers have the
first layer's copy time to be issued in.
"""

from __future__ import annotations

import threading
from typing import Callable

from layerflow.transfer.fifo_worker import FifoWorker
from layerflow.transfer.signals.base import SignalHandle

POLL_S = 0.01   # how often `submit` also checks that its job has not ended without posting a layer


class IssueJob:
    """One submitted issue: `done()` / `wait()` for its end; what it raised is kept in `error` (the onboarding's
    copies already report it to their waiters through the poisoned signal)."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as e:   # noqa: BLE001 - kept for the onboarding's owner, who decides
            self.error = e
        finally:
            self._work = None
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Until the issue ended (the copies it started may still be running)."""
        self._done.wait()


class IssueWorker:
    """Runs issue jobs one at a time, in submission order: onboardings reach the copy stream in the order their
    signals were acquired, which the signal modes rely on."""

    def __init__(self) -> None:
        self._worker = FifoWorker("layerflow-onboard-issue")

    def submit(self, work: Callable[[], None], signal: SignalHandle) -> IssueJob:
        """Queue `work`, the copy issue of `signal`'s onboarding; returns once its first layer is posted (issued, or
        failed: a failure posts every layer) or the job ended. A non-layerwise signal posts only with its last layer,
        and an onboarding read back from SSD only once every read landed: `submit` then waits as long as an inline
        issue would take."""
        job = IssueJob(work)
        self._worker.submit(job.run)
        while not signal.wait_issued(0, POLL_S) and not job.done():
            pass
        return job

    def close(self) -> None:
        """Run what was submitted, then stop the thread."""
        self._worker.stop()
