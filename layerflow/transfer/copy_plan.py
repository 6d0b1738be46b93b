"""Split a transfer's (gpu page, host block) pairs into runs contiguous on both sides, once per transfer, and a
batch of per-page copies into chunks that keep the copy engine fed (the copy engines never loop over pages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def _as_index(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name}: negative index {int(arr.min())}")
    return arr


_SHORT = 64   # up to this many pairs, a tuple or list that is one run is recognised without numpy


def _one_run(values: Sequence[int] | np.ndarray) -> bool:
    """Whether `values` is a short (1.._SHORT) tuple or list of plain non-negative ints that count up by one: checked
    on the Python objects (a type set and one comparison with a range), which for the few pages of an offload costs a
    fraction of the numpy conversions and differences of the general path (and more than them for long ones)."""
    if type(values) not in (tuple, list) or not 0 < len(values) <= _SHORT or set(map(type, values)) != {int}:
        return False
    first = values[0]
    return first >= 0 and list(values) == list(range(first, first + len(values)))


def plan_runs(gpu_pages: Sequence[int] | np.ndarray, host_blocks: Sequence[int] | np.ndarray) -> CopyPlan:
    """Pair `gpu_pages[i]` with `host_blocks[i]`; a run continues while both sides advance by one."""
    if _one_run(gpu_pages) and _one_run(host_blocks) and len(gpu_pages) == len(host_blocks):
        gpu, host = np.array(gpu_pages, dtype=np.int64), np.array(host_blocks, dtype=np.int64)
        return CopyPlan(gpu, host, gpu[:1], host[:1], np.array([gpu.size], dtype=np.int64))
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
