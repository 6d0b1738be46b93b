"""The copy-engine seam: onboarding (host -> GPU, layer by layer, signalled) and offload (GPU -> host, whole).

An engine knows tensors and index lists only, never the pools. Data layout (one layer group):
- GPU: one tensor per layer, `[num_pages, 2, page_size, H, D]` (the layers need not be adjacent in memory);
- host: block-first `[num_blocks, num_layers, 2, page_size, H, D]`, so the pitch from block i to i+1 within one layer
  is `num_layers * layer_page_bytes`.
A transfer moves the pairs `(gpu_pages[i], host_blocks[i])`; the engines split them into runs contiguous on both sides
(`copy_plan`). Several layer groups are several calls, each with its `first_layer` (the global index of its layer 0).

An onboarding whose placement is one run on both sides (a host-resident user's common case) is checked with plain
ints and issued through `_onboard_run` without a numpy plan, so its first copy leaves sooner (on the H200 a 2K bf16
host hit gained ~0.08 ms); any other placement, and every offload, is validated into a CopyJob and issued from it.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from layerflow.transfer.copy_plan import CopyPlan, Run, plan_runs, single_run
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import SignalHandle


class Transfer(ABC):
    """One submitted transfer: completion is observable without blocking, and an error is kept, not lost."""

    error: BaseException | None = None

    @abstractmethod
    def done(self) -> bool:
        """True once the copies finished or failed (then `error` is set)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise TransferError on failure or when `timeout` seconds pass first."""

    @property
    def issued(self) -> bool:
        """Its copies were handed to the device (a transfer queued on an issue thread may not be yet)."""
        return True

    def order_before(self, stream: int) -> None:
        """Work queued on CUDA stream `stream` (a raw handle) after this call runs after this transfer's copies.
        This default blocks the caller until the transfer ended, which is right for any engine (the CPU path's
        workers need it); a CUDA transfer makes the stream wait on the device instead. A failure is not raised here:
        the transfer's own waiters see it."""
        try:
            self.wait()
        except TransferError:
            pass


@dataclass(frozen=True)
class LayerAddresses:
    """The addresses of one checked layout, taken with its check (`CopyEngine._layout`), so a transfer does not ask
    every layer tensor for its pointer: each GPU layer's base, each layer's first byte in the host block tensor, the
    bytes of one layer's page, the host pitch from one block to the next and the GPU pages every layer has."""

    gpu_bases: tuple[int, ...]
    host_layers: tuple[int, ...]
    page_bytes: int
    block_pitch: int
    gpu_pages: int

    @classmethod
    def of(cls, gpu_layers: tuple[torch.Tensor, ...], host: torch.Tensor) -> LayerAddresses:
        """The addresses of a layout `check_layout` accepted."""
        layer = gpu_layers[0]   # contiguous (check_layout): a page is one stride of its first dimension
        page = layer.stride(0) * layer.element_size()
        host_base = host.data_ptr()
        return cls(tuple(t.data_ptr() for t in gpu_layers), tuple(host_base + i * page for i in range(len(gpu_layers))),
                   page, len(gpu_layers) * page, min(t.shape[0] for t in gpu_layers))


@dataclass(frozen=True)
class CopyJob:
    """A validated transfer: what the concrete engines execute."""

    gpu_layers: tuple[torch.Tensor, ...]
    host: torch.Tensor
    plan: CopyPlan
    signal: SignalHandle | None
    first_layer: int
    addresses: LayerAddresses

    @property
    def num_layers(self) -> int:
        return len(self.gpu_layers)


