"""`BenchCopyEngine`: the inference benchmark's stand-in for the engine's copy engine, recording what it onboards.

It wraps any CopyEngine through the public methods the tier calls (`onboard`, `offload`, `close`): it keeps every
onboarding since `forget()` (its arguments, so the same pages can be onboarded again alone, and its transfer) and,
while `skip_offloads` is set (`--only-onboard`), answers offloads with a transfer that is already done, copying nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from layerflow.transfer.copy_engine import CopyEngine, Transfer
from layerflow.transfer.signals.base import SignalHandle

Indices = Sequence[int] | np.ndarray


class Onboarding(NamedTuple):
    """The arguments of one onboarding, less its signal: what it takes to issue the same copies again (a tuple: it is
    built inside the timed request, right after the copies were issued)."""

    gpu_layers: tuple[torch.Tensor, ...]
    host: torch.Tensor
    gpu_pages: Indices
    host_blocks: Indices
    first_layer: int

    @property
    def nbytes(self) -> int:
        layer = self.gpu_layers[0]
        return len(self.gpu_pages) * len(self.gpu_layers) * layer[0].numel() * layer.element_size()

    def issue(self, engine: CopyEngine) -> Transfer:
        """The same pages onboarded again by `engine`, alone (no signal)."""
        return engine.onboard(self.gpu_layers, self.host, self.gpu_pages, self.host_blocks,
                              first_layer=self.first_layer)


class _Skipped(Transfer):
    """An offload that was not issued (`--only-onboard`): done at once, with no error."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass


class BenchCopyEngine:
    """Delegates to `inner`; `onboardings` and `transfers` hold every onboarding since `forget()`, in order.

    The tier hands each call index lists of its own, so keeping them (not copying them) records the call as made.
    """

    def __init__(self, inner: CopyEngine) -> None:
        self.inner = inner
        self.skip_offloads = False
        self.onboardings: list[Onboarding] = []
        self.transfers: list[Transfer] = []

    def forget(self) -> None:
        self.onboardings, self.transfers = [], []

    def onboard(self, gpu_layers: Sequence[torch.Tensor], host: torch.Tensor, gpu_pages: Indices,
                host_blocks: Indices, signal: SignalHandle | None = None, first_layer: int = 0) -> Transfer:
        transfer = self.inner.onboard(gpu_layers, host, gpu_pages, host_blocks, signal, first_layer)
        self.onboardings.append(Onboarding(tuple(gpu_layers), host, gpu_pages, host_blocks, first_layer))
        self.transfers.append(transfer)
        return transfer

    def offload(self, gpu_layers: Sequence[torch.Tensor], host: torch.Tensor, gpu_pages: Indices,
                host_blocks: Indices) -> Transfer:
        if self.skip_offloads:
            return _Skipped()
        return self.inner.offload(gpu_layers, host, gpu_pages, host_blocks)

    @property
    def inline(self) -> bool:
        return self.inner.inline

    @inline.setter
    def inline(self, value: bool) -> None:
        self.inner.inline = value

    def issue_deferred(self) -> None:
        self.inner.issue_deferred()

    def order_onboards_after(self, transfers: Sequence[Transfer]) -> None:
        self.inner.order_onboards_after(transfers)

    def close(self) -> None:
        self.inner.close()
