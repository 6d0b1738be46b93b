"""Launch shapes of the paged attention kernel: the tiling and the H200 sweep's choice of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionTiling:
    """Launch shape of the attention kernel.

    `programs_per_sm` is how many programs of this shape one SM runs at once (shared memory and registers decide it);
    the split count is chosen so the grid fills whole waves of SMs * programs_per_sm. `num_splits` overrides that.
    `preload_pages` keeps each program's page-table slice in registers instead of loading page ids per tile.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 1
    preload_pages: bool = False
    num_splits: int | None = None


def default_tiling(head_dim: int, dtype: torch.dtype, tokens_per_user: int = 64) -> AttentionTiling:
    """The fastest tiling of the H200 sweep in benchmarks/results/kernels-h200.json (fp32, the test dtype: small).

    Users with many queries (candidates) make the kernel compute-bound: a taller query block reads each K/V tile for
    more queries. Three stages with page ids in registers let the K/V loads run two tiles ahead (1.6 -> 2.0 TB/s at
    BS=1, 16K, D=256).
    """
    if dtype == torch.float32:
        return AttentionTiling(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if tokens_per_user >= 128:
        block_n = 32 if head_dim == 256 else 64
        return AttentionTiling(block_m=128, block_n=block_n, num_warps=8, num_stages=3, preload_pages=True)
    if head_dim == 256:
        return AttentionTiling(block_m=64, block_n=64, num_warps=8, num_stages=3, preload_pages=True)
    return AttentionTiling(block_m=64, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2, preload_pages=True)


def sm_count(device: torch.device) -> int:
    """The device's SM count (4 without CUDA: the interpreter's stand-in)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
