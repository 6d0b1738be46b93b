"""A batch's done word: a pinned host int32 that the batch's stream sets (cuStreamWriteValue32) right after the
results' copy, and the host's wait for it.

Why: torch's Stream.synchronize learns of the stream's end through the driver's completion write, which queues
behind the device-to-host copies of the offload issued after the launch (benchmarks/wake_probe.py; figures in
docs/performance.md). The word is written inside the graph, before any of them. The wait spins in C (csrc/spin_word.c, through ctypes, which drops the GIL for the call, so a serving thread
runs meanwhile; in Python, holding the GIL, where no C compiler is found); between spins it checks the stream, so a
stream that went idle without setting the word (a failed batch) raises TransferError instead of hanging.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from layerflow.runtime.native_build import CSRC, build_library
from layerflow.transfer import cudart
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.native_post import NativePoster

log = logging.getLogger(__name__)

SOURCE = CSRC / "spin_word.c"
SPINS = 1 << 16   # reads per native call (a few ms) between checks that the stream is still busy


@functools.cache
def native_spin() -> ctypes._CFuncPtr | None:
    """The compiled `layerflow_spin_word` (built on first use), or None where it cannot be built."""
    try:
        lib = ctypes.CDLL(str(build_library(SOURCE)))
    except (RuntimeError, OSError) as e:
        log.warning("no native spin for the done word (%s): polling it in Python, holding the GIL", e)
        return None
    fn = lib.layerflow_spin_word
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int32
    return fn


def spin_word(address: int, spins: int) -> bool:
    """Read the int32 at `address` up to `spins` times; whether it became non-zero."""
    native = native_spin()
    if native is not None:
        return bool(native(address, spins))
    word = ctypes.c_int32.from_address(address)
    return any(word.value for _ in range(spins))


class DoneWord:
    """The word of one bucket's buffers on `stream` (the stream their batches run on)."""

    def __init__(self, stream: int) -> None:
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._bits = self._word.numpy()
        self.address = self._word.data_ptr()
        self._stream = stream
        self._writer = NativePoster(stream)
        native_spin()   # built and loaded at set-up, never by a request

    def clear(self) -> None:
        """Before a batch is issued (the one before it was fetched: its word was read)."""
        self._bits[0] = 0

    def set_on(self, stream: int) -> None:
        """Queue the word's write on `stream` (under capture: a node of the graph), after the results' copy."""
        self._writer.write(stream, self.address, 1)

    def wait(self) -> None:
        """Until the word is set; TransferError if the stream went idle without setting it."""
        while not spin_word(self.address, SPINS):
            if cudart.stream_idle(self._stream) and not self._bits[0]:
                raise TransferError("the compute stream went idle without setting the results' done word")
