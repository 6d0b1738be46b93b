"""How a layer of the pipeline waits for its KV: one interface, one implementation per wait-node variant.

A wait is emitted into the stream once per layer (under capture it becomes a node of the graph); `bind` aims the
waits at one onboarding before every run, and `check` raises the onboarding's error after it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from layerflow.runtime import hostfn
from layerflow.transfer import cudart
from layerflow.config import SignalMode
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import LayerSignals, SignalHandle


def _stream_handle() -> int:
    return torch.cuda.current_stream().cuda_stream


class LayerWait(ABC):
    """Emitted before layer l's KV append; bound to the batch's onboarding before each run."""

    def bind(self, handle: SignalHandle | None) -> None:
        """Aim the next run's waits at `handle`'s onboarding."""

    @abstractmethod
    def layer(self, layer: int) -> None:
        """Make what follows in the stream wait until layer `layer`'s KV has landed."""

    def check(self) -> None:
        """After the run completed: raise TransferError if a wait failed."""


class NoWait(LayerWait):
    """Every user's KV is already on the GPU: no wait node at all."""

    def layer(self, layer: int) -> None:
        pass


class HostWait(LayerWait):
    """Eager pipelines (the CPU path): block the issuing thread on the layer's signal. One deadline covers the whole
    onboarding (a hung producer costs one timeout per batch, not one per layer)."""

    def __init__(self) -> None:
        self._handle: SignalHandle | None = None
        self._deadline = 0.0

    def bind(self, handle: SignalHandle | None) -> None:
        self._handle = handle
        if handle is not None:
            self._deadline = time.monotonic() + handle.ring.timeout_s

    def layer(self, layer: int) -> None:
        if self._handle is not None:
            self._handle.wait_layer(layer, max(0.0, self._deadline - time.monotonic()))


class EventfdNodeWait(LayerWait):
    """A native host function per layer reading the layer's eventfd (never the GIL; times out rather than hang)."""

    def __init__(self, num_layers: int, timeout_s: float):
        # Build the shim and load the runtime now, at set-up: never for the first time inside a graph capture.
        hostfn.eventfd_wait_address()
        cudart.lib()
        self.slots = hostfn.WaitSlots(num_layers)
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._handle: SignalHandle | None = None

    def bind(self, handle: SignalHandle | None) -> None:
        self._handle = handle
        poison = 0 if handle is None else handle.status_address
        for layer in range(self.slots.num_layers):
            fd = -1 if handle is None else handle.eventfd(layer)
            self.slots.set(layer, fd, self.timeout_ms, poison)
        self.slots.reset()

    def layer(self, layer: int) -> None:
        hostfn.launch_eventfd_wait(_stream_handle(), self.slots.address(layer))

    def check(self) -> None:
        if self._handle is None:
            return
        for layer in range(self.slots.num_layers):
            status = self.slots.status(layer)
            if status != hostfn.WaitStatus.OK:
                error = self._handle.error
                raise TransferError(f"layer {layer} wait of signal counter {self._handle.counter_id} ended "
                                    f"{status.name}" + (f": {error}" if error else "")) from error


class GpuSignalWait(LayerWait):
    """A device-side wait (CUDA event or stream wait-value), re-targeted through the ring before each replay."""

    def __init__(self, signals: LayerSignals):
        self.signals = signals
        self._handle: SignalHandle | None = None

    def bind(self, handle: SignalHandle | None) -> None:
        self._handle = handle
        self.signals.prepare_replay(handle, _stream_handle())

    def layer(self, layer: int) -> None:
        stream = _stream_handle()
        if torch.cuda.is_current_stream_capturing():
            self.signals.capture_gpu_wait(layer, stream)
        elif self._handle is not None:
            self._handle.gpu_wait_layer(layer, stream)

    def check(self) -> None:
        if self._handle is not None and self._handle.error is not None:
            raise TransferError(f"onboarding on signal counter {self._handle.counter_id} failed: "
                                f"{self._handle.error}") from self._handle.error


def make_layer_wait(signals: LayerSignals, device: torch.device, timeout_s: float) -> LayerWait:
    """The wait a graph layer uses for `signals`' mode: a native eventfd host node, or a GPU-side wait on the ring;
    eager CPU pipelines block the issuing thread instead."""
    if device.type != "cuda":
        return HostWait()
    if signals.mode is SignalMode.EVENTFD:
        return EventfdNodeWait(signals.num_layers, timeout_s)
    return GpuSignalWait(signals)
