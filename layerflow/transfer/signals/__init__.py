"""Per-layer signals: pick the implementation the config's `signal` names.

| mode | posted by | host wait | GPU wait | in a captured graph |
|---|---|---|---|---|
| eventfd | CPU copy thread, or a notifier thread after the layer's CUDA event | poll the fd | - | native host node reads `handle.eventfd(l)` |
| event | cudaEventRecord on the copy stream | cudaEventQuery | cudaStreamWaitEvent | external event wait node |
| waitvalue | a stream write (epoch) on the ring's posting stream, after an event on the copy stream | poll the pinned word | cuStreamWaitValue32 GEQ | wait kernel, target set by `prepare_replay` |
"""

from __future__ import annotations

from typing import Callable

from layerflow.config import SignalMode
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.event import EventSignals
from layerflow.transfer.signals.eventfd import EventfdSignals
from layerflow.transfer.signals.base import LayerSignals, SignalHandle
from layerflow.transfer.signals.waitvalue import WaitValueSignals

SIGNALS: dict[SignalMode, Callable[..., LayerSignals]] = {
    SignalMode.EVENTFD: EventfdSignals,
    SignalMode.EVENT: EventSignals,
    SignalMode.WAITVALUE: WaitValueSignals,
}


def make_signals(mode: SignalMode, num_layers: int, num_counters: int = 4, timeout_s: float = 10.0) -> LayerSignals:
    """The ring for `mode`; CUDA-only modes raise TransferError on a machine without a GPU."""
    if not isinstance(mode, SignalMode):
        raise ValueError(f"mode={mode!r}: expected a SignalMode")
    if mode not in SIGNALS:
        raise ValueError(f"mode={mode.value!r} is a choice, not a signal: resolve it first "
                         f"(layerflow.runtime.tiers.resolve_signal)")
    return SIGNALS[mode](num_layers, num_counters, timeout_s)


__all__ = ["SIGNALS", "EventSignals", "EventfdSignals", "LayerSignals", "SignalHandle", "SignalMode", "TransferError",
           "WaitValueSignals", "make_signals"]
