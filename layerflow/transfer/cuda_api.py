"""CUDA streams and events through cuda.bindings.runtime, as plain helpers the copy engine and signals share.

Handles cross the API as ints (stream) or cuda.bindings event objects; torch streams pass `stream.cuda_stream`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from cuda.bindings import runtime as rt

from layerflow.transfer.errors import TransferError



def require_cuda(what: str) -> None:
    """Fail early, and say why, when a CUDA-only path is asked for on a machine without a GPU."""
    if not torch.cuda.is_available():
        raise TransferError(f"{what} needs a CUDA GPU; none is available (use the eventfd signal / ThreadCopyEngine)")


def check(result: Any, call: str) -> Any:
    """Unpack a cuda.bindings `(err, *values)` tuple; raise TransferError naming `call` on failure."""
    err, *values = result
    if int(err) != 0:
        raise TransferError(f"{call} failed: {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def poll_until(ready: Callable[[], bool], deadline: float, spin_s: float = 0.02) -> bool:
    """Call `ready()` until it is true (True) or `deadline` (monotonic seconds) passes (False).

    The first `spin_s` only yield the GIL between checks: a sleep, even a short one, oversleeps by 50-500 us, which
    measured as a 0.5 ms late completion on a 1.5 ms onboarding. Longer waits back off to sleeps of at most 0.5 ms.
    """
    spin_until = time.monotonic() + spin_s
    sleep = 5e-5
    while True:
        if ready():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            time.sleep(0)
            continue
        time.sleep(min(sleep, deadline - now))
        sleep = min(sleep * 2, 5e-4)


def current_device() -> int:
    return check(rt.cudaGetDevice(), "cudaGetDevice")


def set_device(device: int) -> None:
    """Make the device's primary context current on this thread (the one torch uses)."""
    check(rt.cudaSetDevice(device), "cudaSetDevice")


def create_stream() -> int:
    """A non-blocking stream: no implicit sync with the legacy default stream."""
    return int(check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"))


def destroy_stream(stream: int) -> None:
    check(rt.cudaStreamDestroy(stream), "cudaStreamDestroy")


def create_event(timing: bool = False) -> rt.cudaEvent_t:
    flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
    return check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")


def destroy_event(event: rt.cudaEvent_t) -> None:
    check(rt.cudaEventDestroy(event), "cudaEventDestroy")


def record(event: rt.cudaEvent_t, stream: int) -> None:
    check(rt.cudaEventRecord(event, stream), "cudaEventRecord")


def record_external(event: rt.cudaEvent_t, stream: int) -> None:
    """Under graph capture: an event record node (each replay records `event`), e.g. for timing a replay."""
    check(rt.cudaEventRecordWithFlags(event, stream, rt.cudaEventRecordExternal), "cudaEventRecordWithFlags")


def synchronize(event: rt.cudaEvent_t) -> None:
    check(rt.cudaEventSynchronize(event), "cudaEventSynchronize")


def query(event: rt.cudaEvent_t) -> bool:
    """True once the event's work completed, False while pending; TransferError on an execution error."""
    err = rt.cudaEventQuery(event)[0]
    if err == rt.cudaError_t.cudaSuccess:
        return True
    if err == rt.cudaError_t.cudaErrorNotReady:
        return False
    raise TransferError(f"cudaEventQuery failed: {err!r}")


def elapsed_ms(start: rt.cudaEvent_t, end: rt.cudaEvent_t) -> float:
    return check(rt.cudaEventElapsedTime(start, end), "cudaEventElapsedTime")


def stream_wait(stream: int, event: rt.cudaEvent_t, external: bool = False) -> None:
    """`stream` waits on the GPU for `event`; `external` makes it an external wait node under graph capture."""
    flags = rt.cudaEventWaitExternal if external else rt.cudaEventWaitDefault
    check(rt.cudaStreamWaitEvent(stream, event, flags), "cudaStreamWaitEvent")


class EventPool:
    """Reusable timing-free events: creating one per layer per transfer would cost a driver call each.

    After `close` the pooled events are destroyed, and so is every event given back later (a transfer reaped after
    its engine closed).
    """

    def __init__(self) -> None:
        self._free: list[rt.cudaEvent_t] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> rt.cudaEvent_t:
        with self._lock:
            if self._free:
                return self._free.pop()
        return create_event()

    def give(self, event: rt.cudaEvent_t) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(event)
                return
        destroy_event(event)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for event in free:
            destroy_event(event)
