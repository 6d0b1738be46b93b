"""Holds a batch's offload copies on the GPU until the host has the batch's results.

Why: the offload of a batch's new pages is issued right after the launch (its host cost overlaps the block), so its
device-to-host copy starts the moment the block ends, exactly when the host waits to see that end; its PCIe traffic
may delay that view (the fetch's wake). A gated offload's copy stream first waits (cuStreamWaitValue32, cyclic int32
GEQ, so wrap-around is harmless) for a device word to reach the gate's epoch; `open` writes the epoch on a stream of
the gate's own. `close` (at a launch) starts a new epoch, `open` (once the results are in) ends it; a host wait on a
gated transfer opens the gate first, so nothing can block on a copy the host holds back.

$LAYERFLOW_OFFLOAD_GATE (`off`, the default until the H200 A/B, or `on`) picks whether a CUDA copy engine has one.
"""

from __future__ import annotations

import os
import threading

import torch
from cuda.bindings import driver

from layerflow.transfer import cuda_api
from layerflow.transfer.cuda_api import check
from layerflow.transfer.signals.native_post import NativePoster

GATE_ENV = "LAYERFLOW_OFFLOAD_GATE"
GATE_SETTINGS = ("off", "on")
_MASK = 0xFFFFFFFF


def configured_gate() -> bool:
    """$LAYERFLOW_OFFLOAD_GATE (one of GATE_SETTINGS, any case; default off) as a bool; ValueError naming another."""
    value = os.environ.get(GATE_ENV, GATE_SETTINGS[0]).strip().lower()
    if value not in GATE_SETTINGS:
        raise ValueError(f"{GATE_ENV}={value!r}: expected one of {list(GATE_SETTINGS)}")
    return value == "on"


class OffloadGate:
    """One device word and the epochs of `close` / `open` on `device` (see the module docstring)."""

    def __init__(self, device: int) -> None:
        self._word = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", device))
        self._address = self._word.data_ptr()
        self._stream = cuda_api.create_stream()
        self._writer = NativePoster(self._stream)
        self._lock = threading.Lock()
        self._closed = 0   # the epoch offloads issued now wait for
        self._opened = 0   # the last epoch written

    def close(self) -> None:
        """Offloads issued from now on wait for the next `open` (a gate already closed stays on its epoch)."""
        with self._lock:
            if self._closed == self._opened:
                self._closed += 1

    def hold(self, stream: int) -> None:
        """While closed: make `stream`'s next work wait for the open of the current epoch (nothing while open)."""
        with self._lock:
            if self._closed == self._opened:
                return
            epoch = self._closed & _MASK
        check(driver.cuStreamWaitValue32(stream, self._address, epoch,
                                         driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32")

    def open(self) -> None:
        """Let every held offload go (nothing while open)."""
        with self._lock:
            if self._opened == self._closed:
                return
            self._opened = self._closed
            epoch = self._opened & _MASK
        self._writer.write(self._stream, self._address, epoch)

    def release(self) -> None:
        """Open, let the write land and destroy the gate's stream (the engine's close)."""
        self.open()
        check(driver.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        cuda_api.destroy_stream(self._stream)
