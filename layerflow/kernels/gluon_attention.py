"""Paged HSTU attention on Hopper in Gluon: wgmma for both dots, K/V tiles gathered through the page table by async
copies into a multi-stage shared-memory ring.

It computes what attention.py's `tl` kernel computes for the default mask (causal history, target-aware candidates,
no window, no contextual prefix) over a bf16/fp16 cache, with the same program grid (split, query block, head) and
the same split-K partial layout, so the `tl` kernel's split reduction sums its partials. Each program keeps its
query block in shared memory; per history tile S = Q K^T and O += SiLU(alpha S) V run on the tensor cores while
later tiles are in flight (GluonTiling.variant picks who issues the copies). A candidate's own key (not in the
pages) is one more diagonal tile of the block's K/V rows, run by split 0 through the same loop, so no scalar dot
product is needed at the end.

`GluonAttention` is launched with the `tl` kernel's arguments (`launcher[grid](...)`), so PagedAttention swaps one
for the other in a single call; `select_kernel` decides which one a PagedAttention uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from layerflow.kernels.gluon_fp8 import select_fp8_kernel
from layerflow.kernels.gluon_launcher import (GluonLauncher, chosen, device_reason, mask_reason, registers_reason,
                                             shape_reason)
from layerflow.kernels.gluon_tiles import (_issue_tile, _masked_silu, _program_range, _query_rows, _row_bounds,
                                           _row_splits, _store_partial, _tile_pages, _user_block)
from layerflow.kernels.gluon_pv import _pv_consumer, _pv_producer, _pv_upper_consumer

KERNEL_ENV = "LAYERFLOW_ATTENTION_KERNEL"
KERNEL_CHOICES = ("auto", "gluon", "triton")
KERNEL_NAME = "the Gluon kernel"   # how its refusals name it
GLUON_DTYPES = (torch.bfloat16, torch.float16)
SHARED_MEMORY_BYTES = 227 * 1024
GLUON_VARIANTS = ("sync", "pv", "pv2")
WARP_SPECIALISED = ("pv", "pv2")
GLUON_LOADERS = ("cp.async", "tma")
# The warp-specialised variant's loader partition: one warpgroup (registers are reassigned per warpgroup).
PRODUCER_WARPS = gl.constexpr(4)
# "pv2"'s upper consumer warpgroup's registers per thread (the lower one, the default partition, gets what the SM
# has left beside it and the loader).
UPPER_REGISTERS = gl.constexpr(224)
# The D=256 default's share of a wave at 64-row blocks (no candidates: bandwidth-bound): 88 of the H200's 132 SMs
# keep its HBM as busy (BS=1, 16K / 2K history: 22 splits 28.7 / 11.2 us, the wave's 33 30.4 / 13.2, 26 28.5 /
# 11.8, 16 29.4 / 11.2).
M64_FILL = 2 / 3


@dataclass(frozen=True)
class GluonTiling:
    """The Gluon kernel's own launch knobs (the query block and split count are PagedAttention's): keys per tile,
    how many tiles the shared-memory ring holds, and the tile loop's schedule:

    - "sync": the block's warps issue each tile's copies STAGES - 1 tiles ahead and run both dots synchronously;
    - "pv": warp-specialised: a loader warpgroup issues every tile's copies as soon as its slot is free (mbarriers
      per slot, K and V slots handed back separately), the block's warps wait for tiles and run the dots, the
      previous tile's P V on the tensor cores while they compute this tile's SiLU (gluon_pv);
    - "pv2": "pv" with a 128-row block's rows in two consumer warpgroups of 64, partitions of their own (neither
      waits for the other's SiLU), the upper one running no dot where the block's rows end in the lower half
      (the short last block of 256 candidates + 64 appended); 64-row blocks run "pv".

    `block_m`: query rows per program (None: PagedAttention's tl tiling's; the split count follows it). Under "pv*",
    `loader` "tma" moves whole history tiles by bulk tensor copies of page boxes (needs page_size >= block_n / 2)
    instead of every loader thread's cp.async. `tanh_silu` computes SiLU through one tanh.approx per score
    (gluon_tiles._tanh_silu_of_seen), any variant. `producer_registers`: the loader warpgroup's registers per
    thread under "pv" (a multiple of 8 in [24, 256]); the consumers get what the SM has left.
    `unmasked_whole_tiles` ("pv"): no mask on the history tiles every row of the block sees whole. `self_last`:
    the candidates' self tiles count in the split of the block's tiles and the last split runs them
    (gluon_tiles._balanced_range), instead of split 0 running them beside a full chunk. `m64_fill`: the share of a
    wave's SMs the "rows" rule fills at 64-row query blocks (splits.fill_splits: bandwidth-bound, a key tile serves
    64 queries), in (0, 1].
    """

    block_n: int = 32
    stages: int = 3
    variant: str = "sync"
    block_m: int | None = None
    loader: str = "cp.async"
    tanh_silu: bool = False
    producer_registers: int = 64
    unmasked_whole_tiles: bool = False
    self_last: bool = False
    m64_fill: float = 1.0

    def query_block(self, tl_block_m: int) -> int:
        """The query rows per program: block_m, else the `tl` tiling's."""
        return self.block_m or tl_block_m


