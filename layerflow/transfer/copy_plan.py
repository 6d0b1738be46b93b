"""Split a transfer's (gpu page, host block) pairs into runs contiguous on both sides, once per transfer, and a
batch of per-page copies into chunks that keep the copy engine fed (the copy engines never loop over pages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np


@dataclass(frozen=True)
class CopyPlan:
    """The pairs of one transfer and their runs (all int64 arrays)."""

    gpu_pages: np.ndarray
    host_blocks: np.ndarray
    run_gpu: np.ndarray
    run_host: np.ndarray
    run_len: np.ndarray

    @property
    def num_pages(self) -> int:
        return int(self.gpu_pages.size)

    @property
    def num_runs(self) -> int:
        return int(self.run_len.size)


class Run(NamedTuple):
    """`pages` pairs contiguous on both sides: GPU pages from `gpu_page`, host blocks from `host_block`."""

    gpu_page: int
    host_block: int
    pages: int

    def plan(self) -> CopyPlan:
        """The run as a CopyPlan (one run)."""
        gpu = np.arange(self.gpu_page, self.gpu_page + self.pages, dtype=np.int64)
        host = np.arange(self.host_block, self.host_block + self.pages, dtype=np.int64)
        return CopyPlan(gpu, host, gpu[:1], host[:1], np.array([self.pages], dtype=np.int64))


def _as_index(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name}: negative index {int(arr.min())}")
    return arr


def _one_run(values: Sequence[int] | np.ndarray) -> bool:
    """Whether `values` is a non-empty tuple or list of plain non-negative ints that count up by one: its ends are
    checked first (O(1): most placements that are not one run fail there), then one comparison with the range they
    span. A user's pages are one run in the common case, and this costs a fraction of the numpy conversions and
    differences of the general path (64 pages: ~3 against ~9 us on the CPU; 512: ~13 against ~37)."""
    if type(values) not in (tuple, list) or not values:
        return False
    first, last = values[0], values[-1]
    if type(first) is not int or type(last) is not int or first < 0 or last - first != len(values) - 1:
        return False
    return values == type(values)(range(first, last + 1))


def single_run(gpu_pages: Sequence[int] | np.ndarray, host_blocks: Sequence[int] | np.ndarray) -> Run | None:
    """The pairs as one Run when both are non-empty lists or tuples of plain ints counting up by one, of one length
    (a host-resident user's common placement), else None; no numpy."""
    if len(gpu_pages) == len(host_blocks) and _one_run(gpu_pages) and _one_run(host_blocks):
        return Run(gpu_pages[0], host_blocks[0], len(gpu_pages))
    return None


def plan_runs(gpu_pages: Sequence[int] | np.ndarray, host_blocks: Sequence[int] | np.ndarray) -> CopyPlan:
    """Pair `gpu_pages[i]` with `host_blocks[i]`; a run continues while both sides advance by one."""
    run = single_run(gpu_pages, host_blocks)
    if run is not None:
        return run.plan()
    gpu = _as_index("gpu_pages", gpu_pages)
    host = _as_index("host_blocks", host_blocks)
    if gpu.size != host.size:
        raise ValueError(f"gpu_pages has {gpu.size} entries but host_blocks has {host.size}")
    if gpu.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return CopyPlan(gpu, host, empty, empty, empty)
    breaks = (np.diff(gpu) != 1) | (np.diff(host) != 1)
    if not breaks.any():
        return CopyPlan(gpu, host, gpu[:1], host[:1], np.array([gpu.size], dtype=np.int64))
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.concatenate((starts, [gpu.size])))
    return CopyPlan(gpu, host, gpu[starts], host[starts], lengths)


def ramp_bounds(n: int, first: int = 8) -> list[int]:
    """Chunk bounds 0, first, 3 first, 7 first, ..., n: chunk sizes doubling from `first`, the last chunk taking
    whatever is left (up to three times the chunk before it) so no short call trails at the end.

    Why: the driver queues a batch only when its call returns, and the call's time grows with its entries, so the
    first layer in one call would leave the copy engine idle for the whole call. A short first chunk starts the copy
    early, and every later chunk is queued before the ones ahead of it finish copying (docs/performance.md,
    Transfers, has the figures).
    """
    bounds, size = [0], first
    while bounds[-1] < n:
        rest = n - bounds[-1]
        bounds.append(n if rest < 3 * size else bounds[-1] + size)
        size *= 2
    return bounds
