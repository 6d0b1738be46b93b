"""The producer side of a client's counter, inside the server: what the copy engine posts into.

It has the producer half of `SignalHandle` (`num_layers`, `complete_layer`, `fail`) and writes
the client's eventfds. CPU copies (stream None) write at once; CUDA copies are turned into
writes by a notifier thread that synchronizes a per-layer event (never a CUDA host function,
see docs/design.md). The server answers DONE only after `flush()`, so no write of this request can
land after the client reuses the counter. Poison is the client's job: the server reports a
failure as an ERROR message and the client poisons its own status word and wakes its waiters
(which also covers a server that died and can write nothing).
"""

from __future__ import annotations

import functools
import os
import threading

from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.notifier import EventNotifier


class ClientSignal:
    """One request's view of one client counter: `fds[layer]` are the client's eventfds."""

    def __init__(self, fds: list[int], layerwise: bool, notifier: EventNotifier | None = None) -> None:
        self.fds = fds
        self.num_layers = len(fds)
        self.layerwise = layerwise
        self.error: BaseException | None = None
        self._notifier = notifier
        self._pending = 0
        self._cond = threading.Condition()

    def complete_layer(self, layer: int, stream: int | None = None) -> None:
        """Layer `layer`'s copies finished (stream None) or were issued on `stream`."""
        if self.layerwise:
            layers = [layer]
        elif layer == self.num_layers - 1:
            layers = list(range(self.num_layers))
        else:
            return
        if stream is None:
            self.write(layers)
            return
        if self._notifier is None:
            raise TransferError("a CUDA stream was given but the server has no CUDA notifier")
        with self._cond:
            self._pending += 1
        self._notifier.submit(stream, functools.partial(self._notified, layers))

    def fail(self, error: BaseException, stream: int | None = None) -> None:
        """Record the failure; the server sends it to the client, which poisons its waiters."""
        self.error = error

    def write(self, layers: list[int]) -> None:
        for layer in layers:
            os.eventfd_write(self.fds[layer], 1)

    def flush(self, timeout: float) -> None:
        """Wait until every notifier write of this request happened."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout):
                raise TransferError(f"{self._pending} layer signal(s) still pending after {timeout:.3f} s")

    def _notified(self, layers: list[int], error: BaseException | None) -> None:
        if error is None:
            self.write(layers)
        elif self.error is None:
            self.error = error
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()
