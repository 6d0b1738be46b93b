"""Per-layer "your KV has landed" signals: the ring of counters and the handle one onboarding holds.

A ring has `num_counters` counters x `num_layers` layer signals. `acquire()` takes the next counter in ring order
(waiting while that counter is still in use), so back-to-back onboardings never share a signal. A counter is free again
once its consumer called `release()` AND its producer posted (or poisoned) every layer: a late post can never land on
the counter's next user. Each acquisition bumps the counter's generation; work tagged with an older generation is
dropped.

Producer side (the copy engines): `complete_layer(l, stream)` after layer l's copies were issued on `stream` (CUDA) or
finished (stream None, CPU engine); `fail(error, stream)` poisons: the counter's status word becomes nonzero and every
layer not yet posted is released so no waiter hangs. Consumer side: `wait_layer(l, timeout)`, `wait()`,
`gpu_wait_layer(l, stream)` where the mode has one. Host waits always end: by the signal, by poison, or by a timeout,
each raising TransferError naming the layer and counter.

Non-layerwise handles (`layerwise=False`, the fallback for backends without layerwise) ignore every layer but the last
and then post all layers at once: waiters are unchanged, they just all wake at the end.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import Iterable

import numpy as np

from layerflow.config import SignalMode
from layerflow.transfer.errors import TransferError

POISONED = 1


class SignalHandle:
    """One onboarding's view of its counter."""

    def __init__(self, ring: LayerSignals, counter_id: int, generation: int, layerwise: bool) -> None:
        self.ring = ring
        self.counter_id = counter_id
        self.generation = generation
        self.layerwise = layerwise
        self.num_layers = ring.num_layers

    # consumer side
    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until layer `layer` landed; TransferError on poison or after `timeout` s (ring default if None)."""
        self._check_layer(layer)
        timeout = self.ring.timeout_s if timeout is None else timeout
        landed = self.ring._host_wait(self, layer, time.monotonic() + timeout)
        self._raise_if_poisoned(layer)
        if not landed:
            raise TransferError(f"layer {layer} of signal counter {self.counter_id} not signalled within {timeout:.3f} s")

    def wait(self, timeout: float | None = None) -> None:
        """Every layer landed (one deadline for all)."""
        timeout = self.ring.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for layer in range(self.num_layers):
            self.wait_layer(layer, max(0.0, deadline - time.monotonic()))

    def gpu_wait_layer(self, layer: int, stream: int) -> None:
        """Make `stream` (a CUDA stream handle) wait for layer `layer` on the device, without blocking the host."""
        self._check_layer(layer)
        self.ring._gpu_wait(self, layer, stream)

    @property
    def error(self) -> BaseException | None:
        return self.ring._errors[self.counter_id] if self._live() else None

    def eventfd(self, layer: int) -> int:
        """The raw semaphore eventfd of `layer` (eventfd mode), for the runtime's native host node to read."""
        return self.ring.eventfd(self, layer)

    @property
    def status_address(self) -> int:
        """Address of this counter's int32 status word (0 ok, nonzero poisoned), for native waiters."""
        return self.ring.status_base + self.counter_id * self.ring.status.itemsize

    def release(self) -> None:
        """The consumer is done with this counter (call after every reader, graph replays included, finished)."""
        self.ring._release(self)

    # producer side
    def complete_layer(self, layer: int, stream: int | None = None) -> None:
        """Layer `layer`'s copies were issued on `stream`, or (stream None) have completed on the host."""
        self._check_layer(layer)
        if self.layerwise:
            self.ring._post(self, (layer,), stream)
        elif layer == self.num_layers - 1:
            self.ring._post(self, range(self.num_layers), stream)

    def fail(self, error: BaseException, stream: int | None = None) -> None:
        """Poison the counter: waiters of every layer not yet posted wake and raise TransferError(error)."""
        self.ring._fail(self, error, stream)

    def _live(self) -> bool:
        return self.ring._generation[self.counter_id] == self.generation

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers})")
        if not self._live():
            raise TransferError(f"signal counter {self.counter_id}: handle used after its counter was re-acquired")

    def _raise_if_poisoned(self, layer: int) -> None:
        if self.ring.status[self.counter_id] != 0:
            error = self.ring._errors[self.counter_id]
            raise TransferError(f"layer {layer} of signal counter {self.counter_id} poisoned: {error}") from error


