"""Fault injection for tests: the production copy engines with a layer that fails, or a callback before each copy.

Both attributes may be set after construction, between transfers (`copier.fail_at_layer = 1`). With
`fail_at_layer = l` a transfer copies and signals the layers before l, does not copy layer l, and fails with
TransferError("injected failure at layer l"), which also poisons its signal; an offload fails the same way.
"""

from __future__ import annotations

from typing import Callable

from layerflow.transfer.copy_engine import CopyJob, LayerAddresses
from layerflow.transfer.copy_plan import Run
from layerflow.transfer.cuda_copy import CopyPath, CudaCopyEngine
from layerflow.transfer.errors import TransferError
from layerflow.transfer.thread_copy import ThreadCopyEngine


def fail_if_injected(fail_at_layer: int | None, layer: int) -> None:
    if layer == fail_at_layer:
        raise TransferError(f"injected failure at layer {layer}")


class FaultyThreadCopyEngine(ThreadCopyEngine):
    """`before_layer(l)` runs on the copy worker ("layerflow-h2d" or "layerflow-d2h") before layer l's copy, in both
    directions (tests slow, hold or break copies with it); then `fail_at_layer` is checked."""

    def __init__(self, fail_at_layer: int | None = None,
                 before_layer: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.fail_at_layer = fail_at_layer
        self.before_layer = before_layer

    def _copy_layer(self, job: CopyJob, layer: int, to_gpu: bool) -> None:
        if self.before_layer is not None:
            self.before_layer(layer)
        fail_if_injected(self.fail_at_layer, layer)
        super()._copy_layer(job, layer, to_gpu)


class FaultyCudaCopyEngine(CudaCopyEngine):
    """Issuing layer `fail_at_layer` raises instead of queueing its copies (the earlier layers are queued and
    signalled on the stream as usual)."""

    def __init__(self, fail_at_layer: int | None = None, path: CopyPath = CopyPath.AUTO,
                 device: int | None = None) -> None:
        super().__init__(path=path, device=device)
        self.fail_at_layer = fail_at_layer

    def _layer_copier(self, job: CopyJob, stream: int, to_gpu: bool) -> Callable[[int], None]:
        copy_layer = super()._layer_copier(job, stream, to_gpu)

        return self._unless_injected(copy_layer)

    def _run_copier(self, addresses: LayerAddresses, run: Run, stream: int) -> Callable[[int], None]:
        return self._unless_injected(super()._run_copier(addresses, run, stream))

    def _unless_injected(self, copy_layer: Callable[[int], None]) -> Callable[[int], None]:
        def copy_unless_injected(layer: int) -> None:
            fail_if_injected(self.fail_at_layer, layer)
            copy_layer(layer)

        return copy_unless_injected
