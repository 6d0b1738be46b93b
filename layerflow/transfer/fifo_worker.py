"""A FIFO of callables run on one daemon thread: the CPU copy engine's copy "streams" and the transfer server's
completion lanes (work that must finish in submission order, off the thread that submits it)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)


class FifoWorker:
    """Runs submitted callables one at a time, in order; `stop()` runs what was already submitted, then joins."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            try:
                work()
            except Exception:  # noqa: BLE001 - one failed job must not stop the jobs queued behind it
                log.exception("a job on %s failed", self._thread.name)
            work = None   # an idle worker must not keep its last job's tensors (and the memory they map) alive
