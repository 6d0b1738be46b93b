"""The scheduler's two batch states: prepared (KV placed, onboarding issued) and in flight (launched on the device).

A launched batch answers "has the device finished it?" without blocking (a CUDA event recorded right after its
launch), so the scheduler can keep admitting and preparing while a batch computes instead of sleeping in
`Engine.collect`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from layerflow.runtime.engine import Flight
from layerflow.runtime.kv_manager import BatchPlan
from layerflow.serving.queue import Pending


class DeviceMark:
    """The work enqueued so far on `stream` (the launched batch's: `BatchBuffers.stream`). None: the CPU, where the
    engine's steps run synchronously, so the mark is reached as soon as it is made."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._event: torch.cuda.Event | None = None
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def reached(self) -> bool:
        return self._event is None or self._event.query()


@dataclass
class Prepared:
    """A batch prepared by `Engine.prepare`: its plan, its requests, when it was prepared and its onboarded bytes."""

    plan: BatchPlan
    batch: list[Pending]
    onboard_bytes: int
    started: float = field(default_factory=time.monotonic)

    def onboards(self) -> bool:
        """It copies KV from host or SSD: its copies occupy the copy engine until its layers have landed."""
        return self.plan.onboarding is not None


@dataclass
class InFlight:
    """A launched batch and the mark of its launch on the device."""

    flight: Flight
    prepared: Prepared
    mark: DeviceMark

    def computed(self) -> bool:
        """The device finished the batch: `Engine.collect` will not wait for it."""
        return self.mark.reached()
