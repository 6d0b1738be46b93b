"""How a tier's moves become copy-engine calls, written once for the in-process tier and the transfer server.

Every move is one copy-engine call per layer group (`group_copies`). An onboarding (`OnboardCopies`) copies the users
read back from SSD or the remote store group by group as their blocks land (unsignalled: the layer signals cover the
whole batch), then every host-resident user in one call per layer group, signalled layer by layer; when every user was
read back, the layers are signalled once those copies are done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerflow.tier.base import NotResident
from layerflow.tier.host_cache import HostCache, Pinned
from layerflow.tier.layout import KVLayout
from layerflow.tier.ssd import Miss
from layerflow.transfer.copy_engine import CopyEngine, Transfer
from layerflow.transfer.errors import TransferError


class AllOf(Transfer):
    """Several transfers seen as one."""

    def __init__(self, transfers: Sequence[Transfer]) -> None:
        self.transfers = list(transfers)

    def done(self) -> bool:
        return all(t.done() for t in self.transfers)

    def wait(self, timeout: float | None = None) -> None:
        for t in self.transfers:
            t.wait(timeout)

    @property
    def error(self) -> BaseException | None:
        return next((t.error for t in self.transfers if t.error is not None), None)

    @property
    def issued(self) -> bool:
        return all(t.issued for t in self.transfers)

    def order_before(self, stream: int) -> None:
        for t in self.transfers:
            t.order_before(stream)


def drain(transfers: Sequence[Transfer], timeout: float | None) -> None:
    """Let transfers already in flight end (their errors were or will be reported elsewhere)."""
    for t in transfers:
        try:
            t.wait(timeout)
        except TransferError:
            pass


class GroupCopier:
    """One copy-engine call per layer group between a GPU pool's per-layer tensors and the host's block tensors."""

    def __init__(self, engine: CopyEngine, layout: KVLayout, gpu_layers: Sequence[torch.Tensor],
                 host_blocks: Sequence[torch.Tensor], timeout_s: float) -> None:
        self.engine, self.layout, self.timeout_s = engine, layout, timeout_s
        self._groups = [(list(gpu_layers[r.start:r.stop]), host_blocks[g], r.start)
                        for g, r in enumerate(layout.group_ranges)]

    def copy(self, gpu_pages: Sequence[int], blocks: Sequence[int], to_gpu: bool,
             signal=None) -> list[Transfer]:
        """Issue the pairs `(gpu_pages[i], blocks[i])` in every group; `signal` (onboarding only) is posted per layer.
        If an issue fails, the calls already issued are drained before the error propagates."""
        issued: list[Transfer] = []
        try:
            for layers, host, first_layer in self._groups:
                if to_gpu:
                    issued.append(self.engine.onboard(layers, host, gpu_pages, blocks, signal, first_layer))
                else:
                    issued.append(self.engine.offload(layers, host, gpu_pages, blocks))
        except BaseException:
            drain(issued, self.timeout_s)
            raise
        return issued


class OnboardCopies:
    """The copies of one onboarding of pinned users (see the module docstring). `run()` issues them (reading SSD and
    remote users back first, which blocks), `wait()` waits for them; an unusable SSD or remote copy fails `run()`
    with NotResident."""

    def __init__(self, cache: HostCache, copier: GroupCopier, pinned: Sequence[Pinned],
                 gpu_pages: Sequence[Sequence[int]], signal) -> None:
        self.cache, self.copier, self.signal = cache, copier, signal
        self.loads = list(zip(pinned, gpu_pages))
        self.transfers: list[Transfer] = []
        self.error: BaseException | None = None

    @property
    def from_ssd(self) -> bool:
        return any(p.from_ssd for p, _ in self.loads)

    @property
    def reads_back(self) -> bool:
        """Some user is read back from SSD or the remote store (`run()` blocks on that I/O)."""
        return any(p.reads_back for p, _ in self.loads)

    def run(self) -> None:
        try:
            host_pages: list[int] = []
            host_blocks: list[int] = []
            for pinned, pages in self.loads:
                if pinned.reads_back:
                    self._read_back(pinned, pages)
                else:
                    host_pages += pages
                    host_blocks += pinned.copied
            if host_pages:
                self.transfers += self.copier.copy(host_pages, host_blocks, True, self.signal)
            else:
                self._wait(self.transfers)
                for layer in range(self.signal.num_layers):
                    self.signal.complete_layer(layer)
        except BaseException as e:
            self.error = e
            self.signal.fail(e if isinstance(e, TransferError) else TransferError(str(e)))
            raise

    def _read_back(self, pinned: Pinned, pages: Sequence[int]) -> None:
        page_of = dict(zip(pinned.copied, pages))
        issued: list[Transfer] = []

        def landed(blocks: list[int]) -> None:
            wanted = [b for b in blocks if b in page_of]
            if wanted:
                issued.extend(self.copier.copy([page_of[b] for b in wanted], wanted, True))

        try:
            self.cache.read_back(pinned, on_group=landed)
        except Miss as e:
            raise NotResident([pinned.user], f"its {pinned.source.value} copy is unusable: {e.args[0]}") from e
        finally:
            self.transfers += issued
        self._wait(issued)

    def _wait(self, transfers: Sequence[Transfer]) -> None:
        for t in transfers:
            t.wait(self.copier.timeout_s)

    def wait(self) -> None:
        """Every copy landed; raises the first failure (kept in `error`)."""
        try:
            self._wait(self.transfers)
        except BaseException as e:
            self.error = self.error or e
            raise
        if self.error is not None:
            raise TransferError(str(self.error)) from self.error

    def settle(self) -> bool:
        """Wait (bounded by the timeout) for every copy, ignoring failures; True if the onboarding succeeded."""
        drain(self.transfers, self.copier.timeout_s)
        return self.succeeded()

    def done(self) -> bool:
        """No copy of this onboarding is in flight any more."""
        return all(t.done() for t in self.transfers)

    def succeeded(self) -> bool:
        return self.done() and self.error is None and all(t.error is None for t in self.transfers)