def check_layout(gpu_layers: tuple[torch.Tensor, ...], host: torch.Tensor) -> None:
    """The GPU layer tensors and the host block tensor describe the same pages (shapes, dtype, contiguity)."""
    if not gpu_layers:
        raise ValueError("gpu_layers: empty")
    if host.dim() != 6 or host.shape[1] != len(gpu_layers):
        raise ValueError(f"host: expected [num_blocks, {len(gpu_layers)}, 2, page, H, D], got {tuple(host.shape)}")
    if not host.is_contiguous():
        raise ValueError("host: must be contiguous (block-first layout)")
    for i, layer in enumerate(gpu_layers):
        if layer.dim() != 5 or tuple(layer.shape[1:]) != tuple(host.shape[2:]) or layer.dtype != host.dtype:
            raise ValueError(f"gpu_layers[{i}]: shape {tuple(layer.shape)} {layer.dtype} does not match host pages "
                             f"{tuple(host.shape[2:])} {host.dtype}")
        if not layer.is_contiguous():
            raise ValueError(f"gpu_layers[{i}]: must be contiguous")


def make_job(gpu_layers: tuple[torch.Tensor, ...], host: torch.Tensor, addresses: LayerAddresses,
             gpu_pages: Sequence[int] | np.ndarray, host_blocks: Sequence[int] | np.ndarray,
             signal: SignalHandle | None, first_layer: int, unique_gpu: bool) -> CopyJob:
    """Check index bounds once (the layout is checked by `check_layout`), so a bad call fails here, not in a copy."""
    plan = plan_runs(gpu_pages, host_blocks)
    if plan.num_pages:
        # Every check works on the runs, not the pages: a contiguous user is one run, so this is O(1) for it.
        check_bounds(addresses, host, _last_index(plan.run_gpu, plan.run_len),
                     _last_index(plan.run_host, plan.run_len))
        starts = plan.run_gpu if unique_gpu else plan.run_host
        if _runs_overlap(starts, plan.run_len):
            raise ValueError(f"{'gpu_pages' if unique_gpu else 'host_blocks'}: a destination appears twice")
    check_signal_layers(signal, first_layer, len(gpu_layers))
    return CopyJob(gpu_layers, host, plan, signal, first_layer, addresses)


def check_bounds(addresses: LayerAddresses, host: torch.Tensor, gpu_max: int, host_max: int) -> None:
    """The largest GPU page and host block a transfer names exist in the layout."""
    if gpu_max >= addresses.gpu_pages:
        raise ValueError(f"gpu_pages: index {gpu_max} out of range [0, {addresses.gpu_pages})")
    if host_max >= host.shape[0]:
        raise ValueError(f"host_blocks: index {host_max} out of range [0, {host.shape[0]})")


def check_signal_layers(signal: SignalHandle | None, first_layer: int, num_layers: int) -> None:
    """Layers `first_layer` .. `first_layer + num_layers - 1` are layers of `signal` (when there is one)."""
    if signal is not None and (first_layer < 0 or first_layer + num_layers > signal.num_layers):
        raise ValueError(f"first_layer={first_layer}: layers {first_layer}..{first_layer + num_layers - 1} "
                         f"exceed the signal's {signal.num_layers} layers")


def _last_index(starts: np.ndarray, lengths: np.ndarray) -> int:
    """The largest index the runs [start, start + length) cover (plain int arithmetic for the common single run)."""
    if starts.size == 1:
        return int(starts[0]) + int(lengths[0]) - 1
    return int((starts + lengths).max()) - 1


