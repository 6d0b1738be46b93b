"""Shapes and byte sizes of the paged KV cache, shared by the pools and the copy engine.

A layout is a tuple of layer groups; every layer of a group has the same heads, head dim and dtype. Uniform HSTU is one
group; models whose layers differ register one group per shape. Page and block indices are shared by all groups: a
user's page `p` holds the same tokens in every layer, and host block `b` holds them for every layer of every group.

GPU, per layer: `[num_pages, 2, rows, H, D]` (K and V of a page adjacent).
Host, per group: `[num_blocks, layers, 2, rows, H, D]` (block-first), so one layer of a run of blocks is a strided
2D copy whose pitch is `layers * layer_page_bytes`.

`rows` is `page_size` for a group that stores the model's dtype. A group of an fp8 KV cache (`kv_cache_dtype`, see
docs/fp8.md) stores one byte per element, `uint8` tensors holding fp8 codes, and each half (K, V) of a page has
`scale_rows` rows more after its `page_size` token rows: one power-of-two scale byte (E8M0: the exponent + 127) per
(token, head), laid out `[H, page_size]`. The scales are bytes of the page, so every copy, host block, SSD slot and
remote block that moves a page moves its scales with it, and a copy engine needs no notion of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerflow.model.config import DTYPES, HSTUConfig

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,                        # the model's dtype
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = tuple(d for d in KV_CACHE_DTYPES.values() if d is not None)
_GROUP_DTYPES = {**DTYPES, **{str(d).removeprefix("torch."): d for d in FP8_DTYPES}}


def fp8_scale_rows(page_size: int, head_dim: int) -> int:
    """Scale rows after the token rows of an fp8 page half: `[H, page_size]` scale bytes in `rows * H * D` bytes."""
    return -(-page_size // head_dim)


def fp8_page_size(rows: int, head_dim: int) -> int:
    """The page size whose fp8 page half has `rows` rows (the inverse of page_size + fp8_scale_rows)."""
    for scale_rows in range(1, rows):
        if fp8_scale_rows(rows - scale_rows, head_dim) == scale_rows:
            return rows - scale_rows
    raise ValueError(f"rows={rows}: no fp8 page of head dim {head_dim} has that many rows")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive integer")


@dataclass(frozen=True)
class LayerGroup:
    """Consecutive layers whose K/V pages have one shape. `dtype` is what the cache holds: a model dtype, or an fp8
    dtype (codes + per-token scales in `uint8` tensors, see the module docstring)."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim"):
            _check_positive_int(name, getattr(self, name))
        if isinstance(self.dtype, str):
            if self.dtype not in _GROUP_DTYPES:
                raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(_GROUP_DTYPES)}")
            object.__setattr__(self, "dtype", _GROUP_DTYPES[self.dtype])
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in _GROUP_DTYPES.values():
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(_GROUP_DTYPES)}")

    @property
    def quantised(self) -> bool:
        """The pages hold fp8 codes and scales rather than the model's values."""
        return self.dtype in FP8_DTYPES

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The fp8 dtype the kernels quantise to and dequantise from; None when the pages hold the model's dtype."""
        return self.dtype if self.quantised else None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the page tensors: `uint8` for fp8 (copies index raw bytes; torch has no fp8 index_copy)."""
        return torch.uint8 if self.quantised else self.dtype

    @property
    def element_size(self) -> int:
        return self.storage_dtype.itemsize

    def scale_rows(self, page_size: int) -> int:
        """Rows per page half after the token rows holding the scales: `[H, page_size]` bytes in `rows * H * D`."""
        return fp8_scale_rows(page_size, self.head_dim) if self.quantised else 0

    def page_shape(self, page_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's page on the GPU: `[2, page_size + scale_rows, H, D]`."""
        return (2, page_size + self.scale_rows(page_size), self.num_heads, self.head_dim)

    def block_shape(self, page_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one host block of this group: `[layers, 2, page_size + scale_rows, H, D]`."""
        return (self.num_layers, *self.page_shape(page_size))

    def layer_page_bytes(self, page_size: int) -> int:
        """Bytes of K and V (and their scales) of one page in one layer: the unit both tiers share."""
        _, rows, heads, dim = self.page_shape(page_size)
        return 2 * rows * heads * dim * self.element_size

    def block_bytes(self, page_size: int) -> int:
        """Bytes of one host block of this group (all its layers)."""
        return self.num_layers * self.layer_page_bytes(page_size)


@dataclass(frozen=True)
class KVLayout:
    """Layer groups plus the page size: every size the pools and the copy engine derive."""

    groups: tuple[LayerGroup, ...]
    page_size: int

    def __post_init__(self) -> None:
        if isinstance(self.groups, list):
            object.__setattr__(self, "groups", tuple(self.groups))
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ValueError(f"groups={self.groups!r}: must be a non-empty tuple of LayerGroup")
        for group in self.groups:
            if not isinstance(group, LayerGroup):
                raise ValueError(f"groups: {group!r} is not a LayerGroup")
        _check_positive_int("page_size", self.page_size)

    @classmethod
    def for_hstu(cls, config: HSTUConfig, page_size: int, kv_cache_dtype: str = "auto") -> "KVLayout":
        """One group covering every layer of a uniform HSTU model, holding `kv_cache_dtype` (a KV_CACHE_DTYPES
        name: `auto` is the model's dtype)."""
        if config.dqk != config.dv:
            raise ValueError(
                f"dqk={config.dqk} != dv={config.dv}: the paged cache stores K and V at one head dim"
            )
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {list(KV_CACHE_DTYPES)}")
        dtype = KV_CACHE_DTYPES[kv_cache_dtype] or config.dtype
        group = LayerGroup(config.num_layers, config.num_heads, config.dqk, dtype)
        return cls((group,), page_size)

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @property
    def group_ranges(self) -> tuple[range, ...]:
        """The global layers of each group, in order: what one copy call per group covers."""
        out, first = [], 0
        for g in self.groups:
            out.append(range(first, first + g.num_layers))
            first += g.num_layers
        return tuple(out)

    @property
    def layer_map(self) -> tuple[tuple[int, int], ...]:
        """Global layer -> (group index, layer within the group)."""
        return tuple((gi, li) for gi, g in enumerate(self.groups) for li in range(g.num_layers))

    def locate(self, layer: int) -> tuple[int, int]:
        """(group index, layer within the group) of a global layer."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers})")
        return self.layer_map[layer]

    def gpu_page_shape(self, group: int) -> tuple[int, int, int, int]:
        """`[2, rows, H, D]` of one GPU page of `group`."""
        return self.groups[group].page_shape(self.page_size)

    def host_block_shape(self, group: int) -> tuple[int, int, int, int, int]:
        """`[layers, 2, rows, H, D]` of one host block of `group`."""
        return self.groups[group].block_shape(self.page_size)

    def layer_page_bytes(self, group: int) -> int:
        """Bytes of one page of one layer of `group` (one row of a 2D copy)."""
        return self.groups[group].layer_page_bytes(self.page_size)

    def host_pitch(self, group: int) -> int:
        """Host bytes between a block's page of layer l and the next block's page of layer l.

        Equals the group's block bytes: the source pitch of the per-layer 2D copy.
        """
        return self.groups[group].block_bytes(self.page_size)

    def block_bytes(self, group: int) -> int:
        """Bytes of one host block of `group`."""
        return self.groups[group].block_bytes(self.page_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page index over all layers of all groups (= one block in every group's host tensor)."""
        return sum(g.block_bytes(self.page_size) for g in self.groups)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r}: must be a non-negative integer")
        return -(-num_tokens // self.page_size)

    def pages_for_gb(self, gb: float) -> int:
        """Whole pages (all layers) that fit in `gb` GiB."""
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or gb < 0:
            raise ValueError(f"gb={gb!r}: must be a non-negative number")
        return int(gb * 2**30) // self.page_bytes
