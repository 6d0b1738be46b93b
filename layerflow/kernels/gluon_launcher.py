"""The launch interface every Gluon attention kernel offers PagedAttention: the `tl` kernel's (`launcher[grid](*args,
**constexprs)`), so PagedAttention swaps one kernel for another in a single call; and the one rule by which a
kernel choice ("auto" / "gluon") turns into a launcher or into the `tl` kernel; and the rules every Gluon kernel's
shape check shares (each message names the kernel)."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable

import torch

HEAD_DIMS = (64, 128, 256)
QUERY_BLOCKS = (64, 128)


class GluonLauncher(ABC):
    """A Gluon kernel behind the `tl` kernel's launch interface, with its tiling checked at construction.
    `row_splits`: whether the kernel takes the "rows" split rule's table (layerflow.kernels.splits)."""

    row_splits = False

    def __init__(self, tiling) -> None:
        reason = self.tiling_reason(tiling)
        if reason is not None:
            raise ValueError(reason)
        self.tiling = tiling

    @staticmethod
    @abstractmethod
    def tiling_reason(tiling) -> str | None:
        """What is wrong with `tiling` on any shape (None when nothing is)."""

    def wave_fill(self, block_m: int) -> float:
        """The share of one wave's SMs the "rows" rule's split count fills at `block_m` query rows
        (splits.fill_splits; 1: the whole wave)."""
        return 1.0

    def __getitem__(self, grid: tuple[int, int, int]) -> Callable[..., None]:
        return functools.partial(self._launch, grid)

    @abstractmethod
    def _launch(self, grid: tuple[int, int, int], *args, **constexprs) -> None:
        """Launch over `grid` with exactly what `_paged_attention_kernel[grid]` takes."""


def chosen(choice: str, reason: str | None, launcher: Callable[[], GluonLauncher],
           auto_takes: bool = True) -> GluonLauncher | None:
    """`launcher()` when the kernel can run (`reason` None) and "gluon" insists or "auto" takes it (`auto_takes`);
    ValueError naming `reason` when "gluon" insists on a kernel that cannot run; else None (the `tl` kernel)."""
    if reason is None and (choice == "gluon" or auto_takes):
        return launcher()
    if reason is not None and choice == "gluon":
        raise ValueError(f"kernel='gluon': {reason}")
    return None


def registers_reason(tiling) -> str | None:
    """A loader register count (`tiling.producer_registers`) setmaxnreg cannot take."""
    if tiling.producer_registers % 8 or not 24 <= tiling.producer_registers <= 256:
        return f"{tiling}: producer_registers must be a multiple of 8 in [24, 256]"
    return None


def mask_reason(kernel: str, window: int, contextual: int) -> str | None:
    """A mask option the Gluon kernels do not compute (they serve the default mask)."""
    if window or contextual:
        return f"max_attn_len={window}, contextual_len={contextual}: {kernel} serves the default mask only"
    return None


def shape_reason(kernel: str, block_m: int, head_dim: int) -> str | None:
    """A query block or head dim the Gluon kernels have no layout for."""
    if block_m not in QUERY_BLOCKS or head_dim not in HEAD_DIMS:
        return f"block_m={block_m}, head_dim={head_dim}: {kernel} needs block_m 64/128, head_dim 64/128/256"
    return None


def device_reason(kernel: str, device: torch.device) -> str | None:
    """A device that is not a CUDA sm_90 GPU (Hopper wgmma, TMA)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return f"device {device}: {kernel} needs a CUDA sm_90 GPU"
    return None