def default_gluon_tiling(head_dim: int, page_size: int | None = None) -> GluonTiling:
    """D=256: 64-key tiles two deep, warp-specialised with the previous tile's P V during this tile's SiLU, a
    128-row block's rows in two consumer warpgroups ("pv2"), whole tiles by TMA where pages hold >= 32 keys, SiLU by
    one tanh.approx per score and without a mask on whole tiles, 64-row blocks' launches on M64_FILL of the SMs
    (the H200's fastest at 16K and 2K with 0 and 256 candidates, docs/performance.md; page_size None: assumed
    to); smaller heads: 64-key tiles three deep, synchronous (not yet measured otherwise). Both run the candidates'
    self tiles on the last split, dealt with the history (`self_last`: no program runs a full chunk and the self
    tiles; faster on the H200 at 16K and 2K)."""
    if head_dim == 256:
        tma = page_size is None or 2 * page_size >= 64
        return GluonTiling(block_n=64, stages=2, variant="pv2", loader="tma" if tma else "cp.async", tanh_silu=True,
                           unmasked_whole_tiles=True, self_last=True, m64_fill=M64_FILL)
    return GluonTiling(block_n=64, stages=3, self_last=True)


# The K/V ring's and the query block's shared-memory layout (128-byte swizzle, what wgmma reads), also the TMA boxes'.
SMEM_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


