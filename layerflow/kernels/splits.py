"""Split-K bookkeeping of the paged attention: how many splits a launch takes, and the sum of their partials.

A split count fills whole waves of the GPU's SMs. It is chosen at each launch from the batch's real query blocks
("rows", the default): a table made at construction, read on the device, so a captured graph for 512 tokens launches
a 320-token batch's programs in one wave of 132 SMs instead of 1.4 (the grid stays the capacity's and the programs
past the count exit at once; the launch stores its count where the split sum reads it). "bucket" fixes the count
once from the capacity: the rule of a kernel that reads no table (the fp8 Gluon kernel unless its tiling's
`row_splits`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SPLIT_RULES = ("rows", "bucket")


class SplitPartials(NamedTuple):
    """A split kernel's unsummed fp32 partials [splits, max_tokens, H, D] and, under the "rows" rule, the device count
    [1] of those its launch wrote (None: every split)."""

    partials: torch.Tensor
    active: torch.Tensor | None


def split_rule(choice: str) -> str:
    """`choice` checked: ValueError naming a rule not in SPLIT_RULES."""
    if choice not in SPLIT_RULES:
        raise ValueError(f"splits={choice!r}: expected one of {SPLIT_RULES}")
    return choice


def wave_splits(programs: int, slots: int, max_splits: int) -> int:
    """The fewest splits (1..max_splits) whose grid of `programs` per split fills whole waves of `slots` to >= 90%
    (208 programs on 132 SMs run two waves for 1.6 waves of work: the idle SMs cost as much as the split-K gains),
    else the count that fills them best."""
    best, best_fill = 1, 0.0
    for splits in range(1, max_splits + 1):
        total = programs * splits
        fill = total / (triton.cdiv(total, slots) * slots)
        if total >= slots and fill >= 0.9:
            return splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


def fill_splits(programs: int, slots: int, max_splits: int, fill: float = 1.0) -> int:
    """wave_splits; with `fill` < 1, where one wave holds that many splits' programs, the fewest splits whose grid
    takes `fill` of the wave's slots instead: a bandwidth-bound launch keeps the memory as busy on fewer SMs, and
    fewer splits store and sum fewer fp32 partials (H200, BS=1, 64-row blocks, 4 heads, no candidates: 22 splits
    28.7 / 11.2 us at 16K / 2K history against 30.4 / 13.2 at the wave's 33)."""
    splits = wave_splits(programs, slots, max_splits)
    if fill >= 1 or programs * splits > slots:
        return splits
    return min(splits, max(1, -(-round(fill * slots) // programs)))


def rows_table(query_slots: int, heads: int, slots: int, max_splits: int, fill: float = 1.0) -> list[int]:
    """The "rows" rule's split count for every count n = 0..query_slots of real query blocks (n = 0: one), each
    filling `fill` of a wave where one wave holds it (fill_splits)."""
    return [1] + [fill_splits(n * heads, slots, max_splits, fill) for n in range(1, query_slots + 1)]


@triton.jit
def _query_blocks(q_offsets_ptr, max_batch, BATCH_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(users, valid, blocks): each user's query blocks, ceil(len / BLOCK_M), over BATCH_P2 lanes (0 past the batch)."""
    users = tl.arange(0, BATCH_P2)
    valid = users < max_batch
    starts = tl.load(q_offsets_ptr + users, mask=valid, other=0)
    ends = tl.load(q_offsets_ptr + users + 1, mask=valid, other=0)
    return users, valid, tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)


@triton.jit
def _row_splits(q_offsets_ptr, max_batch, split_table_ptr, active_splits_ptr, BATCH_P2: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The launch's split count under the "rows" rule: the table's entry for the batch's real query blocks; program
    (0, 0, 0) also stores it where the split sum reads it."""
    _, _, blocks = _query_blocks(q_offsets_ptr, max_batch, BATCH_P2, BLOCK_M)
    splits = tl.load(split_table_ptr + tl.sum(blocks, axis=0))
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    tl.store(active_splits_ptr, splits, mask=first)
    return splits


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, q_offsets_ptr, split_stride, max_batch, active_splits_ptr,
                       HD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the split partials over the batch's tokens (the first *active_splits_ptr of them where it is
    given), all loaded at once and reduced by a tree fixed at compile time: the same bits on every run."""
    total = tl.load(q_offsets_ptr + max_batch).to(tl.int64) * HD
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start >= total:
        return
    offsets = start + tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS_P2)
    ok = offsets < total
    num_splits = NUM_SPLITS
    if active_splits_ptr is not None:
        num_splits = tl.load(active_splits_ptr)
    ptrs = partial_ptr + splits[:, None].to(tl.int64) * split_stride + offsets[None, :]
    parts = tl.load(ptrs, mask=(splits[:, None] < num_splits) & ok[None, :], other=0.0)
    tl.store(out_ptr + offsets, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=ok)


def sum_splits(split: SplitPartials, out: torch.Tensor, q_offsets: torch.Tensor, max_batch: int) -> torch.Tensor:
    """`out` [max_tokens, H, D] = the sum of `split`'s partials over the batch's tokens (q_offsets[max_batch])."""
    num_splits, max_tokens = split.partials.shape[:2]
    split_stride, splits_p2 = split.partials[0].numel(), triton.next_power_of_2(num_splits)
    block = max(16, 8192 // splits_p2)
    _sum_splits_kernel[(triton.cdiv(split_stride, block),)](
        split.partials, out, q_offsets, split_stride, max_batch, split.active, HD=split_stride // max_tokens,
        NUM_SPLITS=num_splits, SPLITS_P2=splits_p2, BLOCK=block, num_warps=4,
    )
    return out
