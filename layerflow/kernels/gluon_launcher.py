"""The launch interface every Gluon attention kernel offers PagedAttention: the `tl` kernel's (`launcher[grid](*args,
**constexprs)`), so PagedAttention swaps one kernel for another in a single call; and the one rule by which a
kernel choice ("auto" / "gluon") turns into a launcher or into the `tl` kernel."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable


class GluonLauncher(ABC):
    """A Gluon kernel behind the `tl` kernel's launch interface, with its tiling checked at construction."""

    def __init__(self, tiling) -> None:
        reason = self.tiling_reason(tiling)
        if reason is not None:
            raise ValueError(reason)
        self.tiling = tiling

    @staticmethod
    @abstractmethod
    def tiling_reason(tiling) -> str | None:
        """What is wrong with `tiling` on any shape (None when nothing is)."""

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
