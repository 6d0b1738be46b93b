"""`event` signals: a CUDA event per (counter, layer) recorded after the layer's copies; GPU waits are stream waits.

Graph capture: besides its counter's event, every onboarding re-records one shared event per layer. A captured graph
waits on those with `cudaStreamWaitEvent(..., cudaEventWaitExternal)` (an external event wait node), which waits for
the event's most recent record. All onboardings are issued in order on the engine's one H2D stream, so whether that
record is resolved at launch or when the node runs, it is this onboarding's layer or a later onboarding's (which
completes after it): never too early, at worst conservative. `prepare_replay(handle)` only checks on the host that `handle`'s records were issued before the launch.
"""

from __future__ import annotations

import time

from layerflow.transfer import cuda_api
from layerflow.config import SignalMode
from layerflow.transfer.cuda_api import poll_until, require_cuda
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import LayerSignals, SignalHandle


class EventSignals(LayerSignals):
    mode = SignalMode.EVENT
    waits_before_posts = False   # a replay's waits need every layer's record issued before its launch

    def __init__(self, num_layers: int, num_counters: int = 4, timeout_s: float = 10.0) -> None:
        require_cuda("signal mode 'event'")
        super().__init__(num_layers, num_counters, timeout_s)
        self._events = [[cuda_api.create_event() for _ in range(num_layers)] for _ in range(num_counters)]
        self._capture = [cuda_api.create_event() for _ in range(num_layers)]

    def capture_gpu_wait(self, layer: int, stream: int) -> None:
        self._check_layer(layer)
        cuda_api.stream_wait(stream, self._capture[layer], external=True)

    def prepare_replay(self, handle: SignalHandle | None, stream: int) -> None:
        if handle is None:
            return
        deadline = time.monotonic() + self.timeout_s
        for layer in range(self.num_layers):
            if not self._wait_posted(handle, layer, deadline):
                raise TransferError(f"layer {layer} of signal counter {handle.counter_id} not issued before replay")

    def close(self) -> None:
        for event in [e for row in self._events for e in row] + self._capture:
            cuda_api.destroy_event(event)
        self._events, self._capture = [], []

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers})")

    def _signal(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        if stream is None:
            raise TransferError("signal mode 'event' needs copies issued on a CUDA stream (CudaCopyEngine)")
        for layer in layers:
            cuda_api.record(self._events[handle.counter_id][layer], stream)
            cuda_api.record(self._capture[layer], stream)

    def _poison(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        if stream is not None:
            self._signal(handle, layers, stream)

    def _host_wait(self, handle: SignalHandle, layer: int, deadline: float) -> bool:
        if not self._wait_posted(handle, layer, deadline):
            return False
        if self.status[handle.counter_id] != 0:
            return True
        event = self._events[handle.counter_id][layer]
        try:
            return poll_until(lambda: cuda_api.query(event), deadline)
        except TransferError as exc:
            raise TransferError(f"layer {layer} of signal counter {handle.counter_id}: {exc}") from exc

    def _gpu_wait(self, handle: SignalHandle, layer: int, stream: int) -> None:
        if not self._wait_posted(handle, layer, time.monotonic() + self.timeout_s):
            raise TransferError(f"layer {layer} of signal counter {handle.counter_id} never issued")
        cuda_api.stream_wait(stream, self._events[handle.counter_id][layer])
