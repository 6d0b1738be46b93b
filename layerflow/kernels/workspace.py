"""One fp32 scratch buffer for the split-K partials of several attentions that never run at the same time.

Every shape bucket has its own PagedAttention (its split count and token capacity differ), but the engine runs one
bucket's graph at a time, so their partials can live in one buffer instead of one per bucket (3 GB on the finest token
ladder). A view handed out keeps its buffer alive: when a later attention needs more than the buffer holds, a new one
at least twice as large is allocated and the graphs already captured keep the old one, so capture order changes how
much memory is held (at most ~4x the largest need) and never which memory a graph reads. A caller that knows every
need up front (the pipeline's TritonKernels.reserve) sizes the buffer once instead.
"""

from __future__ import annotations

import math

import torch


class SplitWorkspace:
    """Hands out views of one float32 buffer on `device`, each starting at its first element; `numel`: its size to
    begin with (a caller that knows the largest need allocates it once)."""

    def __init__(self, device: torch.device | str, numel: int = 0):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel={numel!r}: expected a non-negative integer")
        self.device = torch.device(device)
        self._buffer = torch.empty(numel, dtype=torch.float32, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer new views come from (earlier, smaller buffers held by old views not included)."""
        return self._buffer.nbytes

    def view(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous float32 view of `shape` over the buffer (grown first if it is too small)."""
        if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in shape):
            raise ValueError(f"shape={shape!r}: expected positive integers")
        need = math.prod(shape)
        if need > self._buffer.numel():
            self._buffer = torch.empty(max(need, 2 * self._buffer.numel()), dtype=torch.float32, device=self.device)
        return self._buffer[:need].view(shape)
