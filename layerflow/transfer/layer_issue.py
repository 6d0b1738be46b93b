"""One transfer's per-layer issue loop, which an onboarding may run in two parts: a lead of its first layers when it
is asked for, the rest when the caller says the time is right (`CudaCopyEngine.issue_deferred`).

Why: at batch size 1 the caller's thread issues a host hit's copies before it packs, fills and launches the batch,
and each layer's copy call and signal post cost it ~15-20 us on the H200's host, so the graph was launched ~0.1 ms
after the first copy left. Where the copies are short (fp8 pages at 2K), that launch, not the copies, bounded the
request. Issuing only as many layers as keep the copy engine busy across the launch (`lead_layers`), and the rest
right after it, moves the launch earlier by the rest's issue time while the copy engine never waits for a layer.

What holds: layers are issued in order, each followed by its signal post; a transfer's completion event is recorded
after its last layer; what fails while issuing poisons the signal from that layer on and is reported by the transfer.
"""

from __future__ import annotations

import math
from typing import Callable

from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import SignalHandle


def lead_layers(num_layers: int, layer_bytes: int, lead_bytes: int | None) -> int:
    """How many of `num_layers` layers of `layer_bytes` each to issue first: enough to hold `lead_bytes` of copies
    (at least one), or all of them when `lead_bytes` is None."""
    if lead_bytes is None or layer_bytes <= 0:
        return num_layers
    return max(1, min(num_layers, math.ceil(lead_bytes / layer_bytes)))


class LayerIssue:
    """Issues layers `0 .. num_layers - 1` with `copy_layer(l)` then `signal.complete_layer(first_layer + l, stream)`;
    `finish(error)` runs once, after the last layer or a failure (None: no failure)."""

    def __init__(self, copy_layer: Callable[[int], None], num_layers: int, signal: SignalHandle | None,
                 first_layer: int, stream: int, finish: Callable[[TransferError | None], None]) -> None:
        self._copy_layer, self._num_layers, self._signal = copy_layer, num_layers, signal
        self._first_layer, self._stream, self._finish = first_layer, stream, finish
        self.next_layer = 0

    @property
    def done(self) -> bool:
        return self.next_layer >= self._num_layers

    def issue(self, until: int) -> None:
        """Issue the layers up to `until` (exclusive); after the last layer, or a failure, `finish` is called (once)."""
        if self.done:
            return
        layer = self.next_layer
        try:
            for layer in range(self.next_layer, min(until, self._num_layers)):
                self._copy_layer(layer)
                if self._signal is not None:
                    self._signal.complete_layer(self._first_layer + layer, self._stream)
                self.next_layer = layer + 1
        except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters, whatever raised it
            error = exc if isinstance(exc, TransferError) else TransferError(f"issuing layer {layer} failed: {exc!r}")
            if self._signal is not None:
                self._signal.fail(error, self._stream)
            self.next_layer = self._num_layers
            self._finish(error)
            return
        if self.done:
            self._finish(None)
