"""One thread turning completed CUDA events into callbacks, in submission order.

This is how eventfd signals follow copies on CUDA streams without a CUDA host function: a host function that writes
an eventfd a host node of the compute graph is blocked on can deadlock the callback thread (docs/design.md). The ring of
eventfds (`eventfd.EventfdSignals`) and the transfer server's client signals both post through it.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from layerflow.transfer import cuda_api
from layerflow.transfer.errors import TransferError

Callback = Callable[[BaseException | None], None]


class EventNotifier:
    """`submit(stream, callback)`: `callback(error)` runs on the notifier thread once `stream`'s queued work is done."""

    def __init__(self, name: str, device: int | None = None) -> None:
        """`device`: the GPU whose streams `submit` is given (default: this thread's current one)."""
        self._events = cuda_api.EventPool()
        self._device = cuda_api.current_device() if device is None else device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, stream: int, callback: Callback) -> None:
        """`error` is None when the work completed, else the TransferError the event reported."""
        event = self._events.take()
        cuda_api.record(event, stream)
        self._queue.put((event, callback))

    def stop(self) -> None:
        """Run the callbacks already submitted, then end the thread and free the events."""
        self._queue.put(None)
        self._thread.join()
        self._events.close()

    def _run(self) -> None:
        cuda_api.set_device(self._device)
        while (item := self._queue.get()) is not None:
            event, callback = item
            error: BaseException | None = None
            try:
                cuda_api.synchronize(event)
            except TransferError as exc:
                error = exc
            self._events.give(event)
            callback(error)