@gluon.jit
def _slot_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """(ready, empty): an mbarrier per ring slot each, initialised: ready of count 1 (the loader), empty of count
    CONSUMERS (each consumer partition hands the slot back)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):
        mbarrier.init(ready.index(t), count=1)
        mbarrier.init(empty.index(t), count=CONSUMERS)
    return ready, empty


@gluon.jit(do_not_specialize=["num_splits"])
def _gluon_attention_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr, inv_n_ptr,
    dst_ptr, q_stride, k_stride, v_stride, page_table_stride, split_stride, max_batch, alpha, num_splits, cache_desc,
    split_table_ptr, active_splits_ptr,
    H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BATCH_P2: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, INV_N_PER_USER: gl.constexpr, ROWS: gl.constexpr,
    WARP_SPECIALIZE: gl.constexpr, TMA: gl.constexpr, TANH: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
    WHOLE: gl.constexpr, SELF_LAST: gl.constexpr, HALVES: gl.constexpr, num_warps: gl.constexpr,
):
    split = gl.program_id(0)
    head = gl.program_id(2)
    if split_table_ptr is not None:     # the "rows" rule: this launch's count, programs past it exit
        num_splits = _row_splits(q_offsets_ptr, max_batch, split_table_ptr, active_splits_ptr, BATCH_P2, BLOCK_M,
                                 num_warps)
        if split >= num_splits:
            return
    user, block = _user_block(q_offsets_ptr, gl.program_id(1), max_batch, BATCH_P2, BLOCK_M, num_warps)
    if user >= max_batch:
        return
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # [rows, D] global tiles: 16-byte vectors along D, warps stacked along the rows.
    cols_per_warp: gl.constexpr = 32 if D // 8 >= 32 else D // 8
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_per_warp, cols_per_warp], [num_warps, 1],
                                                 [1, 0])
    smem_layout: gl.constexpr = SMEM_LAYOUT
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles = _program_range(
        q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits, BLOCK_M, BLOCK_N,
        SELF_LAST)

    # The query block, once, into shared memory (wgmma's A operand); under "pv" its consumer stores it (gluon_pv),
    # under "pv2" each consumer its half (the upper one into q_upper, below).
    ROWS_M: gl.constexpr = BLOCK_M // HALVES
    if WARP_SPECIALIZE:
        q_block = gl.allocate_shared_memory(dtype, [ROWS_M, D], smem_layout)
    else:
        q_block = gl.allocate_shared_memory(dtype, [BLOCK_M, D], smem_layout,
                                            _query_rows(q_ptr, q_stride, q_start, row0, q_len, head, D, BLOCK_M,
                                                        load_layout))
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)

    page_row = page_table_ptr + user * page_table_stride
    cache_h = cache_ptr + head * D
    if INV_N_PER_USER:
        inv_n = gl.load(inv_n_ptr + user)
    else:
        inv_n = gl.load(inv_n_ptr)
    if WARP_SPECIALIZE:
        # The "pv" schedule (gluon_pv): ready[s] / v_ready[s]: K / V slot s holds its tile (the producer's copies
        # landed); empty[s] / v_empty[s]: the consumer is done with it.
        ready, empty = _slot_barriers(STAGES, HALVES)
        v_ready, v_empty = _slot_barriers(STAGES, HALVES)
        # What the loader reads whole history tiles through: the TMA descriptor, else the head's pointer (unused).
        if TMA:
            pool = cache_desc
        else:
            pool = cache_h
        fence_async_shared()
        gl.thread_barrier()
        if HALVES == 2:
            q_upper = gl.allocate_shared_memory(dtype, [ROWS_M, D], smem_layout)
            gl.warp_specialize([
                (_pv_consumer, (q_block, k_ring, v_ring, ready, v_ready, empty, v_empty, num_tiles, num_hist, lo,
                                hi, alpha, appended, hist, inv_n, dst_ptr, split, split_stride, q_ptr, q_stride,
                                q_start, row0, q_len, head, H, D, ROWS_M, BLOCK_N, STAGES, TANH, WHOLE, 0,
                                load_layout, s_layout, o_layout, p_layout)),
                (_pv_upper_consumer, (q_upper, k_ring, v_ring, ready, v_ready, empty, v_empty, num_tiles, num_hist,
                                      lo, hi, alpha, appended, hist, inv_n, dst_ptr, split, split_stride, q_ptr,
                                      q_stride, q_start, row0, q_len, head, H, D, ROWS_M, BLOCK_N, STAGES, TANH,
                                      WHOLE, ROWS_M, load_layout, s_layout, o_layout, p_layout)),
                (_pv_producer, (k_ring, v_ring, ready, v_ready, empty, v_empty, num_tiles, num_hist, lo, hi,
                                page_row, cache_h, pool, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0,
                                H, D, PAGE, ROWS, BLOCK_N, STAGES, TMA)),
            ], [num_warps, PRODUCER_WARPS], [UPPER_REGISTERS, PRODUCER_REGISTERS])
        else:
            gl.warp_specialize([
                (_pv_consumer, (q_block, k_ring, v_ring, ready, v_ready, empty, v_empty, num_tiles, num_hist, lo,
                                hi, alpha, appended, hist, inv_n, dst_ptr, split, split_stride, q_ptr, q_stride,
                                q_start, row0, q_len, head, H, D, ROWS_M, BLOCK_N, STAGES, TANH, WHOLE, 0,
                                load_layout, s_layout, o_layout, p_layout)),
                (_pv_producer, (k_ring, v_ring, ready, v_ready, empty, v_empty, num_tiles, num_hist, lo, hi,
                                page_row, cache_h, pool, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0,
                                H, D, PAGE, ROWS, BLOCK_N, STAGES, TMA)),
            ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])
    else:
        # Which keys each row sees (_row_bounds), for the whole block.
        r, self_end, hist_end = _row_bounds(0, BLOCK_M, row0, q_len, appended, hist, hi, s_layout)
        key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        for t in gl.static_range(STAGES - 1):
            _issue_tile(k_ring.index(t), v_ring.index(t), t,
                        _tile_pages(page_row, t, lo, hi, PAGE, BLOCK_N, load_layout), num_hist, num_tiles, lo, hi,
                        cache_h, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS,
                        BLOCK_N, load_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
        for tile in range(num_tiles):
            # Tile `tile` has landed for every thread, and every warp is done with the slot refilled next.
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            fence_async_shared()
            ahead = tile + STAGES - 1
            _issue_tile(k_ring.index(ahead % STAGES), v_ring.index(ahead % STAGES), ahead,
                        _tile_pages(page_row, ahead, lo, hi, PAGE, BLOCK_N, load_layout), num_hist, num_tiles, lo,
                        hi, cache_h, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS,
                        BLOCK_N, load_layout)
            k_tile = k_ring.index(tile % STAGES)
            s = warpgroup_mma(q_block, k_tile.permute((1, 0)), s_zero, use_acc=False) * alpha
            p = _masked_silu(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
            p = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p, v_ring.index(tile % STAGES), acc)
        async_copy.wait_group(0)
        _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H, D, BLOCK_M, o_layout)


def shared_memory_bytes(block_m: int, head_dim: int, tiling: GluonTiling, itemsize: int = 2) -> int:
    """The query block plus the K/V ring, plus 2 KiB for the mbarriers and what the compiler adds (sm_90 builds of
    every schedule, D=256, asked for at most 0.3 KiB beyond the buffers)."""
    return (block_m + 2 * tiling.stages * tiling.block_n) * head_dim * itemsize + 2 * 1024


def tiling_reason(tiling: GluonTiling) -> str | None:
    """What is wrong with `tiling` on any shape (None when nothing is)."""
    if tiling.block_n not in (32, 64) or tiling.stages < 2:
        return f"{tiling}: block_n must be 32 or 64 and stages >= 2"
    if tiling.variant not in GLUON_VARIANTS:
        return f"{tiling}: variant must be one of {GLUON_VARIANTS}"
    if tiling.block_m not in (None, 64, 128) or tiling.loader not in GLUON_LOADERS:
        return f"{tiling}: block_m must be None, 64 or 128, loader one of {GLUON_LOADERS}"
    if (tiling.loader == "tma" or tiling.unmasked_whole_tiles) and tiling.variant not in WARP_SPECIALISED:
        return f"{tiling}: the TMA loader and unmasked whole tiles need variant 'pv' or 'pv2'"
    if not 0 < tiling.m64_fill <= 1:
        return f"{tiling}: m64_fill must be in (0, 1]"
    return registers_reason(tiling)


def unsupported_reason(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None, head_dim: int,
                       block_m: int, window: int, contextual: int, tiling: GluonTiling,
                       page_size: int | None = None) -> str | None:
    """Why the Gluon kernel cannot serve this attention (None when it can; page_size None: not checked)."""
    if dtype not in GLUON_DTYPES or kv_dtype is not None:
        return f"dtype={dtype}, kv_dtype={kv_dtype}: the Gluon kernel needs a bf16/fp16 cache"
    block_m = tiling.query_block(block_m)
    reason = mask_reason(KERNEL_NAME, window, contextual) or tiling_reason(tiling) or \
        shape_reason(KERNEL_NAME, block_m, head_dim)
    if reason is not None:
        return reason
    if tiling.loader == "tma" and page_size is not None and 2 * page_size < tiling.block_n:
        return f"{tiling} at page_size={page_size}: the TMA loader needs page_size >= block_n / 2"
    if shared_memory_bytes(block_m, head_dim, tiling) > SHARED_MEMORY_BYTES:
        return f"{tiling} at block_m={block_m}, head_dim={head_dim}: over {SHARED_MEMORY_BYTES} bytes of shared memory"
    return device_reason(KERNEL_NAME, device)


class GluonAttention(GluonLauncher):
    """The bf16/fp16 Gluon kernel behind the `tl` kernel's launch interface (it ignores the `tl`-only tiling knobs)."""

    tiling_reason = staticmethod(tiling_reason)
    row_splits = True

    def wave_fill(self, block_m: int) -> float:
        """The tiling's m64_fill at 64-row blocks, else the whole wave."""
        return self.tiling.m64_fill if block_m == 64 else 1.0

    def _launch(self, grid: tuple[int, int, int], *args, H: int, D: int, PAGE: int, BATCH_P2: int, NUM_SPLITS: int,
                BLOCK_M: int, INV_N_PER_USER: bool, ROWS: int, WINDOW: int, CONTEXTUAL: int, FP8: int,
                split_table_ptr: torch.Tensor | None = None, active_splits_ptr: torch.Tensor | None = None,
                **tl_tiling) -> None:
        if WINDOW or CONTEXTUAL or FP8:
            raise ValueError(f"WINDOW={WINDOW}, CONTEXTUAL={CONTEXTUAL}, FP8={FP8}: the Gluon kernel serves the "
                             "default mask over a bf16/fp16 cache only")
        t = self.tiling
        halves = 2 if t.variant == "pv2" and BLOCK_M == 128 else 1
        cache_desc = None
        if t.loader == "tma":
            if 2 * PAGE < t.block_n:
                raise ValueError(f"{t} at page_size={PAGE}: the TMA loader needs page_size >= block_n / 2")
            kv_cache = args[3]
            cache_desc = TensorDescriptor(kv_cache, [kv_cache.numel() // (H * D), H * D], [H * D, 1],
                                          [min(PAGE, t.block_n), D], SMEM_LAYOUT.value)
        _gluon_attention_kernel[grid](*args, num_splits=NUM_SPLITS, cache_desc=cache_desc,
                                      split_table_ptr=split_table_ptr, active_splits_ptr=active_splits_ptr, H=H, D=D,
                                      PAGE=PAGE, BATCH_P2=BATCH_P2, BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, STAGES=t.stages,
                                      INV_N_PER_USER=INV_N_PER_USER, ROWS=ROWS,
                                      WARP_SPECIALIZE=t.variant in WARP_SPECIALISED, TMA=t.loader == "tma",
                                      TANH=t.tanh_silu, PRODUCER_REGISTERS=t.producer_registers,
                                      WHOLE=t.unmasked_whole_tiles, SELF_LAST=t.self_last, HALVES=halves,
                                      num_warps=BLOCK_M // 16 // halves)


def select_kernel(choice: str | None, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None,
                  head_dim: int, block_m: int, window: int, contextual: int,
                  tiling: GluonTiling | None = None, page_size: int | None = None) -> GluonAttention | None:
    """The Gluon launcher, or None for the `tl` kernel.

    `choice` (else the LAYERFLOW_ATTENTION_KERNEL variable, else "auto"): "auto" takes Gluon where it can run,
    "gluon" insists on it (ValueError naming why it cannot), "triton" never takes it.
    """
    choice = choice or os.environ.get(KERNEL_ENV) or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernel={choice!r}: expected one of {KERNEL_CHOICES} (argument or ${KERNEL_ENV})")
    if choice == "triton":
        return None
    if kv_dtype is not None:
        return select_fp8_kernel(choice, device, dtype, kv_dtype, head_dim, block_m, window, contextual,
                                 page_size=page_size)
    tiling = tiling or default_gluon_tiling(head_dim, page_size)
    reason = unsupported_reason(device, dtype, kv_dtype, head_dim, block_m, window, contextual, tiling, page_size)
    return chosen(choice, reason, lambda: GluonAttention(tiling))
