"""Who runs the answers of served requests: the scheduler thread itself ("inline"), or an answering thread of its
own ("thread").

Answering a batch (its results split into `Scored`, the latency histogram and counters updated, each future set,
which runs its callers' callbacks: an HTTP handler's wake-up, a benchmark's record) is host work the engine's next
batch does not need. On the scheduler thread it sits between a collect and the next launch; on an answering thread it
runs while the scheduler waits without the GIL (a device sync, a copy call, a pause for arrivals). Every answer goes
through one FIFO in the order the scheduler posts it, so a user's answers keep its requests' order in both modes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from layerflow.serving.modes import selected

log = logging.getLogger(__name__)

ANSWER_MODES = ("inline", "thread")
ANSWERS_ENV = "LAYERFLOW_SERVE_ANSWERS"


def answer_mode(value: str | None) -> str:
    """`value`, else $LAYERFLOW_SERVE_ANSWERS, else "inline"; ValueError naming a mode not in ANSWER_MODES."""
    return selected("answers", value, ANSWERS_ENV, ANSWER_MODES)


class Answers:
    """Runs posted answer jobs in post order: at once ("inline") or on a daemon thread ("thread"). `close()` runs
    what is still posted and stops the thread; a job posted after it runs at once."""

    def __init__(self, mode: str) -> None:
        if mode not in ANSWER_MODES:
            raise ValueError(f"mode={mode!r}: expected one of {ANSWER_MODES}")
        self.mode = mode
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if mode == "thread":
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="layerflow-answers", daemon=True)
            self._thread.start()

    def post(self, job: Callable[..., None], *args) -> None:
        if self._jobs is None:
            job(*args)
        else:
            self._jobs.put((job, args))

    def close(self) -> None:
        if self._jobs is None:
            return
        jobs, self._jobs = self._jobs, None
        jobs.put(None)
        self._thread.join()
        while not jobs.empty():   # posted by a racing caller after the sentinel
            job, args = jobs.get()
            job(*args)

    def _run(self) -> None:
        jobs = self._jobs
        while (posted := jobs.get()) is not None:
            job, args = posted
            try:
                job(*args)
            except Exception:  # noqa: BLE001 - one broken answer must not stop the others
                log.exception("answering a request failed")
