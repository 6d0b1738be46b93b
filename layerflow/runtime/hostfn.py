"""The eventfd wait node: a native host function that a CUDA graph runs before each layer.

CUDA runs host functions on one callback thread. A Python host function there needs the GIL, so a
main thread busy in Python stalls every layer by up to the switch interval (5 ms). The wait is therefore
a tiny C function (csrc/eventfd_wait.c), compiled on first use with the system C compiler and loaded
with ctypes; it is launched with the CUDA runtime's own `cudaLaunchHostFunc` through ctypes (the
cuda.bindings wrapper crashed with a raw function pointer), which during stream capture becomes a host
node of the graph.

Each wait reads a slot at a fixed host address (`WaitSlots`), so the runtime can point a captured graph
at fresh eventfds before every replay without recapturing it.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Sequence
from pathlib import Path

from layerflow.runtime.native_build import CSRC, build_library
from layerflow.transfer import cudart

SOURCE = CSRC / "eventfd_wait.c"


class WaitStatus(enum.IntEnum):
    """What a wait node reports; the values are the C shim's."""

    PENDING = -1
    OK = 0
    TIMEOUT = 1
    POISONED = 2
    READ_ERROR = 3


class WaitSlot(ctypes.Structure):
    """Mirror of `layerflow_wait_slot` in csrc/eventfd_wait.c (same field order and widths)."""

    _fields_ = [
        ("fd", ctypes.c_int32),
        ("timeout_ms", ctypes.c_int32),
        ("status", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("released_ns", ctypes.c_int64),
        ("poison", ctypes.c_void_p),
    ]


def build_shim() -> Path:
    """The compiled shim in the cache dir (built on first use, runtime/native_build.py)."""
    return build_library(SOURCE)


@functools.cache
def shim() -> ctypes.CDLL:
    """The loaded shim with its C signatures declared (built on first use)."""
    lib = ctypes.CDLL(str(build_shim()))
    lib.layerflow_eventfd_wait.argtypes = [ctypes.c_void_p]
    lib.layerflow_eventfd_wait.restype = None
    lib.layerflow_eventfd_post_at.argtypes = [
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int32,
    ]
    lib.layerflow_eventfd_post_at.restype = ctypes.c_int32
    return lib


def eventfd_wait_address() -> int:
    """Address of the native `layerflow_eventfd_wait`, the function a host node runs."""
    return ctypes.cast(shim().layerflow_eventfd_wait, ctypes.c_void_p).value


def call_eventfd_wait(slot_addr: int) -> None:
    """Run the wait on this thread (CPU path, tests). ctypes releases the GIL for the call."""
    if slot_addr <= 0:
        raise ValueError(f"slot_addr={slot_addr!r}: must be a slot's address")
    shim().layerflow_eventfd_wait(slot_addr)


def post_eventfds_at(fds: Sequence[int], at_ns: Sequence[int]) -> list[int]:
    """Add one to fds[i] at CLOCK_MONOTONIC time at_ns[i], all in native code (no GIL); returns write times.

    A notifier for benchmarks and tests whose post times must not depend on the interpreter.
    """
    if len(fds) != len(at_ns):
        raise ValueError(f"len(fds)={len(fds)} != len(at_ns)={len(at_ns)}")
    n = len(fds)
    c_fds = (ctypes.c_int32 * n)(*fds)
    c_at = (ctypes.c_int64 * n)(*at_ns)
    written = (ctypes.c_int64 * n)()
    failed = shim().layerflow_eventfd_post_at(c_fds, c_at, written, n)
    if failed:
        raise OSError(f"{failed} of {n} eventfd writes failed (fds={list(fds)})")
    return list(written)


class PoisonWord:
    """An int32 in host memory that fails the waits pointing at it when nonzero (a failed transfer)."""

    def __init__(self) -> None:
        self._word = ctypes.c_int32(0)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._word)

    def set(self) -> None:
        self._word.value = 1

    def clear(self) -> None:
        self._word.value = 0

    def __bool__(self) -> bool:
        return self._word.value != 0


class WaitSlots:
    """One wait slot per layer at fixed host addresses, for graphs captured once and replayed many times."""

    def __init__(self, num_layers: int) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers={num_layers!r}: must be a positive integer")
        self.num_layers = num_layers
        self._slots = (WaitSlot * num_layers)()
        for slot in self._slots:
            slot.fd = -1
            slot.timeout_ms = 1
        self.reset()

    def _check_layer(self, layer: int) -> WaitSlot:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected 0 <= layer < {self.num_layers}")
        return self._slots[layer]

    def address(self, layer: int) -> int:
        """The slot's address: what a host node for this layer is launched with."""
        self._check_layer(layer)
        return ctypes.addressof(self._slots) + layer * ctypes.sizeof(WaitSlot)

    def set(self, layer: int, fd: int, timeout_ms: int, poison_addr: int = 0) -> None:
        """Point layer's wait at fd (fd < 0: no wait) with a timeout and an optional poison word."""
        slot = self._check_layer(layer)
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or not 0 < timeout_ms < 2**31:
            raise ValueError(f"timeout_ms={timeout_ms!r}: must be a positive int32")
        if not isinstance(fd, int) or not -(2**31) <= fd < 2**31:
            raise ValueError(f"fd={fd!r}: must be an int32")
        if not isinstance(poison_addr, int) or poison_addr < 0:
            raise ValueError(f"poison_addr={poison_addr!r}: must be an address or 0")
        slot.fd = fd
        slot.timeout_ms = timeout_ms
        slot.poison = poison_addr or None

    def status(self, layer: int) -> WaitStatus:
        return WaitStatus(self._check_layer(layer).status)

    def released_ns(self, layer: int) -> int:
        """CLOCK_MONOTONIC ns at which the layer's wait returned (0 while pending)."""
        return self._check_layer(layer).released_ns

    def reset(self) -> None:
        """Mark every wait pending before a replay; fds, timeouts and poison words stay."""
        for slot in self._slots:
            slot.status = WaitStatus.PENDING
            slot.released_ns = 0


def launch_eventfd_wait(stream: int, slot_addr: int) -> None:
    """Enqueue the native eventfd wait on stream (a cudaStream_t as int); a host node when capturing."""
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise ValueError(f"stream={stream!r}: must be a cudaStream_t as int")
    if not isinstance(slot_addr, int) or slot_addr <= 0:
        raise ValueError(f"slot_addr={slot_addr!r}: must be a slot's address")
    cudart.launch_host_func(stream, eventfd_wait_address(), slot_addr)