def _runs_overlap(starts: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether any two runs [start, start + length) share an index."""
    if starts.size < 2:
        return False
    order = np.argsort(starts, kind="stable")
    ends = (starts + lengths)[order]
    return bool((starts[order][1:] < ends[:-1]).any())


class CopyEngine(ABC):
    """Moves KV pages between the GPU pool tensors and the host block tensor. `inline`, set by the caller before a
    batch (`Engine.score`'s own, nothing in flight): it launches the batch right after its onboarding and collects it
    next, so an engine that hands its copies to another thread issues the batch's on the caller's instead where it
    can (transfer/issue_thread.py); the others ignore it."""

    inline = False

    def __init__(self) -> None:
        self._checked: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], LayerAddresses]] = {}

    def _layout(self, gpu_layers: Sequence[torch.Tensor],
                host: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], LayerAddresses]:
        """`check_layout` and the layout's addresses once per set of tensors: callers pass the same pool tensors on
        every transfer.

        The memo holds weak references (a departed transfer-server client's pool must not stay mapped because of
        it); an entry counts only while every tensor it names is alive and is the one with that id.
        """
        layers = tuple(gpu_layers)
        key = (id(host), *map(id, layers))
        entry = self._checked.get(key)
        if entry is None or any(ref() is not t for ref, t in zip(entry[0], (host, *layers))):
            check_layout(layers, host)
            if len(self._checked) >= 8:
                self._checked.clear()
            entry = self._checked[key] = (tuple(weakref.ref(t) for t in (host, *layers)),
                                          LayerAddresses.of(layers, host))
        return layers, entry[1]

    def onboard(self, gpu_layers: Sequence[torch.Tensor], host: torch.Tensor, gpu_pages: Sequence[int] | np.ndarray,
                host_blocks: Sequence[int] | np.ndarray, signal: SignalHandle | None = None,
                first_layer: int = 0) -> Transfer:
        """Host -> GPU, layer by layer: every run of layer 0, signal layer 0, then layer 1, ...

        `signal` (from `LayerSignals.acquire`) is posted per layer as `first_layer + l`; on failure it is poisoned.
        """
        layers, addresses = self._layout(gpu_layers, host)
        run = single_run(gpu_pages, host_blocks)
        if run is not None:
            check_bounds(addresses, host, run.gpu_page + run.pages - 1, run.host_block + run.pages - 1)
            check_signal_layers(signal, first_layer, len(layers))
            return self._onboard_run(layers, host, addresses, run, signal, first_layer)
        job = make_job(layers, host, addresses, gpu_pages, host_blocks, signal, first_layer, unique_gpu=True)
        return self._onboard(job)

    def offload(self, gpu_layers: Sequence[torch.Tensor], host: torch.Tensor, gpu_pages: Sequence[int] | np.ndarray,
                host_blocks: Sequence[int] | np.ndarray) -> Transfer:
        """GPU -> host, all layers, asynchronously; the host blocks are valid once the Transfer is done."""
        layers, addresses = self._layout(gpu_layers, host)
        job = make_job(layers, host, addresses, gpu_pages, host_blocks, None, 0, unique_gpu=False)
        return self._offload(job)

    def _onboard_run(self, gpu_layers: tuple[torch.Tensor, ...], host: torch.Tensor, addresses: LayerAddresses,
                     run: Run, signal: SignalHandle | None, first_layer: int) -> Transfer:
        """An onboarding of one run, already checked. This default issues it as a job; an engine overrides it where a
        run can be issued without one."""
        return self._onboard(CopyJob(gpu_layers, host, run.plan(), signal, first_layer, addresses))

    def issue_deferred(self) -> None:
        """Issue what an onboarding left for later (an engine that issues a lead of layers first, cuda_copy.py): the
        caller calls it once the work it wanted to start first (its batch's launch) is issued; the default has
        nothing deferred."""

    def order_onboards_after(self, transfers: Sequence[Transfer]) -> None:
        """Onboardings asked for after this call start only once `transfers` ended: an offload still reading GPU
        pages that an onboarding is about to overwrite (their user was evicted while its offload was in flight), or
        writing the host blocks it reads. This default waits on the caller's thread; an engine with streams or
        workers of its own orders on them instead, and the caller goes on."""
        for t in transfers:
            Transfer.order_before(t, 0)

    @abstractmethod
    def _onboard(self, job: CopyJob) -> Transfer: ...

    @abstractmethod
    def _offload(self, job: CopyJob) -> Transfer: ...

    @abstractmethod
    def close(self) -> None:
        """Stop workers and release streams; pending transfers finish first."""
