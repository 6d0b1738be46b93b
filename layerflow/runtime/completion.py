"""How the host learns that a launched batch is done: the fetch's blocking synchronisation, or a native spin.

`sync` (the default) leaves it to the stream synchronisation inside `BatchBuffers.fetch`. `spin` records an event
after the launch and, at the collect, polls it with the runtime's cudaEventQuery from C (csrc/event_spin.c), the GIL
released the whole time, so other Python threads (a notifier, a server connection) run meanwhile; the fetch's
synchronisation then returns at once. The host wakes within one query of the scores landing, for one busy core while
it waits.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from layerflow.runtime import hostfn
from layerflow.transfer import cuda_api, cudart

SPIN_SOURCE = Path(__file__).parent / "csrc" / "event_spin.c"
FETCH_MODES = ("sync", "spin")
NOT_READY = 600   # cudaErrorNotReady: the event has not completed


@functools.cache
def spin_shim() -> ctypes.CDLL:
    """The compiled spin (built on first use, like the eventfd wait node)."""
    lib = ctypes.CDLL(str(hostfn.build_shim(SPIN_SOURCE)))
    lib.layerflow_spin_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.layerflow_spin_event.restype = ctypes.c_int
    return lib


def spin_event(query_address: int, event: int, timeout_s: float) -> int:
    """Call the C function at `query_address` (`int query(void *event)`, cudaEventQuery's signature) until it stops
    answering NOT_READY or `timeout_s` passes; its last answer (0: complete)."""
    if not query_address:
        raise ValueError(f"query_address={query_address!r}: must be a function's address")
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s={timeout_s!r}: must be a non-negative number of seconds")
    return spin_shim().layerflow_spin_event(query_address, event, int(timeout_s * 1e9))


class EventSpin:
    """One event recorded after each launch and spun on at its collect (one batch is in flight at a time)."""

    def __init__(self, timeout_s: float) -> None:
        spin_shim()   # built at set-up, never inside a request
        self._query = ctypes.cast(cudart.lib().cudaEventQuery, ctypes.c_void_p).value   # called from C only
        self._event = cuda_api.create_event()
        self.timeout_s = timeout_s

    def record(self, stream: int) -> None:
        """Mark the end of the work queued on `stream` so far (the block and its scores' copy)."""
        cudart.event_record(int(self._event), stream)

    def wait(self) -> bool:
        """Spin until the last recorded work completed; False when it failed or the timeout passed (the fetch's own
        synchronisation then waits, or raises the device's error)."""
        return spin_event(self._query, int(self._event), self.timeout_s) == 0

    def close(self) -> None:
        cuda_api.destroy_event(self._event)
