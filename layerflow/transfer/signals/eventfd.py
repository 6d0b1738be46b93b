"""`eventfd` signals: one semaphore eventfd per (counter, layer), written once per onboarding.

Posting: the CPU copy thread writes the eventfd right after the layer's copy; with CUDA copies a NOTIFIER THREAD
synchronizes the layer's CUDA event and then writes it. Never a CUDA host function: CUDA runs host functions on one
callback thread, so a host node blocked reading an eventfd whose write is queued behind it as another host function
deadlocks (docs/design.md).

Readers: the runtime's native host node (captured in the CUDA graph) reads `handle.eventfd(layer)` (a blocking read
consuming the count) and checks the counter's int32 status word at `handle.status_address`. Python's `wait_layer`
polls the fd without consuming it, so both kinds of reader can coexist; leftover counts are drained when the counter
is acquired again. Poison: the status word is set first, then every not-yet-written layer's eventfd is written, so a
woken reader always sees the error.
"""

from __future__ import annotations

import functools
import os
import select
import time

from layerflow.config import SignalMode
from layerflow.transfer.signals.notifier import EventNotifier
from layerflow.transfer.signals.base import POISONED, LayerSignals, SignalHandle


class EventfdSignals(LayerSignals):
    """The ring of eventfds; owns the notifier thread used when copies run on CUDA streams."""

    mode = SignalMode.EVENTFD

    def __init__(self, num_layers: int, num_counters: int = 4, timeout_s: float = 10.0) -> None:
        super().__init__(num_layers, num_counters, timeout_s)
        flags = os.EFD_SEMAPHORE | os.EFD_CLOEXEC
        self._fds = [[os.eventfd(0, flags) for _ in range(num_layers)] for _ in range(num_counters)]
        self._pending = [0] * num_counters
        self._notifier: EventNotifier | None = None

    @property
    def fds(self) -> list[list[int]]:
        """`fds[counter][layer]`: the whole grid (what a transfer server is handed)."""
        return self._fds

    def eventfd(self, handle: SignalHandle, layer: int) -> int:
        handle._check_layer(layer)
        return self._fds[handle.counter_id][layer]

    def close(self) -> None:
        if self._notifier is not None:
            self._notifier.stop()
            self._notifier = None
        for row in self._fds:
            for fd in row:
                os.close(fd)
        self._fds = []

    def _is_free(self, counter: int) -> bool:
        return super()._is_free(counter) and self._pending[counter] == 0

    def _reset_counter(self, counter: int) -> None:
        fds = self._fds[counter]
        while ready := select.select(fds, [], [], 0)[0]:  # one syscall for the whole row (a new counter: none)
            for fd in ready:
                os.eventfd_read(fd)

    def _signal(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        if stream is None:
            self._write(handle.counter_id, layers)
            return
        if self._notifier is None:
            self._notifier = EventNotifier("layerflow-eventfd-notifier")
        self._pending[handle.counter_id] += 1
        self._notifier.submit(stream, functools.partial(self._notified, handle, layers))

    def _poison(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        self._write(handle.counter_id, layers)

    def _write(self, counter: int, layers: list[int]) -> None:
        for layer in layers:
            os.eventfd_write(self._fds[counter][layer], 1)

    def _notified(self, handle: SignalHandle, layers: list[int], error: BaseException | None) -> None:
        """Notifier thread: the CUDA event of `layers` completed (or failed with `error`)."""
        with self._cond:
            self._pending[handle.counter_id] -= 1
            if handle._live():
                if error is not None and self.status[handle.counter_id] == 0:
                    self._errors[handle.counter_id] = error
                    self.status[handle.counter_id] = POISONED
                self._write(handle.counter_id, layers)
            self._cond.notify_all()

    def _host_wait(self, handle: SignalHandle, layer: int, deadline: float) -> bool:
        fd = self._fds[handle.counter_id][layer]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000 + 0.999))
            if poller.poll(remaining_ms):
                return True
            if time.monotonic() >= deadline:
                return False
