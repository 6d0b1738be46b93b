"""Paged KV on the GPU: one page tensor per layer, page lists per user, LRU eviction of offloaded users."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerflow.tier.layout import KVLayout
from layerflow.tier.user_pages import UserPages


class GpuKVPool(UserPages):
    """`kv[layer]` is `[num_pages, 2, rows, H, D]` of the group's storage dtype (layerflow.tier.layout: `rows` is the
    page size, plus the scale rows of an fp8 cache); a page index means the same tokens in every layer.

    Eviction never happens behind the caller's back: a GPU page may only be dropped once its KV is safe elsewhere,
    which only the KV manager knows, so `allocate` evicts only with a `can_drop`, and `evict_until` needs one.
    """

    drop_by_default = False
    unit = "page"

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu",
                 layers: Sequence[torch.Tensor] | None = None) -> None:
        """`layers`: per-layer page tensors allocated elsewhere (e.g. in shared memory a transfer server maps), used
        as they are; they must have this pool's shapes, dtypes and device."""
        super().__init__(num_pages, layout.page_size)
        self.layout = layout
        self.device = torch.device(device)
        shapes = [((num_pages, *layout.gpu_page_shape(g)), layout.groups[g].storage_dtype)
                  for g, _ in layout.layer_map]
        if layers is None:
            self.kv: list[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=self.device)
                                           for shape, dtype in shapes]
            return
        if len(layers) != len(shapes):
            raise ValueError(f"layers: {len(layers)} tensors for a layout of {len(shapes)} layers")
        for i, (t, (shape, dtype)) in enumerate(zip(layers, shapes)):
            if tuple(t.shape) != shape or t.dtype != dtype or not _on(t, self.device) or not t.is_contiguous():
                raise ValueError(f"layers[{i}]: {tuple(t.shape)} {t.dtype} on {t.device}, expected a contiguous "
                                 f"{shape} {dtype} on {self.device}")
        self.kv = list(layers)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """`t` lives on `device` ("cuda" without an index accepts any CUDA device)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)