class LayerSignals(ABC):
    """A ring of `num_counters` x `num_layers` layer signals of one mode."""

    mode: SignalMode
    # Whether a wait may be launched before its layer's post is issued (it then waits longer): true where the wait
    # reads memory or an eventfd; false for CUDA events, whose wait binds to the record issued before it.
    waits_before_posts = True

    def __init__(self, num_layers: int, num_counters: int = 4, timeout_s: float = 10.0) -> None:
        for name, value in (("num_layers", num_layers), ("num_counters", num_counters)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be positive")
        self.num_layers = num_layers
        self.num_counters = num_counters
        self.timeout_s = float(timeout_s)
        self.status = np.zeros(num_counters, dtype=np.int32)
        self.status_base = self.status.ctypes.data  # the array is never reallocated; `.ctypes` costs ~1 us a call
        self._errors: list[BaseException | None] = [None] * num_counters
        self._generation = [0] * num_counters
        # Per counter, whether each layer was posted, and how many were not yet: plain lists, not numpy (a numpy
        # reduction or fancy index costs microseconds per post and acquisition, on the first copy's path).
        self._posted = [[True] * num_layers for _ in range(num_counters)]
        self._unposted = [0] * num_counters
        self._released = [True] * num_counters
        self._next = 0
        self._cond = threading.Condition()

    def acquire(self, layerwise: bool = True, timeout: float | None = None) -> SignalHandle:
        """The next counter of the ring, reset for a new onboarding; waits while it is still in use."""
        timeout = self.timeout_s if timeout is None else timeout
        with self._cond:
            counter = self._next
            # The common case (the counter is free) without wait_for's frames and predicate: they cost microseconds
            # on the first copy's path.
            if not (self._is_free(counter) or self._cond.wait_for(lambda: self._is_free(counter), timeout)):
                raise TransferError(f"signal counter {counter} still in use after {timeout:.3f} s "
                                    f"(released={self._released[counter]}, "
                                    f"posted={self.num_layers - self._unposted[counter]}/{self.num_layers})")
            self._next = (counter + 1) % self.num_counters
            self._generation[counter] += 1
            self._reset_counter(counter)
            self._posted[counter] = [False] * self.num_layers
            self._unposted[counter] = self.num_layers
            self._released[counter] = False
            self._errors[counter] = None
            self.status[counter] = 0
            return SignalHandle(self, counter, self._generation[counter], layerwise)

    def eventfd(self, handle: SignalHandle, layer: int) -> int:
        raise TransferError(f"signal mode {self.mode.value!r} has no eventfds")

    def capture_gpu_wait(self, layer: int, stream: int) -> None:
        """Inside CUDA-graph capture on `stream`: a wait for `layer` that later replays re-target (see the mode)."""
        raise TransferError(f"signal mode {self.mode.value!r} has no capturable GPU wait")

    def prepare_replay(self, handle: SignalHandle | None, stream: int) -> None:
        """Before launching a captured graph on `stream`: aim its waits at `handle`'s onboarding (None: no onboarding)."""
        raise TransferError(f"signal mode {self.mode.value!r} has no capturable GPU wait")

    def close(self) -> None:
        """Release OS/CUDA resources."""

    def _is_free(self, counter: int) -> bool:
        return self._released[counter] and not self._unposted[counter]

    def _mark_posted(self, handle: SignalHandle, layers: Iterable[int]) -> list[int]:
        """Under the lock: the layers of `handle` not yet posted, now marked posted (none if the handle is stale)."""
        if not handle._live():
            return []
        row = self._posted[handle.counter_id]
        fresh = [layer for layer in layers if not row[layer]]
        for layer in fresh:
            row[layer] = True
        self._unposted[handle.counter_id] -= len(fresh)
        self._cond.notify_all()
        return fresh

    def _post(self, handle: SignalHandle, layers: Iterable[int], stream: int | None) -> None:
        with self._cond:
            fresh = self._mark_posted(handle, layers)
            if fresh:
                self._signal(handle, fresh, stream)

    def _fail(self, handle: SignalHandle, error: BaseException, stream: int | None) -> None:
        with self._cond:
            if not handle._live():
                return
            self._errors[handle.counter_id] = error
            self.status[handle.counter_id] = POISONED
            fresh = self._mark_posted(handle, range(self.num_layers))
            self._poison(handle, fresh, stream)

    def _release(self, handle: SignalHandle) -> None:
        with self._cond:
            if handle._live():
                self._released[handle.counter_id] = True
                self._cond.notify_all()

    def _wait_posted(self, handle: SignalHandle, layer: int, deadline: float) -> bool:
        """Host wait until the producer posted (CUDA modes: issued) `layer` of `handle`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._posted[handle.counter_id][layer],
                                       max(0.0, deadline - time.monotonic()))

    def _gpu_wait(self, handle: SignalHandle, layer: int, stream: int) -> None:
        raise TransferError(f"signal mode {self.mode.value!r} has no GPU-side wait; wait on the host")

    def _reset_counter(self, counter: int) -> None:
        """Under the lock, before a counter is handed out again: clear mode-specific leftovers."""

    @abstractmethod
    def _signal(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        """Under the lock: release `layers` (stream None: now; else once the stream's work so far completed)."""

    @abstractmethod
    def _poison(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        """Under the lock, status already set: wake every waiter of `layers` now (they will see the poison)."""

    @abstractmethod
    def _host_wait(self, handle: SignalHandle, layer: int, deadline: float) -> bool:
        """Block until layer landed or poisoned (True) or `deadline` passed (False)."""
